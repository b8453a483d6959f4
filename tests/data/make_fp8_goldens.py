#!/usr/bin/env python3
"""Make draftfeed's fine-grained FP8 golden checkpoints and hidden states.

Usage:  python3 tests/data/make_fp8_goldens.py --out DIR [--only NAME[,NAME...]]
        python3 tests/data/make_fp8_goldens.py --self-test   (the e4m3 / block / GEMM maths only)

Four small random-weight models (qwen35_text, qwen3, qwen35_moe, qwen3_moe) are built with
transformers' own classes from a seed in bf16, as make_goldens.py / make_moe_goldens.py build
theirs (same perturbations), with every quantized Linear's dims multiples of 128. Each eligible
Linear (q/k/v/o_proj, linear_attn.in_proj_qkv/in_proj_z/out_proj, dense and shared-expert MLP,
every routed expert) is quantized in torch with the 128x128 block scheme:
    s = max|W| / 448 per block (fp32; an all-zero block gets s = 1), rounded to the scale's
    storage dtype (BF16 for qwen35_text and qwen35_moe, as Qwen's releases store it; F32 for
    qwen3 and qwen3_moe), then q = e4m3(clamp(W / s_stored, +-448)), round to nearest even;
so the dequantized weight is exactly float(q) * float(s_stored). The checkpoint is written as
official FP8 releases lay it out: `weight` F8_E4M3 + `weight_scale_inv` per module, routed
experts per expert (mlp.experts.{e}.{gate,up,down}_proj), config.json with a quantization_config
{quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size [128, 128],
modules_to_not_convert [the Linears kept bf16]}.

References, each sequence run ALONE (batch 1, position_ids arange, no mask, no cache, eager
attention, eager experts; make_goldens.run_one, which also checks the hidden_states mapping):
  ref   transformers in fp32 on the dequantized weights (float32(e4m3) * float32(scale)), a
        checkpoint of the same config without quantization_config; run on the CPU (IEEE fp32),
        cross-checked on the GPU in fp32 with TF32 off. What the FP8 checkpoint means.
  emu   what an FP8 engine computes, emulated in torch on the GPU: the bf16 model as
        transformers runs it in bf16, with every quantized Linear (and each routed expert's two
        GEMMs) replaced by: x (the bf16 activation) quantized per token and 128-wide K group,
        s_x = max(amax, 1e-10) / 448, q_x = e4m3(x / s_x); y = sum_g (q_x[:, g] . q_w[:, g]^T)
        * (s_x[:, g] * S_w[n / 128, g]) accumulated in fp32 over g ascending; y -> bf16 once.
        The experts' SiLU(gate) * up (bf16) is re-quantized the same way before the down GEMM.
  bf16  the original (unquantized) bf16 model run in bf16 on the GPU (report only)
  orig  the original bf16 model run in fp32 on the CPU: the FP8 model's distance from it
  deq_bf16  the dequantized weights run in bf16 on the GPU (report only): a bf16 engine on the
        FP8 checkpoint's weights
transformers' own FP8 path is also tried (from_pretrained on the FP8 checkpoint, one forward);
whether it loads and runs is recorded, nothing depends on it.

Past ~600 lines for make_goldens.py's reason: it is the record of how the checked-in FP8 goldens
were made, run once where transformers is installed, configs and checks beside the writers.

Writes, under DIR:
  models/<name>_fp8/              config.json + model.safetensors (the FP8 checkpoint)
  goldens_<name>_fp8.safetensors  for sequence i (lengths SEQ_LENS):
      seq{i}.input_ids          I32 [T]
      seq{i}.ref.embed          F32 [T, H]      hidden_states[0] (also emu's and orig's, checked)
      seq{i}.ref.layer_out      F32 [T, N, H]   raw output of decoder layer j (as make_goldens)
      seq{i}.ref.final          F32 [T, H]      after the final norm
      seq{i}.emu.layer_out      BF16 [T, N, H]  emu's (bf16 values: stored exactly)
      seq{i}.emu.final          BF16 [T, H]
      seq{i}.orig.layer_out     BF16 [T, N, H]  orig's, rounded to bf16 (only for the distance
      seq{i}.orig.final         BF16 [T, H]     from the unquantized model, 10x above bf16's)
      MoE models also: seq{i}.{ref,emu}.router_logits F32 [T, N, E] (x.W_g^T of the router's
      input, rows of dense layers 0), from which tests find the near-tie tokens.
  goldens_report.json             DIR's (or tests/data's) report with an "fp8" section merged in
"""

import argparse
import datetime
import json
import platform
import shutil
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_goldens as mg  # noqa: E402  (sets the deterministic/offline environment first)
import make_moe_goldens as mmg  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SEED = mg.SEED + 2000
SEQ_LENS = [1, 17, 64, 130]
E4M3_MAX = 448.0
BLOCK = 128
ACT_AMAX_FLOOR = 1e-10  # vLLM's per-token-group clamp: an all-zero group gives s > 0, codes 0
HAS_F8 = hasattr(torch, "float8_e4m3fn")
ROPE = dict(rope_type="default", rope_theta=mg.ROPE_THETA, partial_rotary_factor=0.25,
            mrope_section=[2, 1, 1], mrope_interleaved=True)
VOCAB = 256
# Special ids of the multimodal config inside the vocabulary; the qwen35_moe sequences avoid them.
QWEN35_SPECIAL = dict(vision_start_token_id=248, vision_end_token_id=249, image_token_id=250,
                      video_token_id=251)
QWEN35_MAX_TOKEN = 248

# Two layers a model (three for qwen3_moe: MoE, dense, MoE) keep the files small: the FP8 references
# are F32 for 212 tokens x (layers + 2) x 128 per model; attention, GDN and routing over more
# layers are the bf16 goldens' job.
# Dims: every quantized Linear has in and out a multiple of 128 (activation groups need
# K % 128 == 0; whole weight blocks keep a fused [gate; up] split on a block edge). Attention
# 8 Q / 4 KV heads x 32: q_proj 512 (query + gate) or 256 rows, k/v 128, o_proj in 256. GDN
# 2 QK / 4 V heads x 32: in_proj_qkv 256 rows, in_proj_z 128, out_proj in 128 (in_proj_a/b
# [4, 128] stay bf16).
ATTN = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=32, attention_bias=False)
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
           linear_num_key_heads=2, linear_num_value_heads=4)
COMMON = dict(vocab_size=VOCAB, hidden_size=128, hidden_act="silu", rms_norm_eps=1e-6,
              max_position_embeddings=4096, initializer_range=0.05, **ATTN)
QWEN35_TEXT = dict(COMMON, **GDN, intermediate_size=256, num_hidden_layers=2,
                   layer_types=["linear_attention", "full_attention"],
                   tie_word_embeddings=False, rope_parameters=dict(ROPE))
QWEN3 = dict(COMMON, intermediate_size=256, num_hidden_layers=2, tie_word_embeddings=True,
             use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": mg.ROPE_THETA})
# Expert width 128 (one block) and a shared expert of 256, so a mix-up of the two fails loading.
QWEN35_MOE_TEXT = dict(COMMON, **GDN, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                       tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=128, shared_expert_intermediate_size=256,
                       rope_parameters=dict(ROPE))
QWEN3_MOE = dict(COMMON, intermediate_size=256, num_hidden_layers=3, tie_word_embeddings=False,
                 use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": mg.ROPE_THETA},
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[1])

# The config fields that set tensor shapes and routing: transformers must keep them as asked.
SHAPE_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "layer_types",
              "num_attention_heads", "num_key_value_heads", "head_dim", "linear_key_head_dim",
              "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
              "norm_topk_prob", "mlp_only_layers"]

# The last path component of every Linear that FP8 releases quantize (spec: q/k/v/o_proj, GDN
# in_proj_qkv/in_proj_z/out_proj, dense and shared-expert MLP, every expert).
QUANTISED_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
                    "gate_proj", "up_proj", "down_proj"}

problem, note = mg.problem, mg.note


# ----------------------------------------------------------------------------------------
# e4m3, block quantization and the emulated FP8 GEMM
# ----------------------------------------------------------------------------------------
def e4m3_round_hand(x):
    """Nearest OCP e4m3fn value (ties to even) of fp32 x with |x| <= 448, as fp32, in float64
    arithmetic: 3 mantissa bits above 2^-6, a 2^-9 step below. Cross-checks torch's cast."""
    x64 = x.double()
    e = torch.floor(torch.log2(x64.abs().clamp_min(2.0 ** -7))).clamp(min=-6)
    step = torch.pow(2.0, e - 3)
    return torch.copysign(torch.round(x64.abs() / step) * step, x64).float()


def e4m3_codes_hand(v):
    """The e4m3fn byte of each e4m3-representable fp32 value (sign, 4-bit exponent bias 7, 3-bit
    mantissa; exponent field 0 = subnormal)."""
    v64 = v.double()
    a = v64.abs()
    sub = a < 2.0 ** -6
    e = torch.floor(torch.log2(torch.where(sub, torch.ones_like(a), a)))
    normal = (e + 7) * 8 + torch.round((a / torch.pow(2.0, e) - 1.0) * 8)
    code = torch.where(sub, torch.round(a / 2.0 ** -9), normal).to(torch.int64)
    return (code | (torch.signbit(v64).to(torch.int64) << 7)).to(torch.uint8)


def e4m3_values_hand(codes):
    c = codes.to(torch.int64)
    ex, man = (c >> 3) & 15, (c & 7).double()
    mag = torch.where(ex == 0, man * 2.0 ** -9, (1 + man / 8) * torch.pow(2.0, (ex - 7).double()))
    return torch.where((c >> 7) == 1, -mag, mag).float()


def to_e4m3(x):
    """e4m3 values (as fp32) of fp32 x already within +-448: torch's cast where it exists (the
    self-test checks it equals e4m3_round_hand), else the hand rounding."""
    return x.to(torch.float8_e4m3fn).float() if HAS_F8 else e4m3_round_hand(x)


def quantize_blocks(w, scale_dtype):
    """W [rows, cols] -> (e4m3 values as fp32 [rows, cols], the stored scales [ceil(rows/128),
    ceil(cols/128)] in scale_dtype). A partial last block shares its scale."""
    w32 = w.float()
    rows, cols = w32.shape
    sr, sc = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = F.pad(w32, (0, sc * BLOCK - cols, 0, sr * BLOCK - rows))
    amax = padded.reshape(sr, BLOCK, sc, BLOCK).abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(scale_dtype)
    full = s.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return to_e4m3((w32 / full).clamp(-E4M3_MAX, E4M3_MAX)), s


def dequantize(q, s):
    rows, cols = q.shape
    return q * s.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]


def quantize_activation(x2):
    """[M, K] fp32 -> (q [M, G, 128] e4m3 values, s [M, G]) per token and 128-wide group."""
    m, k = x2.shape
    if k % BLOCK:
        raise ValueError(f"activation width {k} is not a multiple of {BLOCK}")
    xg = x2.reshape(m, k // BLOCK, BLOCK)
    s = xg.abs().amax(-1).clamp_min(ACT_AMAX_FLOOR) / E4M3_MAX
    return to_e4m3((xg / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX)), s


def emu_gemm(x, q_w, s_w):
    """The FP8 engine's y = x.W^T: x [..., K] (bf16) quantized per token/group, W as e4m3 values
    q_w [N, K] (fp32) with block scales s_w [ceil(N/128), K/128]; fp32 partial products per
    K group, scaled by s_x * S_w and summed over groups in fp32; bf16 out."""
    return emu_gemm_fp32(x, q_w, s_w).to(torch.bfloat16)


def emu_gemm_fp32(x, q_w, s_w):
    lead, k = x.shape[:-1], x.shape[-1]
    n = q_w.shape[0]
    q_x, s_x = quantize_activation(x.reshape(-1, k).float())
    g = k // BLOCK
    part = torch.einsum("mgk,ngk->gmn", q_x, q_w.reshape(n, g, BLOCK))
    s_wn = s_w.float().repeat_interleave(BLOCK, 0)[:n].t()  # [G, N]
    acc = torch.zeros(q_x.shape[0], n, dtype=torch.float32, device=x.device)
    for j in range(g):
        acc = acc + part[j] * (s_x[:, j, None] * s_wn[j][None, :])
    return acc.reshape(*lead, n)


def self_test(device):
    """The maths above against independent forms; a failure is a PROBLEM."""
    codes = torch.arange(256, dtype=torch.int64)
    finite = codes[(codes & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN in e4m3fn
    vals = e4m3_values_hand(finite)
    if not torch.equal(e4m3_codes_hand(vals), finite.to(torch.uint8)):
        problem("e4m3 self-test: hand encode(decode(code)) != code")
    if not torch.equal(e4m3_round_hand(vals), vals):
        problem("e4m3 self-test: representable values do not round to themselves")
    pos = torch.unique(vals.abs())
    mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32: ties, which must go to the even code
    r = e4m3_round_hand(mids)
    even = (e4m3_codes_hand(r).to(torch.int64) & 1) == 0
    if not bool(even.all()) or bool(((r != pos[1:]) & (r != pos[:-1])).any()):
        problem("e4m3 self-test: ties do not round to the even neighbour")
    g = torch.Generator().manual_seed(SEED)
    grid = torch.cat([vals, mids, -mids, torch.randn(100000, generator=g) * 60,
                      torch.rand(10000, generator=g) * 2.0 ** -6]).clamp(-E4M3_MAX, E4M3_MAX)
    if HAS_F8:
        tv = grid.to(torch.float8_e4m3fn)
        if not torch.equal(tv.float(), e4m3_round_hand(grid)):
            problem("torch's float8_e4m3fn cast differs from round-to-nearest-even e4m3")
        if not torch.equal(tv.view(torch.uint8), e4m3_codes_hand(e4m3_round_hand(grid))):
            problem("torch's float8_e4m3fn bytes differ from the OCP e4m3fn encoding")
    # Blocks: a partial block, an all-zero block; error within half an e4m3 step of W / s.
    w = torch.randn(200, 300, generator=g) * 0.05
    w[:128, 128:256] = 0
    for sdt in (torch.float32, torch.bfloat16):
        q, s = quantize_blocks(w.to(torch.bfloat16), sdt)
        if tuple(s.shape) != (2, 3) or s[0, 1].item() != 1.0 or bool((q[:128, 128:256] != 0).any()):
            problem(f"block self-test ({sdt}): zero block scale {s[0, 1].item()}, shape {tuple(s.shape)}")
        full = s.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:200, :300]
        ratio = w.to(torch.bfloat16).float() / full
        half_step = torch.pow(2.0, torch.floor(torch.log2(ratio.abs().clamp_min(2.0 ** -6))) - 4)
        if bool(((ratio - q).abs() > half_step * 1.0001 + 1e-12).any()):
            problem(f"block self-test ({sdt}): an element is more than half an e4m3 step off")
    # The emulated GEMM against a float64 evaluation of the same sum, and an all-zero row.
    x = (torch.randn(37, 256, generator=g) * 0.7).to(torch.bfloat16)
    x[5] = 0
    wq, ws = quantize_blocks((torch.randn(384, 256, generator=g) * 0.05).to(torch.bfloat16), torch.float32)
    y = emu_gemm_fp32(x.to(device), wq.to(device), ws.to(device)).cpu()
    qx, sx = quantize_activation(x.float())
    ref = torch.zeros(37, 384, dtype=torch.float64)
    for j in range(2):
        ref += (qx[:, j].double() @ wq[:, j * 128:(j + 1) * 128].double().t()) * sx[:, j, None].double() * \
            ws[:, j].double().repeat_interleave(128)[None, :]
    if not torch.isfinite(y).all() or bool((y[5] != 0).any()):
        problem("GEMM self-test: an all-zero activation row is not exactly zero")
    err = ((y.double() - ref).abs() / ref.abs().max()).max().item()
    if err > 1e-6:  # fp32 sums of 128 exact products, then two groups: a few fp32 ulps
        problem(f"GEMM self-test: emulation vs float64 {err:.3e} of max (more than fp32 rounding)")
    deq = F.linear(x.float(), dequantize(wq, ws))
    rel = ((y - deq).pow(2).mean().sqrt() / deq.pow(2).mean().sqrt()).item()
    if not 1e-4 < rel < 0.1:
        problem(f"GEMM self-test: emulation vs dequantized fp32 GEMM rms {rel:.3e} (activation rounding "
                f"should put it between 1e-4 and 0.1)")
    print(f"self-test: e4m3 {'torch cast checked' if HAS_F8 else 'hand rounding only (no float8 dtype)'}; "
          f"GEMM emulation vs float64 {err:.2e} of max, vs dequantized fp32 {rel:.2e} rms")
    return {"torch_float8_cast_checked": HAS_F8, "gemm_vs_float64_max_rel": err,
            "gemm_vs_dequantized_fp32_rms_rel": rel}


# ----------------------------------------------------------------------------------------
# safetensors, written by hand (8-byte header length, JSON header, data)
# ----------------------------------------------------------------------------------------
ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32"}
if HAS_F8:
    ST_DTYPES[torch.float8_e4m3fn] = "F8_E4M3"


def write_safetensors(path, tensors, metadata=None):
    """Tensors ordered by element size, then name, so each stays aligned for its dtype."""
    keys = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header, blobs, off = {}, [], 0
    for k in keys:
        t = tensors[k].detach().cpu().contiguous()
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return Path(path).stat().st_size


def check_readback(path, tensors):
    """The safetensors package reads our file back to the same dtypes, shapes and bytes."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        if keys != set(tensors):
            problem(f"{path}: safetensors sees {len(keys)} tensors, {len(tensors)} were written")
            return
        for k in keys:
            a, b = f.get_tensor(k), tensors[k].cpu().contiguous()
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                    a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                problem(f"{path}: {k} reads back as {a.dtype} {tuple(a.shape)} with other bytes")
                return


# ----------------------------------------------------------------------------------------
# Building the models and the FP8 checkpoints
# ----------------------------------------------------------------------------------------
def build(name, idx, models_tmp):
    """The original bf16 model, saved with save_pretrained under models_tmp/name (per-expert
    experts). Returns (dir, class, text config dict)."""
    import transformers as tf

    if name == "qwen35_text":
        cfg, cls, tc = tf.Qwen3_5TextConfig(**json.loads(json.dumps(QWEN35_TEXT))), tf.Qwen3_5ForCausalLM, QWEN35_TEXT
    elif name == "qwen3":
        cfg, cls, tc = tf.Qwen3Config(**json.loads(json.dumps(QWEN3))), tf.Qwen3ForCausalLM, QWEN3
    elif name == "qwen35_moe":
        cls, tc = tf.Qwen3_5MoeForConditionalGeneration, QWEN35_MOE_TEXT
        cfg = tf.Qwen3_5MoeConfig(text_config=json.loads(json.dumps(tc)), tie_word_embeddings=False,
                                  vision_config=dict(mg.QWEN35_VISION, out_hidden_size=tc["hidden_size"]),
                                  **QWEN35_SPECIAL)
    else:
        cfg, cls, tc = tf.Qwen3MoeConfig(**json.loads(json.dumps(QWEN3_MOE))), tf.Qwen3MoeForCausalLM, QWEN3_MOE
    c = getattr(cfg, "text_config", cfg)
    for k in SHAPE_KEYS:
        if k in tc and getattr(c, k, None) != tc[k]:
            problem(f"{name}: {type(c).__name__}.{k} = {getattr(c, k, None)!r}, asked {tc[k]!r}")
    torch.manual_seed(SEED + 1 + 10 * idx)
    model = cls(cfg).eval()
    hybrid = name.startswith("qwen35")
    seen = mmg.perturb_moe(model, SEED + 2 + 10 * idx, hybrid, tc["hidden_size"])
    n = tc["num_hidden_layers"]
    n_lin = tc.get("layer_types", []).count("linear_attention")
    n_moe = len(mmg.moe_layer_ids(c)) if "num_experts" in tc else 0
    want = {"norm": (2 * n + 1 + 2 * (n - n_lin)) if hybrid else 4 * n + 1, "gated": n_lin, "A_log": n_lin,
            "dt_bias": n_lin, "conv1d": n_lin, "in_proj_b": n_lin, "router": n_moe}
    if seen != want:
        problem(f"{name}: perturbation hit {seen}, want {want}")
    d = Path(models_tmp) / name
    mg.save_hf(model.to(torch.bfloat16), d)
    return d, cls, tc


def is_quantized(key):
    parts = key.split(".")
    return (key.endswith(".weight") and len(parts) >= 2 and parts[-2] in QUANTISED_LEAVES
            and not key.startswith(("model.visual.", "mtp.")))


def bf16_linear_modules(model, quantized_modules):
    """modules_to_not_convert: every nn.Linear left in bf16 (full names, as the checkpoint
    names them), the vision tower as one prefix. transformers matches these as substrings."""
    out = []
    for mname, m in model.named_modules():
        if mname.startswith("model.visual"):
            continue
        if isinstance(m, torch.nn.Linear) and mname not in quantized_modules:
            out.append(mname)
    if any(k.startswith("model.visual") for k, _ in model.named_modules()):
        out.append("model.visual")
    return sorted(out)


def make_fp8(name, orig_dir, cls, scale_dtype, out_dir, tmp):
    """Writes models/<name>_fp8 (the FP8 checkpoint) and tmp/<name>_deq (fp32 dequantized, no
    quantization_config). Returns (fp8 dir, deq dir, {weight name: (q, s)}, facts)."""
    tensors = mg.read_safetensors_dir(orig_dir)
    cfg = json.loads((orig_dir / "config.json").read_text())
    tcfg = cfg.get("text_config", cfg)
    layout = mmg.expert_layout(tensors)
    if layout == "fused":
        note(f"{name}: save_pretrained wrote fused experts; the FP8 checkpoint gets them per expert")
        tensors = mmg.relayout(tensors, "per-expert", tcfg["num_experts"])
    quant, fp8_tensors, deq_tensors = {}, {}, {}
    for k, v in tensors.items():
        if is_quantized(k):
            if v.dim() != 2 or v.shape[0] % BLOCK or v.shape[1] % BLOCK:
                problem(f"{name}: {k} {tuple(v.shape)} is not whole 128x128 blocks")
            q, s = quantize_blocks(v, scale_dtype)
            quant[k] = (q, s)
            fp8_tensors[k] = q.to(torch.float8_e4m3fn)
            fp8_tensors[k + "_scale_inv"] = s
            deq_tensors[k] = dequantize(q, s)
        else:
            fp8_tensors[k] = deq_tensors[k] = v
    probe = mg.load(cls, orig_dir, torch.float32, torch.device("cpu"))
    skip = bf16_linear_modules(probe, {k[:-len(".weight")] for k in quant})
    del probe
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
          "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": skip}
    fdir, ddir = out_dir / "models" / f"{name}_fp8", Path(tmp) / f"{name}_deq"
    for d in (fdir, ddir):
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
    (fdir / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qc), indent=2) + "\n")
    shutil.copy(orig_dir / "config.json", ddir / "config.json")
    size = write_safetensors(fdir / "model.safetensors", fp8_tensors, {"format": "pt"})
    write_safetensors(ddir / "model.safetensors", deq_tensors, {"format": "pt"})
    try:
        check_readback(fdir / "model.safetensors", fp8_tensors)
    except Exception:
        problem(f"{name}: reading the FP8 checkpoint back with safetensors failed:\n" + traceback.format_exc())
    n_exp = sum(1 for k in quant if ".mlp.experts." in k)
    facts = {"dir": f"models/{name}_fp8", "bytes": size + (fdir / "config.json").stat().st_size,
             "tensors": len(fp8_tensors), "fp8_weights": len(quant), "fp8_expert_weights": n_exp,
             "scale_dtype": ST_DTYPES[scale_dtype], "expert_layout_saved_by_transformers": layout,
             "modules_to_not_convert": skip,
             # F32 scales: each block's largest |W| maps onto the top code
             "max_code_per_block_is_448": all(bool(
                 (q.abs().reshape(q.shape[0] // BLOCK, BLOCK, q.shape[1] // BLOCK, BLOCK).amax(dim=(1, 3))
                  == E4M3_MAX).all()) for q, _ in quant.values() if not q.shape[0] % BLOCK and not q.shape[1] % BLOCK)
             if scale_dtype == torch.float32 else None}
    print(f"  {fdir}: {len(fp8_tensors)} tensors, {len(quant)} FP8 ({n_exp} expert), scales "
          f"{ST_DTYPES[scale_dtype]}, {size} bytes; modules_to_not_convert {skip}")
    return fdir, ddir, quant, facts


# ----------------------------------------------------------------------------------------
# The emulated FP8 model
# ----------------------------------------------------------------------------------------
class EmuFp8Linear(torch.nn.Module):
    """In place of a quantized nn.Linear. Keeps the bf16 `weight` for code that reads its dtype or
    device; the call counter shows that every forward went through the emulation."""

    def __init__(self, weight, q, s, counter, key):
        super().__init__()
        self.register_buffer("weight", weight.detach())
        self.register_buffer("q", q)
        self.register_buffer("s", s.float())
        self.counter, self.key = counter, key

    def forward(self, x):
        self.counter[self.key] = self.counter.get(self.key, 0) + 1
        return emu_gemm(x, self.q, self.s)


def experts_forward(experts, gemm):
    """transformers 5's eager experts loop (ascending expert id; gate then up rows; SiLU(gate) *
    up in the run dtype; weights applied in their dtype; one rounded index_add per expert) with
    gemm(x, e, 'gate_up' | 'down') for the two GEMMs."""
    def forward(hidden_states, *args, **kwargs):
        rest = list(args) + [kwargs[k] for k in sorted(kwargs)]
        idx = next(a for a in rest if torch.is_tensor(a) and not a.is_floating_point())
        w = next(a for a in rest if torch.is_tensor(a) and a.is_floating_point())
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        idx, w = idx.reshape(x.shape[0], -1), w.reshape(x.shape[0], -1)
        out = torch.zeros_like(x)
        act = getattr(experts, "act_fn", F.silu)
        for e in sorted(set(idx.flatten().tolist())):
            tok, pos = torch.where(idx == e)
            gate, up = gemm(x[tok], e, "gate_up").chunk(2, dim=-1)
            y = gemm(act(gate) * up, e, "down") * w[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out.reshape(shape)
    return forward


def patch_emulation(model, quant, counter, top_k):
    """Replaces every quantized Linear and fused experts module of the bf16 `model` by the FP8
    emulation, after checking that the replacement experts loop reproduces transformers' own
    bit for bit when its GEMMs are the bf16 ones. Returns the names of the patched modules."""
    dev = next(model.parameters()).device
    patched = set()
    experts_prefixes = sorted({k.split(".mlp.experts.")[0] for k in quant if ".mlp.experts." in k})
    # transformers 5 holds experts fused ([E, 2I, D] parameters); per-expert nn.Linear modules
    # (transformers 4) are patched like any other Linear.
    fused = {p for p in experts_prefixes if hasattr(model.get_submodule(p + ".mlp.experts"), "gate_up_proj")}
    for key, (q, s) in quant.items():
        if ".mlp.experts." in key and key.split(".mlp.experts.")[0] in fused:
            continue
        mname = key[:-len(".weight")]
        parent_name, _, child = mname.rpartition(".")
        mod = model.get_submodule(mname)
        if not isinstance(mod, torch.nn.Linear) or mod.bias is not None:
            problem(f"{mname}: {type(mod).__name__}, not a bias-free nn.Linear")
            continue
        setattr(model.get_submodule(parent_name), child,
                EmuFp8Linear(mod.weight, q.to(dev), s.to(dev), counter, mname))
        patched.add(mname)
    for pre in sorted(fused):
        ex = model.get_submodule(pre + ".mlp.experts")
        num = ex.gate_up_proj.shape[0]
        gu = [(torch.cat([quant[f"{pre}.mlp.experts.{e}.gate_proj.weight"][0],
                          quant[f"{pre}.mlp.experts.{e}.up_proj.weight"][0]]).to(dev),
               torch.cat([quant[f"{pre}.mlp.experts.{e}.gate_proj.weight"][1],
                          quant[f"{pre}.mlp.experts.{e}.up_proj.weight"][1]]).float().to(dev)) for e in range(num)]
        dn = [tuple(t.float().to(dev) for t in quant[f"{pre}.mlp.experts.{e}.down_proj.weight"]) for e in range(num)]
        if tuple(ex.gate_up_proj.shape[1:]) != tuple(gu[0][0].shape):
            problem(f"{pre}: in-memory gate_up_proj {tuple(ex.gate_up_proj.shape)} is not [E, 2I, D]")

        def bf16_gemm(x, e, which, ex=ex):
            return F.linear(x, ex.gate_up_proj[e] if which == "gate_up" else ex.down_proj[e])

        def fp8_gemm(x, e, which, gu=gu, dn=dn, pre=pre):
            counter[pre + ".mlp.experts"] = counter.get(pre + ".mlp.experts", 0) + 1
            q, s = gu[e] if which == "gate_up" else dn[e]
            return emu_gemm(x, q, s)

        # The replacement loop with bf16 GEMMs must equal transformers' eager experts exactly.
        g = torch.Generator().manual_seed(SEED + 7)
        x = (torch.randn(40, ex.gate_up_proj.shape[2], generator=g) * 0.5).to(ex.gate_up_proj.dtype).to(dev)
        k = top_k
        idx = torch.stack([torch.randperm(num, generator=g)[:k] for _ in range(40)]).to(dev)
        w = torch.softmax(torch.randn(40, k, generator=g), -1).to(dev)
        for wdt in (x.dtype, torch.float32):
            try:
                with torch.no_grad():
                    a = ex(x, idx, w.to(wdt))
                    b = experts_forward(ex, bf16_gemm)(x, idx, w.to(wdt))
            except Exception:
                problem(f"{pre}: calling the experts as experts(x, top_k_index, top_k_weights) failed:\n"
                        + traceback.format_exc())
                continue
            if not torch.equal(a, b):
                problem(f"{pre}: the emulation's experts loop differs from transformers' eager experts "
                        f"(weights {wdt}; max {(a.float() - b.float()).abs().max().item():.3e})")
        ex.forward = experts_forward(ex, fp8_gemm)  # an instance attribute: nn.Module.__call__ uses it
        patched.add(pre + ".mlp.experts")
    return patched


# ----------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------
class RouterRecorder:
    """The router's logits x.W_g^T (x = its input, recomputed with the router's own op) of every
    MoE layer in one forward, as make_moe_goldens records them."""

    def __init__(self, model, n_layers, num_experts):
        self.blocks, self.n, self.e, self.x, self.handles = mmg.moe_blocks(model), n_layers, num_experts, {}, []

    def __enter__(self):
        for j, b in self.blocks.items():
            self.handles.append(b.gate.register_forward_hook(
                lambda m, a, o, j=j: self.x.__setitem__(j, a[0].detach())))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False

    def logits(self, tokens, label):
        out = torch.zeros(tokens, self.n, self.e)
        for j, b in self.blocks.items():
            if j not in self.x:
                problem(f"{label}: the router of layer {j} did not run")
                continue
            x = self.x[j]
            out[:, j] = F.linear(x.reshape(-1, x.shape[-1]), b.gate.weight).float().cpu()
        return out


def run_set(model, seqs, label, n_layers, num_experts):
    res = []
    for i, ids in enumerate(seqs):
        lab = f"{label} seq{i} (L={len(ids)})"
        if num_experts:
            with RouterRecorder(model, n_layers, num_experts) as rec:
                r = mg.run_one(model, ids, lab)
            r["router_logits"] = rec.logits(len(ids), lab)
        else:
            r = mg.run_one(model, ids, lab)
        res.append(r)
    return res


def check_loaded(model, quant, deq_dir, name):
    """The fp32 reference model holds exactly float32(e4m3) * float32(scale) for every FP8 weight
    (per-expert tensors found in transformers' fused [E, 2I, D] / [E, D, I] parameters)."""
    sd = model.state_dict()
    bad = []
    for k, (q, s) in quant.items():
        want = dequantize(q, s)
        if k in sd:
            got = sd[k]
        elif ".mlp.experts." in k:
            pre, rest = k.split(".mlp.experts.")
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            if proj == "down_proj":
                got = sd.get(f"{pre}.mlp.experts.down_proj")
                got = None if got is None else got[e]
            else:
                gu = sd.get(f"{pre}.mlp.experts.gate_up_proj")
                half = None if gu is None else gu.shape[1] // 2
                got = None if gu is None else (gu[e, :half] if proj == "gate_proj" else gu[e, half:])
        else:
            got = None
        if got is None or got.dtype != torch.float32 or not torch.equal(got.cpu(), want):
            bad.append(k)
    if bad:
        problem(f"{name}: the dequantized reference model ({deq_dir.name}) does not hold the dequantized "
                f"weights for {len(bad)} tensors: {bad[:6]}")


def rms(t):
    return t.double().pow(2).mean().sqrt().item() if t.numel() else 0.0


def pick(r, j):
    return r["final"] if j is None else r["layer_out"][:, j]


def near_ties(ref, emu, moe_layers, k):
    """tests/server/model/golden_moe_routing.cc's rule with emu in HF-bf16's place: tau = 2x the
    largest |router logit difference| emu vs ref at the first MoE layer; a token is near-tie if
    its ref gap between the k-th and (k+1)-th logit is under tau at any MoE layer."""
    first = moe_layers[0]
    tau = max(2 * (a["router_logits"][:, first] - b["router_logits"][:, first]).abs().max().item()
              for a, b in zip(ref, emu))
    stable = []
    for a in ref:
        z = a["router_logits"][:, moe_layers].sort(-1, descending=True).values
        stable.append((z[..., k - 1] - z[..., k] >= tau).all(-1))
    return tau, stable


def expert_sets(r, j, k):
    return torch.topk(torch.softmax(r["router_logits"][:, j], -1), k, dim=-1).indices.sort(-1).values


def distances(r, n, keep=None):
    """Per layer (and final), pooled over every (kept) token of every sequence: rms of ref and of
    each run's difference, absolute and relative to rms(ref)."""
    out = {}
    for slot, j in [(f"layer{j}", j) for j in range(n)] + [("final", None)]:
        def cat(run):
            parts = [pick(x, j) for x in r[run]]
            if keep is not None:
                parts = [p[m] for p, m in zip(parts, keep)]
            return torch.cat(parts)
        ref = cat("ref")
        row = {"rms_ref": rms(ref), "bf16_rounding_of_ref": rms(ref.bfloat16().float() - ref)}
        for key, a, b in (("emu_minus_ref", "emu", "ref"), ("bf16_minus_ref", "bf16", "ref"),
                          ("ref_minus_orig", "ref", "orig"), ("deq_bf16_minus_ref", "deq_bf16", "ref")):
            row[key] = rms(cat(a) - cat(b))
        for key in list(row):
            if key != "rms_ref":
                row[key + "_rel"] = row[key] / max(row["rms_ref"], 1e-30)
        out[slot] = row
    return out


def try_transformers_fp8(cls, fdir, ids, emu, ref):
    """transformers' own FP8 path: does from_pretrained load the checkpoint, does a forward run.
    Recorded only."""
    out = {}
    m = None
    for variant in ("device_map=cuda", "to(cuda)"):
        try:
            kw = dict(dtype=torch.bfloat16, attn_implementation="eager", output_loading_info=True)
            if variant == "device_map=cuda" and torch.cuda.is_available():
                kw["device_map"] = "cuda"
            m, info = cls.from_pretrained(str(fdir), **kw)
            if variant == "to(cuda)" and torch.cuda.is_available():
                m = m.to("cuda")
            out["load"] = f"ok ({variant})"
            out["loading_info"] = {k: sorted(map(str, v))[:8] for k, v in info.items() if v} if isinstance(
                info, dict) else str(info)
            out["fp8_module_classes"] = sorted({type(x).__name__ for x in m.modules() if "fp8" in type(x).__name__.lower()})
            break
        except Exception as e:
            out[f"load_{variant}"] = f"failed: {type(e).__name__}: {str(e)[:500]}"
            m = None
    if m is None:
        out.setdefault("load", "failed")
        return out
    try:
        dev = next(m.parameters()).device
        x = ids.to(dev)[None].long()
        with torch.no_grad():
            o = m(input_ids=x, position_ids=torch.arange(x.shape[1], device=dev)[None], use_cache=False,
                  output_hidden_states=True, return_dict=True)
        final = o.hidden_states[-1][0].float().cpu()
        out["forward"] = "ok"
        out["final_rms_vs_emu_rel"] = rms(final - emu["final"]) / rms(ref["final"])
        out["final_rms_vs_ref_rel"] = rms(final - ref["final"]) / rms(ref["final"])
    except Exception as e:
        out["forward"] = f"failed: {type(e).__name__}: {str(e)[:500]}"
    del m
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run_model(name, idx, out, tmp, dev, env):
    """Builds, quantizes, runs and writes one model; returns its report entry."""
    print(f"\n=== {name}_fp8 ===")
    scale_dtype = torch.bfloat16 if name.startswith("qwen35") else torch.float32
    orig_dir, cls, tc = build(name, idx, tmp)
    fdir, ddir, quant, facts = make_fp8(name, orig_dir, cls, scale_dtype, out, tmp)
    n, e_num, k = tc["num_hidden_layers"], tc.get("num_experts", 0), tc.get("num_experts_per_tok", 0)
    g = mg.gen(SEED + 100 * (idx + 1))
    seqs = [torch.randint(0, QWEN35_MAX_TOKEN if name == "qwen35_moe" else VOCAB, (length,), generator=g,
                          dtype=torch.int64) for length in SEQ_LENS]

    def load(d, dtype, device):
        return mmg.load_eager(cls, d, dtype, device) if e_num else mg.load(cls, d, dtype, device)

    cpu, r = torch.device("cpu"), {}
    m = load(ddir, torch.float32, cpu)
    check_loaded(m, quant, ddir, name)
    moe_layers = sorted(mmg.moe_blocks(m)) if e_num else []
    r["ref"] = run_set(m, seqs, f"{name} ref fp32 cpu", n, e_num)
    del m
    if dev.type != "cpu":
        m = load(ddir, torch.float32, dev)
        r["ref_dev"] = run_set(m, seqs, f"{name} ref fp32 {dev}", n, e_num)
        del m
    m = load(orig_dir, torch.float32, cpu)
    r["orig"] = run_set(m, seqs, f"{name} orig fp32 cpu", n, e_num)
    del m
    m = load(orig_dir, torch.bfloat16, dev)
    r["bf16"] = run_set(m, seqs, f"{name} bf16 {dev}", n, e_num)
    del m
    m = load(ddir, torch.bfloat16, dev)
    r["deq_bf16"] = run_set(m, seqs, f"{name} dequantized bf16 {dev}", n, e_num)
    del m
    m = load(orig_dir, torch.bfloat16, dev)
    counter = {}
    patched = patch_emulation(m, quant, counter, k)
    r["emu"] = run_set(m, seqs, f"{name} emu {dev}", n, e_num)
    del m
    uncovered = [q for q in quant if not any(q.startswith(p + ".") for p in patched)]
    if uncovered or set(counter) != patched:
        problem(f"{name}: FP8 weights without an emulated module {uncovered[:4]}, patched modules never "
                f"called {sorted(patched - set(counter))[:4]}: not every quantized GEMM was emulated")

    info = dict(facts, layers=n, moe_layers=moe_layers, emulated_modules=len(patched),
                emulated_gemm_calls=sum(counter.values()), goldens_file=f"goldens_{name}_fp8.safetensors")
    if "ref_dev" in r:
        dmax = mg.compare_runs([{kk: x[kk] for kk in ("embed", "layer_out", "final")} for x in r["ref_dev"]],
                               [{kk: x[kk] for kk in ("embed", "layer_out", "final")} for x in r["ref"]])
        scale = max(x["layer_out"].abs().max().item() for x in r["ref"])
        info["ref_cpu_vs_device_max_abs"] = dmax
        if dmax > 1e-4 * max(scale, 1.0):
            problem(f"{name}: the fp32 reference on cpu and {dev} differ by {dmax:.3e} (TF32 on?)")
        if e_num:
            same = all(torch.equal(expert_sets(a, j, k), expert_sets(b, j, k))
                       for a, b in zip(r["ref"], r["ref_dev"]) for j in moe_layers)
            info["ref_cpu_vs_device_same_experts"] = same
            if not same:
                problem(f"{name}: the fp32 reference routes tokens differently on cpu and {dev}")
    for run in ("emu", "orig", "bf16", "deq_bf16"):
        if not all(torch.equal(a["embed"], b["embed"]) for a, b in zip(r[run], r["ref"])):
            problem(f"{name}: {run}'s embedding output differs from ref's (embed_tokens is not quantized)")
    if not all(torch.equal(x[kk].bfloat16().float(), x[kk]) for x in r["emu"] for kk in ("layer_out", "final")):
        problem(f"{name}: emu's hidden states are not bf16 values (they are stored as BF16)")
    info["distances_all_tokens"] = dist = distances(r, n)
    if e_num:
        tau, stable = near_ties(r["ref"], r["emu"], moe_layers, k)
        info["distances_stable_tokens"] = distances(r, n, keep=stable)
    # MoE: a token emu routes to other experts than ref is a routing flip, not FP8 GEMM error.
    for slot, row in (info["distances_stable_tokens"] if e_num else dist).items():
        if row["rms_ref"] == 0:
            problem(f"{name} {slot}: no token to compare (every token a routing near-tie)")
        elif not (0 < row["emu_minus_ref_rel"] < 0.2) or not (0 < row["ref_minus_orig_rel"] < 0.2):
            problem(f"{name} {slot}: emu-ref {row['emu_minus_ref_rel']:.3e}, ref-orig "
                    f"{row['ref_minus_orig_rel']:.3e} of rms(ref): FP8 should move each a few percent")
        if row["emu_minus_ref"] <= row["bf16_rounding_of_ref"]:
            note(f"{name} {slot}: emu's error {row['emu_minus_ref']:.3e} is within one bf16 rounding")
    if e_num:
        total = sum(len(s) for s in stable)
        info["near_ties"] = {"tau": tau, "near_tie_tokens": int(total - sum(int(s.sum()) for s in stable)),
                             "tokens": total}
        info["tokens_routed_differently"] = {
            f"layer{j}": {run: sum(int((expert_sets(a, j, k) != expert_sets(b, j, k)).any(-1).sum())
                                   for a, b in zip(r[run], r["ref"])) for run in ("emu", "bf16", "deq_bf16", "orig")}
            for j in moe_layers}
        print(f"  near-tie tokens (tau {tau:.3f}): {info['near_ties']['near_tie_tokens']} of {total}; "
              f"routed differently from ref: {info['tokens_routed_differently']}")
    print(f"  {'layer':<8} {'rms_ref':>10} {'emu-ref':>10} {'bf16-ref':>10} {'ref-orig':>10} {'deqbf-ref':>10} "
          f"{'bf16(ref)':>10}  (relative to rms_ref, all tokens)")
    for slot, row in dist.items():
        print(f"  {slot:<8} {row['rms_ref']:>10.3e} {row['emu_minus_ref_rel']:>10.3e} {row['bf16_minus_ref_rel']:>10.3e} "
              f"{row['ref_minus_orig_rel']:>10.3e} {row['deq_bf16_minus_ref_rel']:>10.3e} "
              f"{row['bf16_rounding_of_ref_rel']:>10.3e}")
    try:
        info["transformers_fp8"] = try_transformers_fp8(cls, fdir, seqs[1], r["emu"][1], r["ref"][1])
    except Exception:
        info["transformers_fp8"] = {"error": traceback.format_exc()[-800:]}
    print(f"  transformers' own FP8 path: {info['transformers_fp8']}")

    layer_types = tc.get("layer_types") or ["full_attention"] * n
    meta = {
        "model": f"{name}_fp8", "model_dir": f"models/{name}_fp8", "hf_class": cls.__name__,
        "num_layers": n, "hidden_size": tc["hidden_size"], "layer_types": ",".join(layer_types),
        "seq_lens": ",".join(map(str, SEQ_LENS)), "num_seqs": len(SEQ_LENS), "seed": SEED,
        "scale_dtype": ST_DTYPES[scale_dtype], "fp8_weights": len(quant),
        "transformers_version": env["transformers"], "torch_version": env["torch"],
        "ref": "transformers fp32 on the dequantized weights (float32(e4m3) * float32(scale)), cpu, eager",
        "emu": f"bf16 model on {env['device']} with each quantized GEMM emulated: x per token and 128-group "
               f"s = max(amax, 1e-10) / 448, q = e4m3(x / s); fp32 partial products per group times "
               f"s_x * S_w, summed over groups in fp32; bf16 out",
        "orig": "the unquantized bf16 checkpoint in fp32 on cpu, stored rounded to bf16",
        "layout": "seq{i}.input_ids I32[T]; seq{i}.ref.{embed F32[T,H], layer_out F32[T,N,H], final F32[T,H]}; "
                  "seq{i}.{emu,orig}.{layer_out BF16[T,N,H], final BF16[T,H]} (embed = ref's); MoE: "
                  "seq{i}.{ref,emu}.router_logits F32[T,N,E]",
    }
    if e_num:
        meta.update({"mlp_types": ",".join("moe" if j in moe_layers else "dense" for j in range(n)),
                     "moe_layers": ",".join(map(str, moe_layers)), "num_experts": e_num,
                     "num_experts_per_tok": k, "experts_implementation": "eager"})
    t = {}
    for i, ids in enumerate(seqs):
        t[f"seq{i}.input_ids"] = ids.to(torch.int32)
        for kk in ("embed", "layer_out", "final"):
            t[f"seq{i}.ref.{kk}"] = r["ref"][i][kk]
        for run in ("emu", "orig"):
            for kk in ("layer_out", "final"):
                t[f"seq{i}.{run}.{kk}"] = r[run][i][kk].to(torch.bfloat16)
        if e_num:
            for run in ("ref", "emu"):
                t[f"seq{i}.{run}.router_logits"] = r[run][i]["router_logits"]
    path = out / f"goldens_{name}_fp8.safetensors"
    info["goldens_bytes"] = write_safetensors(path, t, meta)
    try:
        check_readback(path, t)
    except Exception:
        problem(f"{name}: reading {path.name} back with safetensors failed:\n" + traceback.format_exc())
    print(f"  wrote {path} ({info['goldens_bytes']} bytes, {len(t)} tensors)")
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output folder (gets models/*_fp8/, goldens_*_fp8.safetensors, the report)")
    ap.add_argument("--device", default="auto", help="device for the bf16 / emulated runs (auto: cuda if available)")
    ap.add_argument("--only", default="all", help="comma-separated subset of qwen35_text,qwen3,qwen35_moe,qwen3_moe")
    ap.add_argument("--self-test", action="store_true", help="check the e4m3 / block / GEMM maths and exit")
    args = ap.parse_args()
    t0 = time.time()
    mg.set_fp32_exact()
    dev = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                       ("cpu" if args.device == "auto" else args.device))
    selftest = self_test(dev)
    if args.self_test:
        print(f"problems: {len(mg.PROBLEMS)}")
        return 1 if mg.PROBLEMS else 0
    if not args.out:
        ap.error("--out is required")
    if not HAS_F8:
        raise SystemExit(f"torch {torch.__version__} has no float8_e4m3fn: the FP8 goldens need torch >= 2.1")
    import safetensors
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise SystemExit(f"transformers {transformers.__version__}: the FP8 goldens need >= 5 (as the MoE goldens)")
    names = ["qwen35_text", "qwen3", "qwen35_moe", "qwen3_moe"]
    only = names if args.only == "all" else args.only.split(",")
    if any(x not in names for x in only):
        ap.error(f"--only takes a subset of {','.join(names)}, got {args.only}")
    out = Path(args.out)
    (out / "models").mkdir(parents=True, exist_ok=True)
    env = {"transformers": transformers.__version__, "torch": torch.__version__,
           "safetensors": safetensors.__version__, "python": sys.version.split()[0], "cuda": torch.version.cuda,
           "device": f"{dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else platform.processor() or 'cpu'})",
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "seed": SEED, "seq_lens": SEQ_LENS, "self_test": selftest}
    env.update(mg.gdn_environment())
    print(json.dumps(env, indent=1))
    base = out / "goldens_report.json"
    if not base.exists():
        base = Path(__file__).resolve().parent / "goldens_report.json"
    report = json.loads(base.read_text()) if base.exists() else {}
    section = report.get("fp8", {}) if isinstance(report.get("fp8"), dict) else {}
    section.setdefault("models", {})
    tmp = Path(tempfile.mkdtemp(prefix="fp8goldens-"))
    try:
        for name in only:
            section["models"].pop(name, None)
            try:
                section["models"][name] = run_model(name, names.index(name), out, tmp, dev, env)
            except SystemExit:
                raise
            except Exception:
                problem(f"{name}: failed:\n" + traceback.format_exc())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    section.update(env=env, problems=list(mg.PROBLEMS), notes=list(mg.NOTES), seconds=round(time.time() - t0, 1),
                   scheme={"weights": "128x128 blocks, s = max|W| / 448 (zero block: 1) rounded to the scale "
                                      "dtype, q = e4m3(clamp(W / s, +-448)) round to nearest even",
                           "activations": "per token and 128-wide group, s = max(amax, 1e-10) / 448",
                           "scale_dtype": {nm: ("BF16" if nm.startswith("qwen35") else "F32") for nm in names}})
    report["fp8"] = section
    with open(out / "goldens_report.json", "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    total = sum(p.stat().st_size for p in out.glob("goldens_*_fp8.safetensors")) + sum(
        p.stat().st_size for d in out.glob("models/*_fp8") for p in d.iterdir())
    print(f"\nwrote {out / 'goldens_report.json'} (fp8 section merged into {base}); FP8 files {total} bytes")
    print(f"done in {time.time() - t0:.1f} s; notes: {len(mg.NOTES)}; problems: {len(mg.PROBLEMS)}")
    for p in mg.PROBLEMS:
        print(f"PROBLEM: {p}")
    return 1 if mg.PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main())
