#!/usr/bin/env python3
"""Make draftfeed's golden models and hidden states with Hugging Face transformers.

Usage:  python3 tests/data/make_goldens.py --out DIR [--only all|dense|moe]

(--only moe runs make_moe_goldens.py: the MoE models, merged into DIR/goldens_report.json.)

Builds three small random-weight models with transformers' own classes (seeded), saves
them in HF format (config.json + safetensors), runs each test sequence ALONE through
transformers (batch 1, position_ids = arange(L)[None], attention_mask None, use_cache
False, output_hidden_states True, eager attention) in fp32 (the canonical reference,
run on the CPU: IEEE fp32, no TF32) and in bf16 (for the record, on the GPU when there
is one), and writes inputs and expected hidden states.

One file past ~600 lines on purpose: it is the record of how the checked-in goldens were
made, run once where transformers is installed, so the configs, the init rules and the
writers are read together beside the data they produced.

Writes, under DIR (the layout of tests/data/):
  models/qwen35_text/   Qwen3_5ForCausalLM checkpoint (model.* naming, one file)
  models/qwen35_mm/     the same text weights in Qwen3_5ForConditionalGeneration naming
                        (model.language_model.*), a tiny vision tower (model.visual.*),
                        15 fake MTP tensors (mtp.*), 4 shards + model.safetensors.index.json
  models/qwen3/         Qwen3ForCausalLM checkpoint (tied embeddings: no lm_head.weight)
  goldens_<model>.safetensors   inputs + expected hidden states (F32 / I32), see below
  goldens_report.json   environment, GDN path, consistency checks, bf16-vs-fp32 errors

Golden tensors, for sequence i (lengths in SEQ_LENS) and dtype d in {fp32, bf16}:
  seq{i}.input_ids      I32 [T]
  seq{i}.{d}.embed      F32 [T, H]      hidden_states[0] (embedding output)
  seq{i}.{d}.layer_out  F32 [T, N, H]   row j = raw residual-stream output of decoder
                                        layer j: hidden_states[j+1] for j < N-1, and a
                                        forward hook on layers[N-1] for j = N-1
  seq{i}.{d}.final      F32 [T, H]      hidden_states[N] (final norm applied)
bf16 values are stored as F32 (exactly: every bf16 is an F32).
"""

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

# Deterministic cuBLAS and no hub access; must be set before torch/transformers import.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SEED = 20260101
SEQ_LENS = [1, 17, 63, 64, 65, 130]

# ----------------------------------------------------------------------------------------
# Model shapes
# ----------------------------------------------------------------------------------------
# rope_theta: the real Qwen3.5/3.6 uses 1e7. With head_dim 32 and partial_rotary_factor
# 0.25 the rotary slice is only 8 wide (4 frequencies): with theta 1e7 the frequencies are
# 1, 1.8e-2, 3.2e-4, 5.6e-6 rad/token, so over <= 130 tokens only the first one turns
# appreciably and a wrong pairing or a wrong theta would hardly show. theta 10000 gives
# 1, 0.1, 0.01, 0.001 rad/token: at least three of the four pairs rotate visibly, so RoPE
# mistakes (pairing, partial slice, table dtype) change the goldens. Loaders must read
# theta from rope_parameters anyway, so nothing is lost by not using 1e7 here.
ROPE_THETA = 10000.0

# GDN layers and full-attention layers mixed; the last layer is full attention (as in the
# 27B, whose layer 63 is full attention), layer 0 is a GDN layer (as in the 27B).
QWEN35_LAYER_TYPES = [
    "linear_attention",
    "linear_attention",
    "full_attention",
    "linear_attention",
    "linear_attention",
    "full_attention",
]

QWEN35_TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=len(QWEN35_LAYER_TYPES),
    layer_types=list(QWEN35_LAYER_TYPES),
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA ratio 2
    head_dim=32,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    attention_bias=False,
    tie_word_embeddings=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=6,  # GVA ratio 3, like the 27B (48 V heads / 16 QK heads)
    # larger than the 0.02 default so every sub-block contributes visibly to the
    # residual stream (embeddings / projections N(0, 0.05))
    initializer_range=0.05,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": ROPE_THETA,
        "partial_rotary_factor": 0.25,  # rotary dim 8 of head_dim 32
        # text-only: the three position rows are equal, so mRoPE == 1-D RoPE; the section
        # is sized for this model's 4 frequencies (the 27B has [11, 11, 10] for 32)
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)

# Special token ids of the multimodal config, inside this tiny vocabulary; the random
# sequences of the qwen3.5 models avoid them (ids < 504).
QWEN35_SPECIAL = dict(
    vision_start_token_id=504,
    vision_end_token_id=505,
    image_token_id=506,
    video_token_id=507,
)
QWEN35_MAX_TOKEN = 504

QWEN35_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    in_channels=3,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,  # = text hidden size
    num_position_embeddings=16,  # a 4x4 grid
)

QWEN3 = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    attention_bias=False,
    tie_word_embeddings=True,
    use_sliding_window=False,
    initializer_range=0.05,
    rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
)

PROBLEMS = []  # consistency failures: reported at the end, exit status 1
NOTES = []  # observations worth reporting (not failures)


def problem(msg):
    PROBLEMS.append(msg)
    print(f"!!! PROBLEM: {msg}", flush=True)


def note(msg):
    NOTES.append(msg)
    print(f"--- note: {msg}", flush=True)


# ----------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------
def set_fp32_exact():
    """No TF32 anywhere: the fp32 reference must be IEEE fp32 math."""
    for what, fn in [
        ("cuda.matmul.allow_tf32=False", lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", False)),
        ("cudnn.allow_tf32=False", lambda: setattr(torch.backends.cudnn, "allow_tf32", False)),
        ("cudnn.deterministic=True", lambda: setattr(torch.backends.cudnn, "deterministic", True)),
        ("cudnn.benchmark=False", lambda: setattr(torch.backends.cudnn, "benchmark", False)),
    ]:
        try:
            fn()
        except Exception as e:  # pragma: no cover - depends on torch version
            print(f"(could not set {what}: {e!r})")


def gdn_environment():
    """What could make HF leave the torch fallbacks: importable kernel packages."""
    env = {}
    for mod in ["fla", "causal_conv1d", "kernels", "flash_attn"]:
        try:
            env[f"importable_{mod}"] = importlib.util.find_spec(mod) is not None
        except Exception as e:
            env[f"importable_{mod}"] = f"error {e!r}"
    try:
        from transformers.utils import import_utils as iu

        for fn in ["is_flash_linear_attention_available", "is_causal_conv1d_available", "is_kernels_available"]:
            if hasattr(iu, fn):
                try:
                    env[fn] = bool(getattr(iu, fn)())
                except Exception as e:
                    env[fn] = f"error {e!r}"
    except Exception as e:
        env["import_utils"] = f"error {e!r}"
    return env


class CallCounter:
    """Counts calls of torch functions that only HF's torch fallbacks use for the GDN:
    torch.linalg.solve_triangular (torch_chunk_gated_delta_rule's UT solve) and
    F.conv1d (the torch causal_conv1d_fn). Patched by attribute, so the modeling code's
    `torch.linalg.solve_triangular` / `F.conv1d` look-ups at call time see the wrapper."""

    def __init__(self):
        self.counts = {"torch.linalg.solve_triangular": 0, "F.conv1d": 0}
        self._orig = {}

    def __enter__(self):
        self._orig["st"] = torch.linalg.solve_triangular
        self._orig["c1"] = torch.nn.functional.conv1d
        st, c1 = self._orig["st"], self._orig["c1"]

        def solve_triangular(*a, **k):
            self.counts["torch.linalg.solve_triangular"] += 1
            return st(*a, **k)

        def conv1d(*a, **k):
            self.counts["F.conv1d"] += 1
            return c1(*a, **k)

        torch.linalg.solve_triangular = solve_triangular
        torch.nn.functional.conv1d = conv1d
        return self

    def __exit__(self, *exc):
        torch.linalg.solve_triangular = self._orig["st"]
        torch.nn.functional.conv1d = self._orig["c1"]
        return False


# ----------------------------------------------------------------------------------------
# Building and saving models
# ----------------------------------------------------------------------------------------
def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn_like(t, g, std, mean=0.0):
    return (torch.randn(t.shape, generator=g, dtype=torch.float32) * std + mean).to(t.dtype)


def perturb_qwen35(model, seed):
    """Move the parameters that random init leaves at exact 0/1 (or in a narrow range) so a
    convention mix-up would show: zero-centred RMSNorms (input/post-attention/final norm,
    q_norm, k_norm: y = x^ * (1 + w), init 0) -> N(0, 0.1); the GDN gated norm
    (multiplicative, init 1) -> 1 + N(0, 0.1); dt_bias (init 1) -> 1 + N(0, 0.5); A_log ->
    log A with A log-uniform in [0.002, 0.3] (heads that keep state across 64-token chunks),
    except one random head per GDN layer with A in [1.5, 3] (the cumulative log-decay over a
    chunk reaches -100s: the case where exp(-gamma) alone overflows); conv1d weights N(0, 0.3)
    (SiLU's non-linear range); in_proj_b x3 (beta spread over (0, 1)).

    Why not HF's init A in [0.01, 16]: a head that forgets everything every token outputs
    o = beta (q.k) v, and the per-head gated RMSNorm that follows keeps only the sign of q.k,
    which bf16 rounding flips when q.k ~ 0. With a third of the heads like that (a first run
    with A in [0.003, 8]) HF-bf16 ended 5.8% rms (cos 0.97) away from fp32 by layer 4, too
    noisy a bar for a bf16 implementation to be held to."""
    g = gen(seed)
    seen = {"zero_centred": 0, "gated": 0, "A_log": 0, "dt_bias": 0, "conv1d": 0, "in_proj_b": 0}
    lo, hi = math.log(0.002), math.log(0.3)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".linear_attn.norm.weight"):  # GDN gated norm: multiplicative, init 1
                if not torch.all(p == 1):
                    note(f"{pname}: gated RMSNorm weight not initialised to 1 before perturbation")
                p.copy_(randn_like(p, g, 0.1, 1.0))
                seen["gated"] += 1
            elif pname.endswith("norm.weight"):  # input/post-attention/final norm, q_norm, k_norm: 1 + w
                if not torch.all(p == 0):
                    note(f"{pname}: zero-centred RMSNorm weight not initialised to 0 before perturbation")
                p.copy_(randn_like(p, g, 0.1))
                seen["zero_centred"] += 1
            elif pname.endswith(".A_log"):
                a_log = torch.rand(p.shape, generator=g) * (hi - lo) + lo
                fast = int(torch.randint(0, p.numel(), (1,), generator=g))
                a_log[fast] = math.log(1.5) + torch.rand((), generator=g) * (math.log(3.0) - math.log(1.5))
                p.copy_(a_log.to(p.dtype))
                seen["A_log"] += 1
            elif pname.endswith(".dt_bias"):
                p.copy_(randn_like(p, g, 0.5, 1.0))
                seen["dt_bias"] += 1
            elif pname.endswith(".linear_attn.conv1d.weight"):
                p.copy_(randn_like(p, g, 0.3))
                seen["conv1d"] += 1
            elif pname.endswith(".linear_attn.in_proj_b.weight"):
                p.mul_(3.0)
                seen["in_proj_b"] += 1
    print(f"perturbed qwen3.5 parameters: {seen}")
    nl = QWEN35_TEXT["num_hidden_layers"]
    n_lin = QWEN35_LAYER_TYPES.count("linear_attention")
    n_full = QWEN35_LAYER_TYPES.count("full_attention")
    want_zero = 2 * nl + 1 + 2 * n_full
    if (seen["zero_centred"] != want_zero or any(seen[k] != n_lin for k in seen if k != "zero_centred")):
        problem(f"qwen3.5 perturbation hit unexpected module counts {seen} (want zero_centred={want_zero}, "
                f"gated={n_lin}, GDN={n_lin})")


def perturb_qwen3(model, seed):
    """Qwen3 RMSNorms are multiplicative (init 1): -> 1 + N(0, 0.1)."""
    g = gen(seed)
    n = 0
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                if not torch.all(p == 1):
                    note(f"{pname}: Qwen3RMSNorm weight not initialised to 1 before perturbation")
                p.copy_(randn_like(p, g, 0.1, 1.0))
                n += 1
    want = 2 * QWEN3["num_hidden_layers"] + 1 + 2 * QWEN3["num_hidden_layers"]
    print(f"perturbed qwen3 norms: {n}")
    if n != want:
        problem(f"qwen3 perturbation hit {n} norms, want {want}")


def clean_model_dir(d):
    """Keep config.json and the weights only."""
    for p in Path(d).iterdir():
        if p.name == "config.json" or p.name.endswith(".safetensors") or p.name == "model.safetensors.index.json":
            continue
        print(f"  dropping {p.name}")
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def save_hf(model, d):
    d = Path(d)
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    model.save_pretrained(str(d))
    clean_model_dir(d)
    print(f"  saved {d}: {sorted(p.name for p in d.iterdir())}")


def read_safetensors_dir(d):
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k in out:
                    problem(f"{d}: tensor {k} appears in more than one file")
                out[k] = sf.get_tensor(k)
    return out


def tensor_nbytes(t):
    return t.numel() * t.element_size()


def write_shards(tensors, d, n_shards):
    """Write `tensors` as n_shards safetensors files + model.safetensors.index.json,
    splitting the sorted key list greedily by size (the way HF shards)."""
    from safetensors.torch import save_file

    keys = sorted(tensors)
    total = sum(tensor_nbytes(tensors[k]) for k in keys)
    target = total / n_shards
    groups, cur, cur_size = [], [], 0
    for idx, k in enumerate(keys):
        sz = tensor_nbytes(tensors[k])
        remaining_keys = len(keys) - idx  # including k
        if cur and cur_size + sz > target and len(groups) < n_shards - 1 and remaining_keys >= n_shards - len(groups) - 1:
            groups.append(cur)
            cur, cur_size = [], 0
        cur.append(k)
        cur_size += sz
    groups.append(cur)
    while len(groups) < n_shards:  # not expected; split the largest group
        groups.sort(key=len, reverse=True)
        big = groups.pop(0)
        groups += [big[: len(big) // 2], big[len(big) // 2:]]
        groups.sort(key=lambda g_: g_[0])
    n = len(groups)
    weight_map = {}
    for i, grp in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in grp}, str(Path(d) / fname), metadata={"format": "pt"})
        for k in grp:
            weight_map[k] = fname
        print(f"  {fname}: {len(grp)} tensors, {sum(tensor_nbytes(tensors[k]) for k in grp)} bytes")
    index = {
        "metadata": {"total_size": total, "total_parameters": sum(tensors[k].numel() for k in keys)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(Path(d) / "model.safetensors.index.json", "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return weight_map


def fake_mtp_tensors(text_cfg, seed):
    """The 15 MTP tensors of a Qwen3.5 checkpoint (all under mtp.), tiny, random, bf16.
    transformers does not build them; they are there so a loader proves it skips mtp.*."""
    H = text_cfg["hidden_size"]
    I = text_cfg["intermediate_size"]
    nh, nkv, hd = text_cfg["num_attention_heads"], text_cfg["num_key_value_heads"], text_cfg["head_dim"]
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.norm.weight": (H,),
        "mtp.pre_fc_norm_embedding.weight": (H,),
        "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.layers.0.input_layernorm.weight": (H,),
        "mtp.layers.0.post_attention_layernorm.weight": (H,),
        "mtp.layers.0.self_attn.q_proj.weight": (nh * hd * 2, H),
        "mtp.layers.0.self_attn.k_proj.weight": (nkv * hd, H),
        "mtp.layers.0.self_attn.v_proj.weight": (nkv * hd, H),
        "mtp.layers.0.self_attn.o_proj.weight": (H, nh * hd),
        "mtp.layers.0.self_attn.q_norm.weight": (hd,),
        "mtp.layers.0.self_attn.k_norm.weight": (hd,),
        "mtp.layers.0.mlp.gate_proj.weight": (I, H),
        "mtp.layers.0.mlp.up_proj.weight": (I, H),
        "mtp.layers.0.mlp.down_proj.weight": (H, I),
    }
    g = gen(seed)
    return {k: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16) for k, s in shapes.items()}


def build_qwen35(models_dir):
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
    )

    # ---- text model (CausalLM naming) ----
    cfg = Qwen3_5TextConfig(**json.loads(json.dumps(QWEN35_TEXT)))
    rp = dict(cfg.rope_parameters)
    print(f"qwen35 text config rope_parameters after construction: {rp}")
    if rp.get("rope_theta") != ROPE_THETA or rp.get("partial_rotary_factor") != 0.25:
        problem(f"Qwen3_5TextConfig did not keep rope parameters: {rp}")
    if list(cfg.layer_types) != QWEN35_LAYER_TYPES:
        problem(f"Qwen3_5TextConfig changed layer_types: {cfg.layer_types}")
    torch.manual_seed(SEED + 1)
    model = Qwen3_5ForCausalLM(cfg).eval()
    perturb_qwen35(model, SEED + 2)
    model = model.to(torch.bfloat16)  # weights stored bf16 like the real checkpoint
    text_dir = Path(models_dir) / "qwen35_text"
    save_hf(model, text_dir)
    text_tensors = read_safetensors_dir(text_dir)
    print(f"  qwen35_text: {len(text_tensors)} tensors")

    # ---- multimodal model (ConditionalGeneration naming) with the SAME text weights ----
    mm_cfg = Qwen3_5Config(
        text_config=json.loads(json.dumps(QWEN35_TEXT)),
        vision_config=dict(QWEN35_VISION),
        tie_word_embeddings=False,
        **QWEN35_SPECIAL,
    )
    torch.manual_seed(SEED + 3)
    mm = Qwen3_5ForConditionalGeneration(mm_cfg).eval().to(torch.bfloat16)
    mm_sd = mm.state_dict()
    mapped = {}
    for k, v in text_tensors.items():
        nk = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
        if nk not in mm_sd:
            problem(f"text tensor {k} -> {nk} not in Qwen3_5ForConditionalGeneration.state_dict()")
            continue
        if tuple(mm_sd[nk].shape) != tuple(v.shape):
            problem(f"shape mismatch {nk}: {tuple(mm_sd[nk].shape)} vs {tuple(v.shape)}")
        mapped[nk] = v
    missing = [k for k in mm_sd if k not in mapped and not k.startswith("model.visual.")]
    if missing:
        problem(f"ConditionalGeneration tensors not covered by the text weights: {missing}")
    res = mm.load_state_dict(mapped, strict=False)
    bad_missing = [k for k in res.missing_keys if not k.startswith("model.visual.")]
    if bad_missing or res.unexpected_keys:
        problem(f"load_state_dict into CG model: missing {bad_missing} unexpected {res.unexpected_keys}")
    tmp_dir = Path(models_dir) / "_tmp_qwen35_mm"
    save_hf(mm, tmp_dir)
    hf_mm = read_safetensors_dir(tmp_dir)
    prefixes = sorted({".".join(k.split(".")[:2]) for k in hf_mm})
    print(f"  HF save_pretrained naming for ConditionalGeneration: prefixes {prefixes}")
    for k in hf_mm:
        if not (k.startswith("model.language_model.") or k.startswith("model.visual.") or k == "lm_head.weight"):
            problem(f"unexpected tensor name written by HF save_pretrained for CG: {k}")
    for nk, v in mapped.items():
        if nk not in hf_mm or not torch.equal(hf_mm[nk], v):
            problem(f"CG checkpoint tensor {nk} differs from the text checkpoint")
    mm_tensors = dict(hf_mm)
    mtp = fake_mtp_tensors(QWEN35_TEXT, SEED + 4)
    mm_tensors.update(mtp)
    # A_log and dt_bias stored as F32 here (bf16-exact values, so the hidden states are
    # identical): a loader must accept both dtypes for them (released checkpoints store them bf16).
    n_f32 = 0
    for k in list(mm_tensors):
        if k.endswith(".A_log") or k.endswith(".dt_bias"):
            mm_tensors[k] = mm_tensors[k].to(torch.float32)
            n_f32 += 1
    mm_dir = Path(models_dir) / "qwen35_mm"
    if mm_dir.exists():
        shutil.rmtree(mm_dir)
    mm_dir.mkdir(parents=True)
    shutil.copy(tmp_dir / "config.json", mm_dir / "config.json")
    shutil.rmtree(tmp_dir)
    wm = write_shards(mm_tensors, mm_dir, 4)
    n_vis = sum(1 for k in mm_tensors if k.startswith("model.visual."))
    print(f"  qwen35_mm: {len(mm_tensors)} tensors ({len(mapped)} text, {n_vis} vision, {len(mtp)} mtp; "
          f"{n_f32} stored F32) in {len(set(wm.values()))} shards")
    with open(mm_dir / "config.json") as f:
        mmc = json.load(f)
    print(f"  qwen35_mm config.json: model_type={mmc.get('model_type')} architectures={mmc.get('architectures')} "
          f"text_config.model_type={mmc.get('text_config', {}).get('model_type')} "
          f"top-level keys={sorted(mmc)}")
    with open(text_dir / "config.json") as f:
        tc = json.load(f)
    print(f"  qwen35_text config.json: model_type={tc.get('model_type')} architectures={tc.get('architectures')} "
          f"rope_parameters={tc.get('rope_parameters')} keys={sorted(tc)}")
    return text_dir, mm_dir


def build_qwen3(models_dir):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**json.loads(json.dumps(QWEN3)))
    print(f"qwen3 config rope_parameters after construction: {dict(cfg.rope_parameters)}")
    torch.manual_seed(SEED + 11)
    model = Qwen3ForCausalLM(cfg).eval()
    perturb_qwen3(model, SEED + 12)
    model = model.to(torch.bfloat16)
    d = Path(models_dir) / "qwen3"
    save_hf(model, d)
    t = read_safetensors_dir(d)
    print(f"  qwen3: {len(t)} tensors; lm_head.weight present: {'lm_head.weight' in t}")
    with open(d / "config.json") as f:
        c = json.load(f)
    print(f"  qwen3 config.json: model_type={c.get('model_type')} architectures={c.get('architectures')} "
          f"rope_parameters={c.get('rope_parameters')} tie_word_embeddings={c.get('tie_word_embeddings')} "
          f"keys={sorted(c)}")
    return d


# ----------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------
def load(cls, d, dtype, device, **extra):
    kw = dict(attn_implementation="eager", **extra)
    try:
        model, info = cls.from_pretrained(str(d), dtype=dtype, output_loading_info=True, **kw)
    except TypeError:
        model, info = cls.from_pretrained(str(d), torch_dtype=dtype, output_loading_info=True, **kw)
    model = model.to(device).eval()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "eager":
        problem(f"{d.name}: attention implementation is {impl!r}, not 'eager'")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for key in ("missing_keys", "mismatched_keys", "error_msgs"):
        v = info.get(key) if isinstance(info, dict) else None
        if v and key == "missing_keys" and tied:
            v = [x for x in v if str(x) != "lm_head.weight"]  # tied to embed_tokens, not stored
        if v:
            problem(f"{d.name} ({dtype}): from_pretrained {key}: {sorted(map(str, v))[:20]}")
    unexp = info.get("unexpected_keys") if isinstance(info, dict) else None
    if unexp:
        print(f"  {d.name}: from_pretrained unexpected_keys (ignored): {sorted(map(str, unexp))}")
    pdt = {p.dtype for p in model.parameters()}
    print(f"  loaded {d.name} as {cls.__name__} dtype={dtype} on {device}: parameter dtypes {pdt}")
    return model


def parts(model):
    """(decoder stack, its layers) for CausalLM and ConditionalGeneration models."""
    inner = model.model
    if hasattr(inner, "language_model"):
        inner = inner.language_model
    return inner, inner.layers


def run_one(model, ids, label):
    """One sequence alone. Returns dict embed [T,H], layer_out [T,N,H], final [T,H] (float32
    CPU) after checking the hidden_states mapping against forward hooks."""
    inner, layers = parts(model)
    dev = next(model.parameters()).device
    n = len(layers)
    captured = {}
    handles = []
    for j, layer in enumerate(layers):
        def hook(mod, args, out, j=j):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if j in captured:
                problem(f"{label}: layer {j} ran twice")
            captured[j] = t.detach().clone()
        handles.append(layer.register_forward_hook(hook))
    x = ids.to(dev)[None, :].long()
    pos = torch.arange(x.shape[1], device=dev)[None, :]
    try:
        with torch.no_grad():
            out = model(input_ids=x, position_ids=pos, attention_mask=None, use_cache=False,
                        output_hidden_states=True, return_dict=True)
    finally:
        for h in handles:
            h.remove()
    hs = out.hidden_states
    if len(hs) != n + 1:
        problem(f"{label}: len(hidden_states) = {len(hs)}, want {n + 1}")
    if len(captured) != n:
        problem(f"{label}: hooks captured {len(captured)} layers, want {n}")
    with torch.no_grad():
        emb = inner.embed_tokens(x)
        normed_last = inner.norm(captured[n - 1])
    if not torch.equal(hs[0], emb):
        problem(f"{label}: hidden_states[0] != embed_tokens(input_ids) (max diff {(hs[0] - emb).abs().max().item()})")
    for j in range(n - 1):
        if not torch.equal(hs[j + 1], captured[j]):
            problem(f"{label}: hidden_states[{j + 1}] != hook output of layer {j}")
    if not torch.equal(hs[n], normed_last):
        d = (hs[n].float() - normed_last.float()).abs().max().item()
        problem(f"{label}: hidden_states[{n}] != norm(hook output of layer {n - 1}) (max diff {d})")
    if torch.equal(hs[n], captured[n - 1]):
        problem(f"{label}: hidden_states[{n}] is the raw last-layer output, not the normed one")
    f32 = lambda t: t[0].float().cpu().contiguous()  # noqa: E731
    return {
        "embed": f32(hs[0]),
        "layer_out": torch.stack([f32(captured[j]) for j in range(n)], dim=1).contiguous(),
        "final": f32(hs[n]),
    }


def run_all(model, seqs, label):
    return [run_one(model, ids, f"{label} seq{i} (L={len(ids)})") for i, ids in enumerate(seqs)]


def make_seqs(seed, max_token):
    g = gen(seed)
    return [torch.randint(0, max_token, (L,), generator=g, dtype=torch.int64) for L in SEQ_LENS]


def compare_runs(a, b):
    """Max abs difference between two run_all results."""
    m = 0.0
    for ra, rb in zip(a, b):
        for k in ra:
            m = max(m, (ra[k] - rb[k]).abs().max().item())
    return m


def exact_equal(a, b):
    return all(torch.equal(ra[k], rb[k]) for ra, rb in zip(a, b) for k in ra)


def error_table(model_name, test, ref, n_layers):
    """Per layer: max |test-ref|, that over max |ref| (max_rel), rms(test-ref)/rms(ref), min
    per-token cosine; worst over all sequences."""
    rows = []
    names = [("embed", None)] + [(f"layer{j}", j) for j in range(n_layers)] + [("final", None)]
    for name, j in names:
        max_abs = max_rel = rms_rel = 0.0
        min_cos = 1.0
        for rt, rr in zip(test, ref):
            if j is None:
                t, r = rt[name], rr[name]
            else:
                t, r = rt["layer_out"][:, j], rr["layer_out"][:, j]
            d = (t - r).abs()
            ma = d.max().item()
            max_abs = max(max_abs, ma)
            max_rel = max(max_rel, ma / max(r.abs().max().item(), 1e-30))
            rms_rel = max(rms_rel, (d.pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp_min(1e-30)).item())
            min_cos = min(min_cos, F.cosine_similarity(t.double(), r.double(), dim=-1).min().item())
        rows.append(dict(model=model_name, layer=name, max_abs=max_abs, max_rel=max_rel, rms_rel=rms_rel,
                         min_cos=min_cos))
    return rows


def print_table(rows):
    print(f"{'model':<12} {'layer':<7} {'max_abs':>10} {'max_rel':>10} {'rms_rel':>10} {'min_cos':>10}")
    for r in rows:
        print(f"{r['model']:<12} {r['layer']:<7} {r['max_abs']:>10.3e} {r['max_rel']:>10.3e} "
              f"{r['rms_rel']:>10.3e} {r['min_cos']:>10.6f}")


def write_goldens(path, seqs, fp32, bf16, meta):
    from safetensors.torch import save_file

    t = {}
    for i, ids in enumerate(seqs):
        t[f"seq{i}.input_ids"] = ids.to(torch.int32).contiguous()
        for dname, res in (("fp32", fp32), ("bf16", bf16)):
            for k in ("layer_out", "final", "embed"):
                v = res[i][k]
                assert v.dtype == torch.float32
                t[f"seq{i}.{dname}.{k}"] = v.contiguous()
    save_file(t, str(path), metadata={k: str(v) for k, v in meta.items()})
    print(f"  wrote {path} ({path.stat().st_size} bytes, {len(t)} tensors)")


def run_model_all(name, cls, d, seqs, nl, dev, env, out, report, results, gdn_paths):
    print(f"\n=== running {name} ({cls.__name__}) ===")
    r = {}
    with CallCounter() as cc:
        m = load(cls, d, torch.float32, torch.device("cpu"))
        if name.startswith("qwen35"):
            inner, _ = parts(m)
            inv = inner.rotary_emb.inv_freq.float().cpu()
            want = 1.0 / (ROPE_THETA ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
            print(f"  rotary inv_freq: {inv.tolist()}")
            if inv.shape != want.shape or not torch.allclose(inv, want, rtol=1e-6):
                problem(f"{name}: rotary inv_freq {inv.tolist()} != {want.tolist()}")
            gdn_cls = {type(mm).__name__ for mm in m.modules() if "GatedDeltaNet" in type(mm).__name__}
            print(f"  GDN classes: {gdn_cls}")
        gam = {}
        hooks = []
        if name == "qwen35_text":
            # per GDN layer: the most negative cumulative log-decay reached inside one 64-token
            # chunk (HF's chunk size) and the slowest head's decay over a chunk, on the longest
            # sequence: shows both the exp-overflow case (< -88) and state kept across chunks
            for li, lay in enumerate(parts(m)[1]):
                la = getattr(lay, "linear_attn", None)
                if la is None:
                    continue

                def ahook(mod, args, out, la=la, li=li):
                    if out.shape[1] != max(SEQ_LENS):
                        return
                    gg = -la.A_log.float().exp() * F.softplus(out.float() + la.dt_bias.float())  # [1,T,Hv]
                    T = gg.shape[1]
                    pad = (-T) % 64
                    gc = F.pad(gg, (0, 0, 0, pad)).reshape(1, -1, 64, gg.shape[-1]).cumsum(2)
                    gam[li] = (gc.min().item(), gc[:, 0, -1].max().item())
                hooks.append(la.in_proj_a.register_forward_hook(ahook))
        r["fp32"] = run_all(m, seqs, f"{name} fp32 cpu")
        for h in hooks:
            h.remove()
        if gam:
            print("  GDN cumulative log-decay within a 64-token chunk (longest seq), per layer "
                  "(most negative, slowest head over the first chunk): "
                  + "; ".join(f"L{k}: {v[0]:.1f}, {v[1]:.2f}" for k, v in sorted(gam.items())))
            report["models"].setdefault("_gdn_decay", {}).update({f"layer{k}": v for k, v in gam.items()})
        del m
        counts_fp32 = dict(cc.counts)
        if dev.type != "cpu":
            m = load(cls, d, torch.float32, dev)
            r["fp32_dev"] = run_all(m, seqs, f"{name} fp32 {dev}")
            del m
        m = load(cls, d, torch.bfloat16, dev)
        r["bf16"] = run_all(m, seqs, f"{name} bf16 {dev}")
        del m
    counts = dict(cc.counts)
    if name.startswith("qwen35"):
        n_lin = QWEN35_LAYER_TYPES.count("linear_attention")
        runs = len(seqs) * (3 if dev.type != "cpu" else 2)
        path = "torch fallback (torch_chunk_gated_delta_rule + torch causal_conv1d_fn)"
        if counts["F.conv1d"] == 0 or env.get("importable_fla") is True:
            path = "NOT the torch fallback (no F.conv1d calls seen, or fla importable)"
            problem(f"{name}: GDN torch fallback calls not seen: {counts}")
        elif counts["torch.linalg.solve_triangular"] == 0:
            note(f"{name}: F.conv1d ran but torch.linalg.solve_triangular did not: this transformers "
                 f"version's torch chunk path solves the UT system another way")
        gdn_paths[name] = (f"{path}; counted calls over {runs} forward passes x {n_lin} GDN layers: {counts} "
                           f"(fp32 cpu pass alone: {counts_fp32})")
        print(f"  GDN path: {gdn_paths[name]}")
    results[name] = r
    info = {"layers": nl, "dir": str(d.relative_to(out))}
    if "fp32_dev" in r:
        dmax = compare_runs(r["fp32_dev"], r["fp32"])
        info["fp32_cpu_vs_device_max_abs"] = dmax
        print(f"  fp32 cpu vs fp32 {dev}: max abs diff {dmax:.3e}")
        ref_scale = max(x["layer_out"].abs().max().item() for x in r["fp32"])
        if dmax > 1e-4 * max(ref_scale, 1.0):
            problem(f"{name}: fp32 on cpu and {dev} differ by {dmax:.3e} (TF32 on?)")
    # How much each block moves the residual stream (fp32, longest sequence): a block whose
    # contribution were negligible would make the goldens blind to its bugs.
    lo = r["fp32"][-1]["layer_out"]
    prev = r["fp32"][-1]["embed"]
    mags = {"embed_rms": prev.pow(2).mean().sqrt().item()}
    for j in range(nl):
        mags[f"layer{j}_rms"] = lo[:, j].pow(2).mean().sqrt().item()
        mags[f"layer{j}_delta_rms"] = (lo[:, j] - prev).pow(2).mean().sqrt().item()
        prev = lo[:, j]
    mags["final_rms"] = r["fp32"][-1]["final"].pow(2).mean().sqrt().item()
    info["magnitudes_fp32_longest_seq"] = mags
    print("  magnitudes (fp32, longest seq): " + ", ".join(f"{k}={v:.3g}" for k, v in mags.items()))
    rows = error_table(name, r["bf16"], r["fp32"], nl)
    report["bf16_vs_fp32"] += rows
    report["models"][name] = info


# ----------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (gets goldens_*.safetensors and models/)")
    ap.add_argument("--device", default="auto", help="device for the bf16 runs (auto: cuda if available)")
    ap.add_argument("--only", default="all", choices=["all", "dense", "moe"],
                    help="dense: qwen35_text, qwen35_mm, qwen3; moe: qwen35_moe, qwen3_moe "
                         "(make_moe_goldens.py, merged into the report); all: both")
    args = ap.parse_args()
    status = 0 if args.only == "moe" else main_dense(args)
    if args.only != "dense":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import make_moe_goldens

        status = max(status, make_moe_goldens.run(args))
    return status


def main_dense(args):
    """The dense models (qwen35_text, qwen35_mm, qwen3): builds, runs, writes the report."""
    t0 = time.time()
    set_fp32_exact()
    import safetensors
    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models_dir = out / "models"
    models_dir.mkdir(exist_ok=True)

    dev = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                       ("cpu" if args.device == "auto" else args.device))
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    env = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "python": sys.version.split()[0],
        "cuda": torch.version.cuda,
        "bf16_device": f"{dev} ({dev_name})",
        "fp32_device": "cpu (canonical reference; cross-checked on the GPU when there is one)",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seed": SEED,
        "seq_lens": SEQ_LENS,
    }
    env.update(gdn_environment())
    print(json.dumps(env, indent=1))
    if env.get("importable_fla") is True or env.get("importable_causal_conv1d") is True:
        problem("flash-linear-attention or causal-conv1d is importable: HF may not use the torch GDN fallbacks")

    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3ForCausalLM

    print("\n=== building models ===")
    text_dir = mm_dir = q3_dir = None
    try:
        text_dir, mm_dir = build_qwen35(models_dir)
    except Exception:
        problem("building the qwen3.5 models failed:\n" + traceback.format_exc())
        if (models_dir / "qwen35_text" / "config.json").exists():
            text_dir = models_dir / "qwen35_text"
    try:
        q3_dir = build_qwen3(models_dir)
    except Exception:
        problem("building the qwen3 model failed:\n" + traceback.format_exc())

    seqs35 = make_seqs(SEED + 100, QWEN35_MAX_TOKEN)
    seqs3 = make_seqs(SEED + 200, QWEN3["vocab_size"])
    specs = [
        ("qwen35_text", Qwen3_5ForCausalLM, text_dir, seqs35, QWEN35_TEXT["num_hidden_layers"]),
        ("qwen35_mm", Qwen3_5ForConditionalGeneration, mm_dir, seqs35, QWEN35_TEXT["num_hidden_layers"]),
        ("qwen3", Qwen3ForCausalLM, q3_dir, seqs3, QWEN3["num_hidden_layers"]),
    ]
    specs = [sp for sp in specs if sp[2] is not None]

    report = {"env": env, "models": {}, "bf16_vs_fp32": [], "problems": PROBLEMS, "notes": NOTES}
    results = {}
    gdn_paths = {}
    for name, cls, d, seqs, nl in list(specs):
        try:
            run_model_all(name, cls, d, seqs, nl, dev, env, out, report, results, gdn_paths)
        except Exception:
            problem(f"running {name} failed:\n" + traceback.format_exc())
            specs = [sp for sp in specs if sp[0] != name]

    # The ConditionalGeneration checkpoint holds the same text weights: its hidden states must
    # be the text model's, exactly (same ops on the same device).
    print("\n=== qwen35_mm vs qwen35_text ===")
    for dname in ("fp32", "fp32_dev", "bf16"):
        if "qwen35_mm" not in results or "qwen35_text" not in results or dname not in results["qwen35_text"]:
            continue
        a, b = results["qwen35_mm"][dname], results["qwen35_text"][dname]
        eq = exact_equal(a, b)
        print(f"  {dname}: exactly equal = {eq} (max abs diff {compare_runs(a, b):.3e})")
        report["models"]["qwen35_mm"][f"equal_to_text_{dname}"] = eq
        if not eq:
            problem(f"qwen35_mm {dname} hidden states differ from qwen35_text")

    print("\n=== writing goldens ===")
    for name, cls, d, seqs, nl in specs:
        H = QWEN3["hidden_size"] if name == "qwen3" else QWEN35_TEXT["hidden_size"]
        meta = {
            "model": name,
            "model_dir": f"models/{name}",
            "hf_class": cls.__name__,
            "num_layers": nl,
            "hidden_size": H,
            "layer_types": ",".join(QWEN35_LAYER_TYPES) if name.startswith("qwen35") else ",".join(
                ["full_attention"] * nl),
            "seq_lens": ",".join(map(str, SEQ_LENS)),
            "num_seqs": len(SEQ_LENS),
            "seed": SEED,
            "transformers_version": env["transformers"],
            "torch_version": env["torch"],
            "safetensors_version": env["safetensors"],
            "fp32_device": "cpu",
            "bf16_device": env["bf16_device"],
            "attn_implementation": "eager",
            "gdn_path": gdn_paths.get(name, "n/a (no GDN layers)"),
            "call": "batch 1, one sequence alone, position_ids=arange(L)[None], attention_mask=None, "
                    "use_cache=False, output_hidden_states=True",
            "layout": "seq{i}.input_ids I32[T]; seq{i}.{fp32,bf16}.embed F32[T,H]=hidden_states[0]; "
                      "seq{i}.{fp32,bf16}.layer_out F32[T,N,H] row j=raw output of decoder layer j "
                      "(hidden_states[j+1] for j<N-1, forward hook on layers[N-1] for j=N-1); "
                      "seq{i}.{fp32,bf16}.final F32[T,H]=hidden_states[N] (final norm applied)",
            "dtype_notes": "fp32: model loaded with dtype=float32 from the bf16 checkpoint, run on cpu (IEEE fp32, "
                           "no TF32), the canonical reference. bf16: dtype=bfloat16, run on the bf16 device; "
                           "values stored as F32 (exact).",
        }
        if name == "qwen35_mm":
            meta["note"] = "same text weights as qwen35_text; hidden states asserted equal to qwen35_text's"
        write_goldens(out / f"goldens_{name}.safetensors", seqs, results[name]["fp32"], results[name]["bf16"], meta)

    print("\n=== bf16 vs fp32 (HF bf16 on %s against HF fp32 on cpu; worst over all sequences) ===" % dev)
    print("max_rel = max|bf16-fp32| / max|fp32| within the layer; rms_rel = rms(bf16-fp32)/rms(fp32); "
          "min_cos = lowest per-token cosine")
    print_table(report["bf16_vs_fp32"])

    report["gdn_paths"] = gdn_paths
    report["seconds"] = round(time.time() - t0, 1)
    with open(out / "goldens_report.json", "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    print(f"\nwrote {out / 'goldens_report.json'}")
    print(f"done in {time.time() - t0:.1f} s; notes: {len(NOTES)}; problems: {len(PROBLEMS)}")
    for p in PROBLEMS:
        print(f"PROBLEM: {p}")
    return 1 if PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main())
