#!/usr/bin/env python3
"""Make draftfeed's MoE golden models and hidden states with Hugging Face transformers.

Usage:  python3 tests/data/make_moe_goldens.py --out DIR
   (or: python3 tests/data/make_goldens.py --out DIR --only moe)

The MoE half of make_goldens.py, sharing its helpers, call convention and golden layout:
two small random-weight MoE models built with transformers' own classes (seeded), saved
with save_pretrained as it writes them, each test sequence run ALONE in fp32 on the CPU
(the canonical reference) and in bf16 on the GPU, with eager attention AND the eager
experts implementation (experts visited in ascending id, each bf16 add rounded: the
reference order; grouped_mm / batched_mm sum the k slots in one reduction).

Past ~600 lines for make_goldens.py's reason: it is the record of how the checked-in MoE goldens
were made, run once where transformers is installed, configs and checks beside the writers.

Writes, under DIR:
  models/qwen35_moe/  Qwen3_5MoeForConditionalGeneration (model_type qwen3_5_moe, decoder under
                      text_config, model.language_model.* naming, a tiny vision tower): hybrid
                      GDN + gated attention, 8 experts top-2 plus a shared expert per layer
  models/qwen3_moe/   Qwen3MoeForCausalLM (model_type qwen3_moe): 8 experts top-2,
                      norm_topk_prob true, layer 1 in mlp_only_layers (a dense SwiGLU layer)
  goldens_<model>.safetensors   as make_goldens.py's, plus the routing of every MoE layer
  goldens_report.json           DIR's (or tests/data's) report with the MoE models merged in

Golden tensors beyond make_goldens.py's (sequence i, d in {fp32, bf16}, N layers, E experts,
k = num_experts_per_tok; rows of layers that are not MoE hold -1 / 0):
  seq{i}.{d}.router_logits  F32 [T, N, E]  the router's logits x.W_g^T (x = the MoE block's
                                            input, the post-attention-normed stream), in the
                                            run's dtype, stored as F32 (exact)
  seq{i}.{d}.topk_ids       I32 [T, N, k]  the experts transformers routed each token to, in
                                            its top-k order (descending probability)
  seq{i}.{d}.topk_weights   F32 [T, N, k]  the weights it applied (after renormalisation, in
                                            the dtype it used: see report moe.*.weights_dtype)
"""

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_goldens as mg  # noqa: E402  (sets the deterministic/offline environment first)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SEED = mg.SEED + 1000
ROPE_THETA = mg.ROPE_THETA  # 10000 for the same reason as the dense goldens

# Last layer full attention and layer 0 GDN, as in the real model; two of each kind.
QWEN35_MOE_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]

# Hidden 128 (one 128-wide K block: the size of a fine-grained FP8 block), experts a quarter of
# it wide like the real 2048/512; shared expert 48 wide so a mix-up of the two widths fails
# loading. Attention and GDN heads as in the dense goldens (their bf16 error is measured there).
QWEN35_MOE_TEXT = dict(
    vocab_size=512,
    hidden_size=128,
    num_hidden_layers=len(QWEN35_MOE_LAYER_TYPES),
    layer_types=list(QWEN35_MOE_LAYER_TYPES),
    num_attention_heads=4,
    num_key_value_heads=2,
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
    linear_num_value_heads=6,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    initializer_range=0.05,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": ROPE_THETA,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
QWEN35_MOE_VISION = dict(mg.QWEN35_VISION, out_hidden_size=QWEN35_MOE_TEXT["hidden_size"])

QWEN3_MOE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,  # the dense layer's width
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    attention_bias=False,
    tie_word_embeddings=False,  # as Qwen3-30B-A3B (the dense qwen3 golden is tied)
    use_sliding_window=False,
    initializer_range=0.05,
    rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],
)

# Router weights N(0, ROUTER_SCALE / sqrt(D)): logits of std ~1.5 over the 8 experts, so the
# top-2 are usually well separated (a trained router's are; HF's N(0, 0.05) init gives std
# ~0.6 at D = 128 and many near-ties) while every expert still wins somewhere.
ROUTER_SCALE = 1.5

problem, note = mg.problem, mg.note


# ----------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------
def perturb_moe(model, seed, zero_centred_norms, hidden):
    """The dense goldens' perturbations (norm weights off 0/1, GDN decay/conv/beta ranges:
    make_goldens.perturb_qwen35's rules) plus the router scale above."""
    g = mg.gen(seed)
    seen = {"norm": 0, "gated": 0, "A_log": 0, "dt_bias": 0, "conv1d": 0, "in_proj_b": 0, "router": 0}
    lo, hi = math.log(0.002), math.log(0.3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.visual."):
                continue
            if name.endswith(".linear_attn.norm.weight"):
                p.copy_(mg.randn_like(p, g, 0.1, 1.0))
                seen["gated"] += 1
            elif name.endswith("norm.weight"):
                p.copy_(mg.randn_like(p, g, 0.1, 0.0 if zero_centred_norms else 1.0))
                seen["norm"] += 1
            elif name.endswith(".A_log"):
                a_log = torch.rand(p.shape, generator=g) * (hi - lo) + lo
                fast = int(torch.randint(0, p.numel(), (1,), generator=g))
                a_log[fast] = math.log(1.5) + torch.rand((), generator=g) * (math.log(3.0) - math.log(1.5))
                p.copy_(a_log.to(p.dtype))
                seen["A_log"] += 1
            elif name.endswith(".dt_bias"):
                p.copy_(mg.randn_like(p, g, 0.5, 1.0))
                seen["dt_bias"] += 1
            elif name.endswith(".linear_attn.conv1d.weight"):
                p.copy_(mg.randn_like(p, g, 0.3))
                seen["conv1d"] += 1
            elif name.endswith(".linear_attn.in_proj_b.weight"):
                p.mul_(3.0)
                seen["in_proj_b"] += 1
            elif name.endswith(".mlp.gate.weight"):
                p.copy_(mg.randn_like(p, g, ROUTER_SCALE / math.sqrt(hidden)))
                seen["router"] += 1
    print(f"  perturbed: {seen}")
    return seen


def moe_layer_ids(cfg):
    """The layers transformers builds as MoE, by the config's rule (qwen3_5_moe: every one)."""
    n = cfg.num_hidden_layers
    if not hasattr(cfg, "mlp_only_layers"):
        return list(range(n))
    step = getattr(cfg, "decoder_sparse_step", 1)
    return [i for i in range(n)
            if i not in cfg.mlp_only_layers and cfg.num_experts > 0 and (i + 1) % step == 0]


def expert_layout(tensors):
    """'per-expert', 'fused' or 'mixed/none' from a checkpoint's tensor names."""
    per = any(".mlp.experts.0.gate_proj.weight" in k for k in tensors)
    fused = any(k.endswith(".mlp.experts.gate_up_proj") for k in tensors)
    return "per-expert" if per and not fused else "fused" if fused and not per else "mixed/none"


def relayout(tensors, to, num_experts):
    """The same weights in the other expert layout (fused: gate_up_proj [E, 2I, D] with gate
    rows first, down_proj [E, D, I], no .weight suffix; per-expert: experts.{e}.*.weight)."""
    out = {}
    prefixes = sorted({k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k})
    for k, v in tensors.items():
        if ".mlp.experts." not in k:
            out[k] = v
    for pre in prefixes:
        e_ = f"{pre}.mlp.experts."
        if to == "fused":
            out[e_ + "gate_up_proj"] = torch.stack([torch.cat(
                [tensors[f"{e_}{e}.gate_proj.weight"], tensors[f"{e_}{e}.up_proj.weight"]], 0)
                for e in range(num_experts)]).contiguous()
            out[e_ + "down_proj"] = torch.stack(
                [tensors[f"{e_}{e}.down_proj.weight"] for e in range(num_experts)]).contiguous()
        else:
            gu, dn = tensors[e_ + "gate_up_proj"], tensors[e_ + "down_proj"]
            i = gu.shape[1] // 2
            for e in range(num_experts):
                out[f"{e_}{e}.gate_proj.weight"] = gu[e, :i].contiguous()
                out[f"{e_}{e}.up_proj.weight"] = gu[e, i:].contiguous()
                out[f"{e_}{e}.down_proj.weight"] = dn[e].contiguous()
    return out


def build_qwen35_moe(models_dir):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    cfg = Qwen3_5MoeConfig(text_config=json.loads(json.dumps(QWEN35_MOE_TEXT)),
                           vision_config=dict(QWEN35_MOE_VISION), tie_word_embeddings=False,
                           **mg.QWEN35_SPECIAL)
    tc = cfg.text_config
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size", "hidden_size", "head_dim"):
        if getattr(tc, k, None) != QWEN35_MOE_TEXT[k]:
            problem(f"Qwen3_5MoeTextConfig.{k} = {getattr(tc, k, None)!r}, asked {QWEN35_MOE_TEXT[k]!r}")
    if list(tc.layer_types) != QWEN35_MOE_LAYER_TYPES:
        problem(f"Qwen3_5MoeTextConfig changed layer_types: {tc.layer_types}")
    for k in ("norm_topk_prob", "mlp_only_layers", "decoder_sparse_step", "intermediate_size"):
        if hasattr(tc, k):
            note(f"Qwen3_5MoeTextConfig has {k} = {getattr(tc, k)!r} (the design notes say the class "
                 f"dropped it)")
    torch.manual_seed(SEED + 1)
    model = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    seen = perturb_moe(model, SEED + 2, True, QWEN35_MOE_TEXT["hidden_size"])
    n = QWEN35_MOE_TEXT["num_hidden_layers"]
    n_lin = QWEN35_MOE_LAYER_TYPES.count("linear_attention")
    want = {"norm": 2 * n + 1 + 2 * (n - n_lin), "gated": n_lin, "A_log": n_lin, "dt_bias": n_lin,
            "conv1d": n_lin, "in_proj_b": n_lin, "router": n}
    if seen != want:
        problem(f"qwen35_moe perturbation hit {seen}, want {want}")
    model = model.to(torch.bfloat16)
    d = Path(models_dir) / "qwen35_moe"
    mg.save_hf(model, d)
    return d


def build_qwen3_moe(models_dir):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**json.loads(json.dumps(QWEN3_MOE)))
    for k, v in QWEN3_MOE.items():
        if k != "rope_parameters" and getattr(cfg, k, None) != v:
            problem(f"Qwen3MoeConfig.{k} = {getattr(cfg, k, None)!r}, asked {v!r}")
    torch.manual_seed(SEED + 11)
    model = Qwen3MoeForCausalLM(cfg).eval()
    q = model.model.layers[0].self_attn.q_proj.weight
    if tuple(q.shape) != (QWEN3_MOE["num_attention_heads"] * QWEN3_MOE["head_dim"], QWEN3_MOE["hidden_size"]):
        problem(f"Qwen3MoeForCausalLM ignored head_dim: q_proj is {tuple(q.shape)}")
    seen = perturb_moe(model, SEED + 12, False, QWEN3_MOE["hidden_size"])
    n = QWEN3_MOE["num_hidden_layers"]
    want_moe = moe_layer_ids(cfg)
    if want_moe != [0, 2, 3]:
        problem(f"qwen3_moe MoE layers by the config rule: {want_moe}, want [0, 2, 3]")
    want = {"norm": 4 * n + 1, "gated": 0, "A_log": 0, "dt_bias": 0, "conv1d": 0, "in_proj_b": 0,
            "router": len(want_moe)}
    if seen != want:
        problem(f"qwen3_moe perturbation hit {seen}, want {want}")
    model = model.to(torch.bfloat16)
    d = Path(models_dir) / "qwen3_moe"
    mg.save_hf(model, d)
    return d


# ----------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------
def experts_implementations(model):
    """What each experts module's forward dispatches on (use_experts_implementation reads
    self.config._experts_implementation); 'modulelist' for a transformers-4 style block."""
    got = set()
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("Experts"):
            if hasattr(m, "gate_up_proj"):
                got.add(getattr(getattr(m, "config", None), "_experts_implementation", "eager?"))
            else:
                got.add("modulelist")
    return got


def load_eager(cls, d, dtype, device):
    try:
        model = mg.load(cls, d, dtype, device, experts_implementation="eager")
    except TypeError as e:
        note(f"from_pretrained(experts_implementation=...) refused ({e}); set_experts_implementation")
        model = mg.load(cls, d, dtype, device)
    impls = experts_implementations(model)
    if impls != {"eager"} and hasattr(model, "set_experts_implementation"):
        note(f"{d.name}: experts implementation {impls} after from_pretrained(experts_implementation="
             f"'eager'); set_experts_implementation('eager')")
        model.set_experts_implementation("eager")
        impls = experts_implementations(model)
    if impls != {"eager"}:
        raise SystemExit(f"{d.name}: experts implementation {impls} after asking for eager: the goldens "
                         f"need the eager (ascending expert id, bf16 add per expert) order")
    return model


def moe_blocks(model):
    """{layer id: its MoE block} (blocks with a router `gate` and `experts`)."""
    _, layers = mg.parts(model)
    return {j: lay.mlp for j, lay in enumerate(layers) if hasattr(lay.mlp, "gate") and hasattr(lay.mlp, "experts")}


def replay_block(block, x, renorm, weights_fp32):
    """The MoE block as the design notes describe it, op by op in the run's dtype: router GEMM,
    fp32 softmax over all experts, top-k, renormalise, SwiGLU experts in ascending expert id with
    one rounded add each, then (qwen3_5_moe) the sigmoid-gated shared expert. Returns (output,
    routed part, shared part or None)."""
    x2 = x.reshape(-1, x.shape[-1])
    gate_w = block.gate.weight
    logits = F.linear(x2, gate_w)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, idx = torch.topk(probs, block.gate.top_k if hasattr(block.gate, "top_k") else block.top_k, dim=-1)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    if not weights_fp32:
        w = w.to(x2.dtype)
    ex = block.experts
    out = torch.zeros_like(x2)
    for e in sorted(set(idx.flatten().tolist())):
        slot, tok = torch.where(idx.T == e)  # slot-major, as transformers' expert mask [k, T]
        h = F.linear(x2[tok], ex.gate_up_proj[e])
        i = h.shape[-1] // 2
        a = F.silu(h[:, :i]) * h[:, i:]
        y = F.linear(a, ex.down_proj[e]) * w[tok, slot, None]
        out[tok] = out[tok] + y.to(out.dtype)
    routed = out
    shared = None
    if hasattr(block, "shared_expert"):
        s = block.shared_expert(x2)
        shared = torch.sigmoid(F.linear(x2, block.shared_expert_gate.weight)) * s
        out = out + shared
    return out.reshape(x.shape), routed, shared


class RoutingRecorder:
    """Hooks every MoE block for one forward: the router's input and outputs, the block's input
    and output. finish() returns the golden tensors [T, N, ...] and per-layer facts."""

    def __init__(self, model, n_layers, num_experts, k, renorm, label):
        self.blocks, self.n, self.E, self.k, self.renorm, self.label = moe_blocks(model), n_layers, num_experts, k, renorm, label
        self.gate, self.block, self.handles = {}, {}, []

    def __enter__(self):
        for j, b in self.blocks.items():
            self.handles.append(b.gate.register_forward_hook(
                lambda m, a, o, j=j: self.gate.__setitem__(j, (a[0].detach(), o))))
            self.handles.append(b.register_forward_hook(
                lambda m, a, o, j=j: self.block.__setitem__(j, (a[0].detach(), o[0] if isinstance(o, tuple) else o))))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False

    def finish(self, T):
        logits_all = torch.zeros(T, self.n, self.E)
        ids_all = torch.full((T, self.n, self.k), -1, dtype=torch.int32)
        w_all = torch.zeros(T, self.n, self.k)
        facts = {}
        for j, blk in self.blocks.items():
            x, out = self.gate[j]
            x2 = x.reshape(-1, x.shape[-1])
            logits = F.linear(x2, blk.gate.weight)  # the router's own op, recomputed
            outs = out if isinstance(out, (tuple, list)) else (out,)
            ints = [o for o in outs if torch.is_tensor(o) and not o.is_floating_point()]
            floats = [o for o in outs if torch.is_tensor(o) and o.is_floating_point()]
            if len(ints) != 1 or not floats:
                raise SystemExit(f"{self.label} layer {j}: router returned {[type(o) for o in outs]}; "
                                 f"expected (logits, weights, indices) as in transformers 5")
            ids = ints[0]
            cand = [o for o in floats[1:] if o.shape == ids.shape]
            if cand:
                w = cand[0]
            else:
                dense = [o for o in floats[1:] if o.shape[-1] == self.E]
                if not dense:
                    raise SystemExit(f"{self.label} layer {j}: no routing weights among the router's outputs")
                w = dense[0].gather(-1, ids.long())
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            first = "logits" if torch.equal(floats[0], logits) else (
                "probabilities" if torch.equal(floats[0].float(), probs) else "other")
            top_i = torch.topk(probs, self.k, dim=-1).indices  # the same call as the router's
            if not torch.equal(top_i, ids.long()):
                problem(f"{self.label} layer {j}: routing is not topk(softmax_fp32(logits)): "
                        f"{int((top_i != ids.long()).any(-1).sum())} tokens differ")
            top_p = torch.topk(probs, min(self.k + 1, self.E), dim=-1).values  # for the margin
            mine = top_p[:, :self.k]
            if self.renorm:
                mine = mine / mine.sum(-1, keepdim=True)
            if not torch.equal(mine.to(w.dtype), w):
                problem(f"{self.label} layer {j}: routing weights are not topk probabilities "
                        f"{'renormalised ' if self.renorm else ''}in {w.dtype} (max diff "
                        f"{(mine - w.float()).abs().max().item():.3e})")
            margin = (top_p[:, self.k - 1] - top_p[:, self.k]) if self.k < self.E else torch.ones(1)
            xb, yb = self.block[j]
            y_mine, routed, shared = replay_block(blk, xb, self.renorm, w.dtype == torch.float32)
            facts[j] = {
                "router_first_output": first,
                "weights_dtype": str(w.dtype).replace("torch.", ""),
                "boundary_ties": int((margin == 0).sum()),
                "order_ties": int((top_p[:, :self.k - 1] == top_p[:, 1:self.k]).any(-1).sum()) if self.k > 1 else 0,
                "min_margin": margin.min().item(),
                "tokens_per_expert": torch.bincount(ids.flatten().long(), minlength=self.E).tolist(),
                "replay_exact": bool(torch.equal(y_mine, yb)),
                "replay_max_abs": (y_mine.float() - yb.float()).abs().max().item(),
                "routed_rms": routed.float().pow(2).mean().sqrt().item(),
                "shared_rms": None if shared is None else shared.float().pow(2).mean().sqrt().item(),
            }
            logits_all[:, j] = logits.float().cpu()
            ids_all[:, j] = ids.to(torch.int32).cpu()
            w_all[:, j] = w.float().cpu()
        return {"router_logits": logits_all, "topk_ids": ids_all, "topk_weights": w_all}, facts


def run_all(model, seqs, label, n, E, k, renorm):
    res, facts = [], []
    for i, ids in enumerate(seqs):
        with RoutingRecorder(model, n, E, k, renorm, f"{label} seq{i}") as rec:
            r = mg.run_one(model, ids, f"{label} seq{i} (L={len(ids)})")
        tensors, f = rec.finish(len(ids))
        r.update(tensors)
        res.append(r)
        facts.append(f)
    return res, facts


def summarise(facts, fp32, bf16, moe_layers, E):
    """Per MoE layer over the 6 sequences: ties, margins, replay, empty experts, bf16 vs fp32
    expert-set differences, expert loads of the whole golden batch."""
    out = {}
    for j in moe_layers:
        fl = [f[j] for f in facts["fp32"]]
        bl = [f[j] for f in facts["bf16"]]
        set_diff = sum(int((a["topk_ids"][:, j].sort(-1).values != b["topk_ids"][:, j].sort(-1).values).any(-1).sum())
                       for a, b in zip(fp32, bf16))
        batch = [sum(x) for x in zip(*(f["tokens_per_expert"] for f in fl))]
        out[f"layer{j}"] = {
            "fp32_min_margin": min(f["min_margin"] for f in fl),
            "fp32_boundary_ties": sum(f["boundary_ties"] for f in fl),
            "bf16_boundary_ties": sum(f["boundary_ties"] for f in bl),
            "bf16_order_ties": sum(f["order_ties"] for f in bl),
            "bf16_tokens_with_other_experts_than_fp32": set_diff,
            "sequences_with_an_empty_expert": sum(1 for f in fl if 0 in f["tokens_per_expert"]),
            "tokens_per_expert_all_sequences": batch,
            "replay_exact_fp32": all(f["replay_exact"] for f in fl),
            "replay_exact_bf16": all(f["replay_exact"] for f in bl),
            "replay_max_abs_bf16": max(f["replay_max_abs"] for f in bl),
            "router_first_output": sorted({f["router_first_output"] for f in fl + bl}),
            "weights_dtype_bf16_run": sorted({f["weights_dtype"] for f in bl}),
            "routed_rms_longest_fp32": fl[-1]["routed_rms"],
            "shared_rms_longest_fp32": fl[-1]["shared_rms"],
        }
    return out


def fused_layout_check(cls, d, num_experts, layout):
    """transformers loads the other expert layout of the same weights to the same parameters:
    evidence for the loader's fused rule (gate_up_proj [E, 2I, D], gate rows first)."""
    from safetensors.torch import save_file

    tensors = mg.read_safetensors_dir(d)
    other = "fused" if layout == "per-expert" else "per-expert"
    tmp = Path(tempfile.mkdtemp(prefix=f"{d.name}-{other}-"))
    try:
        shutil.copy(d / "config.json", tmp / "config.json")
        save_file(relayout(tensors, other, num_experts), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        a = load_eager(cls, d, torch.float32, torch.device("cpu")).state_dict()
        b = load_eager(cls, tmp, torch.float32, torch.device("cpu")).state_dict()
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        if not same:
            diff = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))[:8]
            note(f"{d.name}: the {other} copy loads to other parameters: {diff}")
        return {"other_layout": other, "loads_to_identical_parameters": same}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_goldens(path, seqs, fp32, bf16, meta):
    from safetensors.torch import save_file

    t = {}
    for i, ids in enumerate(seqs):
        t[f"seq{i}.input_ids"] = ids.to(torch.int32).contiguous()
        for dname, res in (("fp32", fp32), ("bf16", bf16)):
            for k in ("layer_out", "final", "embed", "router_logits", "topk_ids", "topk_weights"):
                t[f"seq{i}.{dname}.{k}"] = res[i][k].contiguous()
    save_file(t, str(path), metadata={k: str(v) for k, v in meta.items()})
    print(f"  wrote {path} ({path.stat().st_size} bytes, {len(t)} tensors)")


def run_model(name, cls, d, seqs, dev, report, env):
    print(f"\n=== running {name} ({cls.__name__}) ===")
    with open(d / "config.json") as f:
        raw = json.load(f)
    tcfg = raw.get("text_config", raw)
    # The numbers from the config object (attribute_map may store num_experts under another
    # key); the JSON keys as written are reported for the loader.
    probe = load_eager(cls, d, torch.float32, torch.device("cpu"))
    pc = probe.config.text_config if hasattr(probe.config, "text_config") else probe.config
    n, E, k = pc.num_hidden_layers, pc.num_experts, pc.num_experts_per_tok
    renorm = bool(pc.norm_topk_prob) if raw["model_type"] == "qwen3_moe" else True
    layer_types = list(pc.layer_types) if raw["model_type"] == "qwen3_5_moe" else ["full_attention"] * n
    del probe
    moe_keys = {kk: v for kk, v in tcfg.items()
                if any(w in kk for w in ("expert", "topk", "mlp_only", "sparse", "intermediate"))}
    tensors = mg.read_safetensors_dir(d)
    layout = expert_layout(tensors)
    print(f"  save_pretrained wrote {len(tensors)} tensors, experts {layout}; model_type "
          f"{raw.get('model_type')}, architectures {raw.get('architectures')}")
    r, facts = {}, {}
    with mg.CallCounter() as cc:
        m = load_eager(cls, d, torch.float32, torch.device("cpu"))
        moe_layers = sorted(moe_blocks(m))
        cfg = m.config.text_config if hasattr(m.config, "text_config") else m.config
        if moe_layers != moe_layer_ids(cfg):
            problem(f"{name}: MoE blocks at {moe_layers}, the config rule says {moe_layer_ids(cfg)}")
        r["fp32"], facts["fp32"] = run_all(m, seqs, f"{name} fp32 cpu", n, E, k, renorm)
        del m
        if dev.type != "cpu":
            m = load_eager(cls, d, torch.float32, dev)
            r["fp32_dev"], facts["fp32_dev"] = run_all(m, seqs, f"{name} fp32 {dev}", n, E, k, renorm)
            del m
        m = load_eager(cls, d, torch.bfloat16, dev)
        r["bf16"], facts["bf16"] = run_all(m, seqs, f"{name} bf16 {dev}", n, E, k, renorm)
        del m
    counts = dict(cc.counts)
    info = {"layers": n, "dir": f"models/{name}", "expert_layout_saved": layout,
            "moe_layers": moe_layers, "num_experts": E, "num_experts_per_tok": k,
            "renormalise_topk": renorm, "gdn_fallback_call_counts": counts,
            "config_json_moe_keys": moe_keys, "config_json_model_type": raw.get("model_type"),
            "config_json_text_model_type": tcfg.get("model_type"),
            "architectures": raw.get("architectures"),
            "expert_tensor_names_layer0": sorted(t for t in tensors if ".layers.0.mlp." in t)[:12]}
    if "fp32_dev" in r:
        dmax = mg.compare_runs([{kk: x[kk] for kk in ("embed", "layer_out", "final")} for x in r["fp32_dev"]],
                               [{kk: x[kk] for kk in ("embed", "layer_out", "final")} for x in r["fp32"]])
        same_routes = all(torch.equal(a["topk_ids"], b["topk_ids"]) for a, b in zip(r["fp32_dev"], r["fp32"]))
        info["fp32_cpu_vs_device_max_abs"] = dmax
        info["fp32_cpu_vs_device_same_experts"] = same_routes
        print(f"  fp32 cpu vs fp32 {dev}: max abs diff {dmax:.3e}, same experts {same_routes}")
        ref_scale = max(x["layer_out"].abs().max().item() for x in r["fp32"])
        if dmax > 1e-4 * max(ref_scale, 1.0) or not same_routes:
            problem(f"{name}: fp32 on cpu and {dev} differ by {dmax:.3e} (same experts: {same_routes})")
    lo, prev = r["fp32"][-1]["layer_out"], r["fp32"][-1]["embed"]
    mags = {"embed_rms": prev.pow(2).mean().sqrt().item()}
    for j in range(n):
        mags[f"layer{j}_delta_rms"] = (lo[:, j] - prev).pow(2).mean().sqrt().item()
        prev = lo[:, j]
    info["magnitudes_fp32_longest_seq"] = mags
    moe = summarise(facts, r["fp32"], r["bf16"], moe_layers, E)
    for j, v in moe.items():
        print(f"  {j}: " + ", ".join(f"{kk}={vv}" for kk, vv in v.items()))
        if not v["replay_exact_fp32"] or not v["replay_exact_bf16"]:
            note(f"{name} {j}: the MoE block differs from the op-by-op replay of the design notes "
                 f"(bf16 max abs {v['replay_max_abs_bf16']:.3e}): transformers is right, the notes need fixing")
        if v["fp32_boundary_ties"]:
            problem(f"{name} {j}: {v['fp32_boundary_ties']} exact top-k boundary ties in fp32")
    if not any(v["sequences_with_an_empty_expert"] for v in moe.values()):
        problem(f"{name}: no sequence leaves an expert without tokens")
    try:
        info["other_layout_check"] = fused_layout_check(cls, d, E, layout)
    except Exception:
        problem(f"{name}: the other-layout check failed:\n" + traceback.format_exc())
    report["models"][name] = info
    report["moe"][name] = moe
    report["bf16_vs_fp32"] = [row for row in report["bf16_vs_fp32"] if row.get("model") != name]
    report["bf16_vs_fp32"] += mg.error_table(name, r["bf16"], r["fp32"], n)
    meta = {
        "model": name, "model_dir": f"models/{name}", "hf_class": cls.__name__,
        "num_layers": n, "hidden_size": tcfg["hidden_size"], "layer_types": ",".join(layer_types),
        "mlp_types": ",".join("moe" if j in moe_layers else "dense" for j in range(n)),
        "moe_layers": ",".join(map(str, moe_layers)),
        "num_experts": E, "num_experts_per_tok": k, "renormalise_topk": renorm,
        "routing_weights_dtype_bf16_run": ",".join(sorted({v2 for v in moe.values()
                                                           for v2 in v["weights_dtype_bf16_run"]})),
        "seq_lens": ",".join(map(str, mg.SEQ_LENS)), "num_seqs": len(mg.SEQ_LENS), "seed": SEED,
        "transformers_version": env["transformers"], "torch_version": env["torch"],
        "safetensors_version": env["safetensors"], "fp32_device": "cpu", "bf16_device": env["bf16_device"],
        "attn_implementation": "eager", "experts_implementation": "eager",
        "expert_layout_saved": layout,
        "call": "batch 1, one sequence alone, position_ids=arange(L)[None], attention_mask=None, "
                "use_cache=False, output_hidden_states=True",
        "layout": "as make_goldens.py (input_ids, {fp32,bf16}.{embed,layer_out,final}) plus "
                  "seq{i}.{fp32,bf16}.router_logits F32[T,N,E], .topk_ids I32[T,N,k] (transformers' "
                  "top-k order), .topk_weights F32[T,N,k]; rows of non-MoE layers -1 / 0",
    }
    return r, meta


def run(args):
    """Builds, runs and writes the MoE goldens under args.out; merges into its report."""
    t0 = time.time()
    first_problem, first_note = len(mg.PROBLEMS), len(mg.NOTES)
    mg.set_fp32_exact()
    import safetensors
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major < 5:
        raise SystemExit(f"transformers {transformers.__version__}: the MoE goldens need >= 5 (fused "
                         f"experts, experts_implementation)")
    from transformers import Qwen3_5MoeForConditionalGeneration, Qwen3MoeForCausalLM

    out = Path(args.out)
    (out / "models").mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                       ("cpu" if args.device == "auto" else args.device))
    env = {
        "transformers": transformers.__version__, "torch": torch.__version__,
        "safetensors": safetensors.__version__, "python": sys.version.split()[0],
        "cuda": torch.version.cuda,
        "bf16_device": f"{dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else platform.processor() or 'cpu'})",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seed": SEED, "seq_lens": mg.SEQ_LENS, "router_scale": ROUTER_SCALE,
    }
    env.update(mg.gdn_environment())
    print(json.dumps(env, indent=1))
    base = out / "goldens_report.json"
    if not base.exists():
        base = Path(__file__).resolve().parent / "goldens_report.json"
    report = json.loads(base.read_text()) if base.exists() else {"models": {}, "bf16_vs_fp32": []}
    report.setdefault("models", {})
    report.setdefault("bf16_vs_fp32", [])
    report["moe"] = {}
    specs = []
    print("\n=== building MoE models ===")
    for name, build, cls, max_token in (
            ("qwen35_moe", build_qwen35_moe, Qwen3_5MoeForConditionalGeneration, mg.QWEN35_MAX_TOKEN),
            ("qwen3_moe", build_qwen3_moe, Qwen3MoeForCausalLM, QWEN3_MOE["vocab_size"])):
        try:
            specs.append((name, cls, build(out / "models"), max_token))
        except Exception:
            problem(f"building {name} failed:\n" + traceback.format_exc())
    for idx, (name, cls, d, max_token) in enumerate(specs):
        seqs = mg.make_seqs(SEED + 100 * (idx + 1), max_token)
        try:
            r, meta = run_model(name, cls, d, seqs, dev, report, env)
            write_goldens(out / f"goldens_{name}.safetensors", seqs, r["fp32"], r["bf16"], meta)
        except SystemExit:
            raise
        except Exception:
            problem(f"running {name} failed:\n" + traceback.format_exc())
    print("\n=== bf16 vs fp32, MoE models (HF bf16 on %s against HF fp32 on cpu; worst over all sequences) ===" % dev)
    mg.print_table([row for row in report["bf16_vs_fp32"] if row["model"] in ("qwen35_moe", "qwen3_moe")])
    report["moe_run"] = {"env": env, "problems": mg.PROBLEMS[first_problem:], "notes": mg.NOTES[first_note:],
                         "seconds": round(time.time() - t0, 1),
                         "sizes_bytes": {p.name: p.stat().st_size for p in sorted(out.glob("goldens_*moe*"))}}
    for name, *_ in specs:
        report["moe_run"]["sizes_bytes"][f"models/{name}"] = sum(p.stat().st_size for p in (out / "models" / name).iterdir())
    with open(out / "goldens_report.json", "w") as f:
        json.dump(report, f, indent=1, default=str)
        f.write("\n")
    probs = mg.PROBLEMS[first_problem:]
    print(f"\nwrote {out / 'goldens_report.json'} (merged into {base}); sizes {report['moe_run']['sizes_bytes']}")
    print(f"done in {time.time() - t0:.1f} s; notes: {len(mg.NOTES) - first_note}; problems: {len(probs)}")
    for p in probs:
        print(f"PROBLEM: {p}")
    return 1 if probs else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (gets goldens_*moe*.safetensors, models/, the report)")
    ap.add_argument("--device", default="auto", help="device for the bf16 runs (auto: cuda if available)")
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
