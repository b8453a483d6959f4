#!/usr/bin/env python3
"""Make draftfeed's long-sequence goldens: one sequence of 3,000 tokens per model family.

Usage (from the repo root):  python3 tests/data/make_long_goldens.py --out tests/data [--only NAME,...]

The short goldens (make_goldens.py, make_moe_goldens.py) stop at 130 tokens. A sequence longer
than one forward is run by the engines in several (chunked prefill, ForwardInput::resume_tokens /
carry_last), so the carried K/V, conv tails and GDN states need a reference over many 64-token
GDN chunks and many forward cuts. This script loads the checked-in checkpoints of
tests/data/models (qwen35_text: hybrid GDN + gated attention; qwen3: dense; qwen35_moe: hybrid
MoE; qwen3_moe: MoE with a dense layer), runs ONE seeded random sequence of LONG_LEN tokens
through each ALONE with the short goldens' own helpers and call convention
(make_goldens.load / make_moe_goldens.load_eager: eager attention and eager experts;
make_goldens.run_one: batch 1, position_ids = arange(L)[None], attention_mask None, use_cache
False, output_hidden_states, with its hidden-state mapping checks), and writes

  goldens_long_<model>.safetensors   (under --out)
    seq0.input_ids            I32  [T]        the token ids (T = LONG_LEN)
    seq0.rows                 I32  [R]        the token positions stored below, ascending
    layers                    I32  [K]        draftfeed capture ids: 0, N/2, N-1 and -1 (final)
    seq0.fp32.hidden          F32  [R, K, H]  row r, slot k: the state of token rows[r] at
                                              layers[k]; id j >= 0 is the raw output of decoder
                                              layer j (hidden_states[j+1], a forward hook for
                                              j = N-1), id -1 is hidden_states[N] (final norm)
    seq0.bf16.hidden          BF16 [R, K, H]  the same from the bf16 run (exact: bf16 values)
  MoE models also:
    seq0.fp32.router_logits   F32  [R, N, E]  router logits of every layer at the stored rows
    seq0.bf16.router_logits   F32  [R, N, E]  (rows of non-MoE layers 0), as make_moe_goldens.py

Why a subset of rows: all T tokens at K = 4 slots would be T * 4 * H * 6 bytes (fp32 + bf16):
4.6 MB at H = 64 and 9.2 MB at H = 128. The rows kept (ROWS rule below) are every 7th token
(7 is prime to 64, so every position within a GDN chunk is sampled), the first and last
EDGE_HEAD tokens, and the tokens around every multiple of 64 (where the GDN chunks and every
cut PlanForwardChunks makes fall) and around EXTRA_EDGES (the off-grid cuts the tests make):
about 680 rows, 1.1 MB (H = 64) to 2.3 MB (H = 128) a file.

Runs, as for the short goldens:
  fp32   loaded with dtype=float32 from the bf16 checkpoint, run on the CPU (IEEE fp32, no
         TF32): the canonical reference, the one the tests' bounds are argued against
         (tests/server/model/goldens.h). With --fp32-device cuda it runs on the GPU instead.
  fp32@gpu  when CUDA is there, the same in fp32 on the GPU with TF32 off: a cross-check only
         (max |diff| <= 1e-4 * max(max|ref|, 1) and, for MoE, the same experts for every token).
  bf16   dtype=bfloat16 on the GPU (the CPU without one): the bar the CUDA engine is held to.

Checks (a failure is a PROBLEM and exit status 1): the hidden-state mapping and (MoE) routing
checks of the helpers, on the whole sequence; every stored value finite; the fp32 cross-check;
no exact top-k boundary tie in fp32 (MoE); the file under MAX_FILE_BYTES; the file read back by
the safetensors package to the same bytes (written by make_fp8_goldens.write_safetensors).
Printed per model: HF-bf16 against fp32 per stored layer over the first and the last third of
the rows, and the smallest fp32 routing margin. Takes well under a minute; needs only torch and
transformers (>= 5; made with 5.17 / torch 2.11).
"""

import argparse
import datetime
import importlib.util
import json
import platform
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_goldens as mg  # noqa: E402  (sets the deterministic/offline environment first)
import make_fp8_goldens as mfg  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SEED = mg.SEED + 4000  # + 1000 MoE, + 2000 FP8, + 3000 target outputs
LONG_LEN = 3000  # 46 full GDN chunks of 64 and a partial one of 56; under max_position 4096
ROW_STRIDE = 7
EDGE_ALIGN = 64  # forward_chunks.h kSplitAlign, the GDN chunk
EDGE_BEFORE, EDGE_AFTER = 2, 3  # rows c-2 .. c+3 around an edge c (the conv window is 4)
EDGE_HEAD = 8  # the first and last tokens
EXTRA_EDGES = [1000]  # the tests' off-grid cut beyond the first 130 tokens
MAX_FILE_BYTES = 3 << 20
# A top-k probability gap below which fp32 CPU and GPU runs may route a token differently.
NEAR_TIE_GAP = 1e-4

# name, transformers class, MoE, ids below (the qwen3.5 vocabularies keep the special ids free)
FAMILIES = [
    ("qwen35_text", "Qwen3_5ForCausalLM", False, mg.QWEN35_MAX_TOKEN),
    ("qwen3", "Qwen3ForCausalLM", False, 512),
    ("qwen35_moe", "Qwen3_5MoeForConditionalGeneration", True, mg.QWEN35_MAX_TOKEN),
    ("qwen3_moe", "Qwen3MoeForCausalLM", True, 512),
]

problem, note = mg.problem, mg.note


def stored_rows(T):
    """The token positions kept (see the module doc), ascending."""
    rows = set(range(0, T, ROW_STRIDE)) | set(range(min(EDGE_HEAD, T))) | set(range(max(0, T - EDGE_HEAD), T))
    for c in list(range(EDGE_ALIGN, T, EDGE_ALIGN)) + [c for c in EXTRA_EDGES if c < T]:
        rows |= set(range(max(0, c - EDGE_BEFORE), min(T, c + EDGE_AFTER + 1)))
    return sorted(rows)


ROWS_RULE = (f"every {ROW_STRIDE}th token, the first and last {EDGE_HEAD}, and c-{EDGE_BEFORE}..c+{EDGE_AFTER} "
             f"for every multiple c of {EDGE_ALIGN} and c in {EXTRA_EDGES}")


def capture_ids(n):
    return [0, n // 2, n - 1, -1]


def pick(run, rows, ids):
    """[R, K, H] from run_one's layer_out [T, N, H] / final [T, H] in draftfeed id order."""
    r = torch.tensor(rows, dtype=torch.long)
    return torch.stack([run["final"][r] if j == -1 else run["layer_out"][r, j] for j in ids], dim=1).contiguous()


def golden_tensors(name, ids, rows, lids, r32, rb, moe):
    """The file's tensors (module doc) from the fp32 and bf16 runs of the whole sequence."""
    ri = torch.tensor(rows, dtype=torch.long)
    t = {
        "seq0.input_ids": ids.to(torch.int32),
        "seq0.rows": ri.to(torch.int32),
        "layers": torch.tensor(lids, dtype=torch.int32),
        "seq0.fp32.hidden": pick(r32, rows, lids),
        "seq0.bf16.hidden": pick(rb, rows, lids).to(torch.bfloat16),
    }
    if not torch.equal(t["seq0.bf16.hidden"].float(), pick(rb, rows, lids)):
        problem(f"{name}: the bf16 run's states are not bf16 values")
    if moe:
        t["seq0.fp32.router_logits"] = r32["router_logits"][ri].float().contiguous()
        t["seq0.bf16.router_logits"] = rb["router_logits"][ri].float().contiguous()
    for k, v in t.items():
        if v.is_floating_point() and not torch.isfinite(v.float()).all():
            problem(f"{name}: {k} has non-finite values")
    return t


def run(model, ids, label, moe):
    """The whole sequence once; MoE runs record the routing through make_moe_goldens' recorder."""
    if not moe:
        return mg.run_one(model, ids, label), None
    import make_moe_goldens as mmg

    _, layers = mg.parts(model)
    cfg = model.config.text_config if hasattr(model.config, "text_config") else model.config
    renorm = bool(cfg.norm_topk_prob) if cfg.model_type == "qwen3_moe" else True
    res, facts = mmg.run_all(model, [ids], label, len(layers), cfg.num_experts, cfg.num_experts_per_tok, renorm)
    return res[0], facts[0]


def load(cls, d, dtype, device, moe):
    if moe:
        import make_moe_goldens as mmg

        return mmg.load_eager(cls, d, dtype, device)
    return mg.load(cls, d, dtype, device)


def token_margins(router_logits, moe_layers, k):
    """Per token, the smallest gap between the k-th and (k+1)-th softmax probability over the
    MoE layers (make_moe_goldens.py's margin), [T]."""
    gaps = []
    for j in moe_layers:
        top = torch.topk(torch.softmax(router_logits[:, j].float(), dim=-1), k + 1, dim=-1).values
        gaps.append(top[:, k - 1] - top[:, k])
    return torch.stack(gaps, dim=1).min(dim=1).values


def routing_margin(router_logits, moe_layers, k):
    """The smallest fp32 margin over all tokens and the number of exact boundary ties."""
    gaps = token_margins(router_logits, moe_layers, k)
    return gaps.min().item(), int((gaps == 0).sum())


def bf16_error(b, f):
    """rms(b - f) / rms(f) and the lowest per-token cosine, for [R, H] tensors."""
    d = (b.double() - f.double())
    rms = (d.pow(2).mean().sqrt() / f.double().pow(2).mean().sqrt().clamp_min(1e-30)).item()
    cos = F.cosine_similarity(b.double(), f.double(), dim=-1).min().item()
    return rms, cos


def run_family(name, cls_name, moe, max_token, idx, out, dev, fp32_dev, env):
    import transformers

    print(f"\n=== {name} ({cls_name}) ===")
    cls = getattr(transformers, cls_name)
    d = HERE / "models" / name
    if not (d / "config.json").exists():
        problem(f"{d}: no checkpoint (make_goldens.py writes it)")
        return
    ids = torch.randint(0, max_token, (LONG_LEN,), generator=mg.gen(SEED + 100 * (idx + 1)), dtype=torch.int64)
    rows = stored_rows(LONG_LEN)
    t0 = time.time()
    m = load(cls, d, torch.float32, fp32_dev, moe)
    n = len(mg.parts(m)[1])
    cfg = m.config.text_config if hasattr(m.config, "text_config") else m.config
    # as the short goldens record them: Qwen3's own layer_types (if any) say sliding or not
    layer_types = list(cfg.layer_types) if name.startswith("qwen35") else ["full_attention"] * n
    moe_layers = []
    if moe:
        import make_moe_goldens as mmg

        moe_layers = sorted(mmg.moe_blocks(m))
    r32, facts32 = run(m, ids, f"{name} fp32 {fp32_dev} (L={LONG_LEN})", moe)
    del m
    print(f"  fp32 on {fp32_dev}: {time.time() - t0:.1f} s")
    info = {"fp32_device": str(fp32_dev)}
    if dev.type == "cuda" and fp32_dev.type == "cpu":
        m = load(cls, d, torch.float32, dev, moe)
        rdev, _ = run(m, ids, f"{name} fp32 {dev} (L={LONG_LEN})", moe)
        del m
        dmax = max((rdev[k] - r32[k]).abs().max().item() for k in ("embed", "layer_out", "final"))
        scale = max(r32["layer_out"].abs().max().item(), 1.0)
        other = torch.zeros(LONG_LEN, dtype=torch.bool)
        if moe:
            other = (rdev["topk_ids"].sort(-1).values != r32["topk_ids"].sort(-1).values).any(-1).any(-1)
        info["fp32_cpu_vs_gpu_max_abs"] = dmax
        info["fp32_cpu_vs_gpu_tokens_routed_otherwise"] = int(other.sum())
        print(f"  fp32 cpu vs {dev} (TF32 off): max abs diff {dmax:.3e} (max|ref| {scale:.3g}), "
              f"{int(other.sum())} tokens routed otherwise")
        if other.any():
            # Over 3,000 tokens an fp32 top-k gap may be as small as the CPU-vs-GPU rounding: a
            # token routed otherwise there (and the states it feeds) is a near-tie, not an error.
            gaps = token_margins(r32["router_logits"], moe_layers, r32["topk_ids"].shape[-1])
            worst = gaps[other].max().item()
            info["fp32_cpu_vs_gpu_largest_gap_routed_otherwise"] = worst
            if worst > NEAR_TIE_GAP:
                problem(f"{name}: fp32 on cpu and {dev} route {int(other.sum())} tokens otherwise, one with "
                        f"a top-k probability gap of {worst:.3e}")
            else:
                note(f"{name}: fp32 on cpu and {dev} route {int(other.sum())} near-tie tokens otherwise "
                     f"(gaps <= {worst:.3e}); their states are not compared")
        elif dmax > 1e-4 * scale:
            problem(f"{name}: fp32 on cpu and {dev} differ by {dmax:.3e} (TF32 on?)")
    m = load(cls, d, torch.bfloat16, dev, moe)
    rb, _ = run(m, ids, f"{name} bf16 {dev} (L={LONG_LEN})", moe)
    del m

    lids = capture_ids(n)
    tensors = golden_tensors(name, ids, rows, lids, r32, rb, moe)
    h32, hb = tensors["seq0.fp32.hidden"], tensors["seq0.bf16.hidden"].float()
    meta = {
        "model": name, "model_dir": f"models/{name}", "hf_class": cls_name,
        "num_layers": n, "hidden_size": h32.shape[-1], "layer_types": ",".join(layer_types),
        "seq_len": LONG_LEN, "num_rows": len(rows), "rows_rule": ROWS_RULE,
        "layers": ",".join(map(str, lids)), "seed": SEED + 100 * (idx + 1),
        "ids_rule": f"torch.randint(0, {max_token}, ({LONG_LEN},), generator=manual_seed(seed))",
        "transformers_version": env["transformers"], "torch_version": env["torch"],
        "fp32_device": str(fp32_dev), "bf16_device": env["bf16_device"],
        "attn_implementation": "eager",
        "call": "batch 1, one sequence alone, position_ids=arange(L)[None], attention_mask=None, "
                "use_cache=False, output_hidden_states=True (make_goldens.run_one)",
        "layout": "seq0.input_ids I32[T]; seq0.rows I32[R]; layers I32[K] (draftfeed ids, -1 = final norm); "
                  "seq0.fp32.hidden F32[R,K,H]; seq0.bf16.hidden BF16[R,K,H]; MoE: "
                  "seq0.{fp32,bf16}.router_logits F32[R,N,E] (non-MoE layers 0)",
    }
    if moe:
        E, k = r32["router_logits"].shape[-1], r32["topk_ids"].shape[-1]
        margin, ties = routing_margin(r32["router_logits"], moe_layers, k)
        flips = int((r32["topk_ids"].sort(-1).values != rb["topk_ids"].sort(-1).values).any(-1).any(-1).sum())
        info.update({"fp32_min_topk_margin": margin, "fp32_boundary_ties": ties,
                     "bf16_tokens_routed_otherwise": flips})
        print(f"  routing: fp32 smallest top-{k} margin {margin:.3e} over {LONG_LEN} tokens, {ties} exact ties; "
              f"HF-bf16 routes {flips} tokens to other experts somewhere")
        if ties:
            problem(f"{name}: {ties} exact top-k boundary ties in fp32")
        meta.update({"num_experts": E, "num_experts_per_tok": k, "moe_layers": ",".join(map(str, moe_layers)),
                     "mlp_types": ",".join("moe" if j in moe_layers else "dense" for j in range(n)),
                     "experts_implementation": "eager"})
        if facts32 is not None:
            info["replay_exact_fp32"] = all(f["replay_exact"] for f in facts32.values())
    # HF-bf16 against fp32 per stored layer, over the first and the last third of the rows:
    # whether its error grows along the sequence (the CUDA engine's bar is this error).
    third = len(rows) // 3
    table = {}
    print("  HF-bf16 vs fp32 at the stored rows:  layer  rms_rel(first third)  rms_rel(last third)  min_cos(all)")
    for kk, j in enumerate(lids):
        e_first = bf16_error(hb[:third, kk], h32[:third, kk])
        e_last = bf16_error(hb[-third:, kk], h32[-third:, kk])
        e_all = bf16_error(hb[:, kk], h32[:, kk])
        table[str(j)] = {"rms_rel_first_third": e_first[0], "rms_rel_last_third": e_last[0],
                         "rms_rel": e_all[0], "min_cos": e_all[1]}
        print(f"    {'final' if j == -1 else j:>5}  {e_first[0]:.3e}  {e_last[0]:.3e}  {e_all[1]:.6f}")
    info["bf16_vs_fp32"] = table
    meta["summary"] = json.dumps(info, sort_keys=True)
    path = Path(out) / f"goldens_long_{name}.safetensors"
    size = mfg.write_safetensors(path, tensors, meta)
    print(f"  wrote {path}: {size} bytes, {len(rows)} of {LONG_LEN} rows, layers {lids}")
    if size > MAX_FILE_BYTES:
        problem(f"{path}: {size} bytes, over the {MAX_FILE_BYTES} allowed")
    if importlib.util.find_spec("safetensors") is None:
        note("safetensors is not importable: the read-back check did not run")
    else:
        mfg.check_readback(path, tensors)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE), help="output folder (default: next to this script)")
    ap.add_argument("--only", default="all", help="comma-separated names of " + ",".join(f[0] for f in FAMILIES))
    ap.add_argument("--device", default="auto", help="device of the bf16 run and the fp32 cross-check "
                                                       "(auto: cuda if available, else cpu)")
    ap.add_argument("--fp32-device", default="cpu", help="device of the canonical fp32 run (default cpu: "
                                                          "IEEE fp32, as the short goldens)")
    args = ap.parse_args()
    t0 = time.time()
    mg.set_fp32_exact()
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise SystemExit(f"transformers {transformers.__version__}: the goldens need >= 5 (the checkpoints' "
                         f"classes, experts_implementation)")
    dev = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                       ("cpu" if args.device == "auto" else args.device))
    fp32_dev = torch.device(args.fp32_device)
    env = {"transformers": transformers.__version__, "torch": torch.__version__,
           "python": sys.version.split()[0], "cuda": torch.version.cuda,
           "bf16_device": f"{dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else platform.processor() or 'cpu'})",
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    env.update(mg.gdn_environment())
    print(json.dumps(env, indent=1))
    if env.get("importable_fla") is True or env.get("importable_causal_conv1d") is True:
        problem("flash-linear-attention or causal-conv1d is importable: HF may not use the torch GDN fallbacks")
    wanted = None if args.only == "all" else set(args.only.split(","))
    if wanted is not None and not wanted <= {f[0] for f in FAMILIES}:
        raise SystemExit(f"--only {args.only}: names are {[f[0] for f in FAMILIES]}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = stored_rows(LONG_LEN)
    print(f"{LONG_LEN} tokens, {len(rows)} rows stored ({ROWS_RULE})")
    for idx, (name, cls_name, moe, max_token) in enumerate(FAMILIES):
        if wanted is not None and name not in wanted:
            continue
        try:
            run_family(name, cls_name, moe, max_token, idx, args.out, dev, fp32_dev, env)
        except Exception:
            problem(f"{name} failed:\n" + traceback.format_exc())
    print(f"\ndone in {time.time() - t0:.1f} s; notes: {len(mg.NOTES)}; problems: {len(mg.PROBLEMS)}")
    for p in mg.PROBLEMS:
        print(f"PROBLEM: {p}")
    return 1 if mg.PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main())
