#!/usr/bin/env python3
"""Make draftfeed's target-output goldens: what lm_head's logits say about each token, per model.

Usage:  cd tests/data && python3 make_target_output_goldens.py [--out DIR] [--only NAME[,NAME...]]

For every model directory in tests/data/models (qwen35_text, qwen35_mm, qwen3, qwen35_moe,
qwen3_moe, and the *_fp8 checkpoints), this loads the checkpoint in transformers in fp32 on the
CPU, exactly as make_goldens.py / make_moe_goldens.py / make_fp8_goldens.py make their fp32
references (their own helpers do it: make_goldens.load / make_moe_goldens.load_eager, eager
attention, eager experts, make_goldens.run_one with its hidden-state mapping checks), runs each
sequence of that model's goldens_<model>.safetensors ALONE (the same input_ids, read from that
file), and writes from the fp32 logits [T, V]:

  goldens_outputs_<model>.safetensors  (next to this script unless --out)
    draft_vocab            I32 [Vd]    100 distinct ids of [0, V), a seeded permutation's first
                                       100 (not sorted: the probs' columns follow this order)
    seq{i}.input_ids       I32 [T]     as in goldens_<model>.safetensors
    seq{i}.argmax          I32 [T]     argmax of the fp32 logits, ties to the lowest id
                                       (torch.argmax's rule; checked)
    seq{i}.top2_margin     F32 [T]     top-1 minus top-2 logit (0 on an exact tie)
    seq{i}.top_k_ids       I32 [T, 8]  the 8 largest log_softmax(logits) entries, best first,
    seq{i}.top_k_logprobs  F32 [T, 8]  exact ties by ascending id (draftfeed's order)
    seq{i}.draft_probs     F32 [T, Vd] softmax(logits[:, draft_vocab], dim=-1)

FP8 checkpoints: the reference is make_fp8_goldens.py's "ref", transformers in fp32 on the
dequantized weights float32(e4m3) * float32(weight_scale_inv) (a checkpoint of the same config
without quantization_config, written to a temporary folder), checked to hold exactly those
values (make_fp8_goldens.check_loaded).

Checks (a failure is a PROBLEM, exit status 1): every output finite; the logits equal
hidden_states[-1] (post-norm) @ W^T with W the checkpoint's lm_head.weight, or its
embed_tokens.weight where tie_word_embeddings (qwen3 stores no lm_head.weight), and the model's
output embedding is that W; the final hidden state equals the one in goldens_<model>.safetensors
(fp32.final / ref.final), so the model was loaded and run as for those goldens; argmax is the
lowest id among the maxima; top_k agrees with torch.topk; qwen35_mm's outputs equal qwen35_text's
bit for bit (the same text weights).
"""

import argparse
import datetime
import json
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_goldens as mg  # noqa: E402  (sets the deterministic/offline environment first)
import make_moe_goldens as mmg  # noqa: E402
import make_fp8_goldens as mfg  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TOP_K = 8
DRAFT_VOCAB_SIZE = 100
SEED = mg.SEED + 3000  # the draft vocabulary's permutation (the same per vocabulary size)
# The order of the report; any other model directory with a goldens file is done after these.
KNOWN = ["qwen35_text", "qwen35_mm", "qwen3", "qwen35_moe", "qwen3_moe",
         "qwen35_text_fp8", "qwen3_fp8", "qwen35_moe_fp8", "qwen3_moe_fp8"]
# hidden_states[-1] @ W^T against the model's logits: exact is expected (the same F.linear on
# the same tensors); up to this relative difference is reported as a note, beyond it a problem.
HEAD_REL_TOL = 1e-6
# The final hidden state against goldens_<model>.safetensors' (same script helpers, same
# machine: 0 expected; HF's fp32 CPU vs CUDA spread is 4e-6 relative).
FINAL_REL_TOL = 1e-4

problem, note = mg.problem, mg.note


def read_goldens(path):
    """(metadata, [input_ids int64 [T]], [reference final F32 [T, H]], its key)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        keys = set(f.keys())
        n = 0
        while f"seq{n}.input_ids" in keys:
            n += 1
        ref_key = "fp32.final" if "seq0.fp32.final" in keys else "ref.final"
        ids = [f.get_tensor(f"seq{i}.input_ids").to(torch.int64) for i in range(n)]
        finals = [f.get_tensor(f"seq{i}.{ref_key}").float() for i in range(n)]
    if str(meta.get("num_seqs", n)) != str(n):
        problem(f"{path.name}: metadata num_seqs {meta.get('num_seqs')} but {n} sequences")
    return meta, ids, finals, ref_key


def text_config(cfg):
    return cfg.get("text_config", cfg)


def head_weight(tensors, cfg):
    """(W [V, H] fp32, its name): lm_head.weight, or the embedding where tied."""
    if "lm_head.weight" in tensors:
        return tensors["lm_head.weight"].float(), "lm_head.weight"
    tied = bool(cfg.get("tie_word_embeddings", text_config(cfg).get("tie_word_embeddings", False)))
    names = [k for k in tensors if k.endswith("embed_tokens.weight") and not k.startswith("model.visual.")]
    if not tied or len(names) != 1:
        raise SystemExit(f"no lm_head.weight, tie_word_embeddings={tied}, embeddings {names}: no head")
    return tensors[names[0]].float(), f"{names[0]} (tied: no lm_head.weight stored)"


def dequantized_checkpoint(name, d, tmp):
    """make_fp8_goldens.py's ref checkpoint for the FP8 checkpoint d: every FP8 weight as
    float32(e4m3) * float32(scale) (make_fp8_goldens.dequantize), the other tensors as stored,
    config.json without quantization_config. Returns (dir, {weight: (q fp32, scale)}, tensors)."""
    tensors = mg.read_safetensors_dir(d)
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    if qc.get("weight_block_size") != [mfg.BLOCK, mfg.BLOCK] or qc.get("fmt") != "e4m3":
        problem(f"{name}: quantization_config {qc} is not make_fp8_goldens.py's scheme")
    quant, deq = {}, {}
    for k, v in tensors.items():
        if k.endswith("_scale_inv"):
            if k[: -len("_scale_inv")] not in tensors:
                problem(f"{name}: {k} has no weight")
            continue
        if k + "_scale_inv" in tensors:
            if v.dtype != torch.float8_e4m3fn:
                problem(f"{name}: {k} has a scale but is {v.dtype}")
            q, s = v.float(), tensors[k + "_scale_inv"]
            quant[k] = (q, s)
            deq[k] = mfg.dequantize(q, s)
        else:
            if v.dtype not in (torch.bfloat16, torch.float32):
                problem(f"{name}: unquantized tensor {k} is {v.dtype}")
            deq[k] = v
    ddir = Path(tmp) / f"{name}_deq"
    ddir.mkdir(parents=True)
    (ddir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    mfg.write_safetensors(ddir / "model.safetensors", deq, {"format": "pt"})
    print(f"  dequantized {len(quant)} FP8 weights of {d.name} into {ddir}")
    return ddir, quant, deq


class OutputCapture:
    """A forward hook on the whole model: the output object's logits and hidden_states[-1]
    (make_goldens.run_one calls the model with return_dict=True)."""

    def __init__(self, model):
        self.model, self.got = model, {}

    def __enter__(self):
        def hook(mod, args, out):
            self.got["logits"] = out.logits.detach()
            self.got["last_hidden"] = out.hidden_states[-1].detach()
        self.handle = self.model.register_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        return False


def outputs_from_logits(logits, draft):
    """The goldens of one sequence from its fp32 logits [T, V]; plus facts for the report."""
    T, V = logits.shape
    ar = torch.arange(V).expand(T, V)
    maxv = logits.max(dim=-1, keepdim=True).values
    is_max = logits == maxv
    lowest = torch.where(is_max, ar, torch.full_like(ar, V)).min(dim=-1).values
    torch_argmax = torch.argmax(logits, dim=-1)
    top2 = torch.topk(logits, 2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    lp = F.log_softmax(logits, dim=-1)
    # Larger first, exact ties by ascending id: a stable descending sort.
    lp_sorted, order = torch.sort(lp, dim=-1, descending=True, stable=True)
    ids, vals = order[:, :TOP_K], lp_sorted[:, :TOP_K].contiguous()
    tk_vals, tk_ids = torch.topk(lp, TOP_K, dim=-1, largest=True, sorted=True)
    probs = torch.softmax(logits[:, draft], dim=-1)
    facts = {
        "exact_argmax_ties": int((is_max.sum(-1) > 1).sum()),
        "torch_argmax_not_lowest": int((torch_argmax != lowest).sum()),
        "topk_values_differ_from_torch_topk": int((tk_vals != vals).any(-1).sum()),
        "topk_ids_differ_from_torch_topk": int((tk_ids != ids).any(-1).sum()),
        "top1_not_argmax": int((ids[:, 0] != lowest).sum()),
        "margin_le_1e-3": int((margin <= 1e-3).sum()),
        "topk_gaps_le_1e-3": int(((vals[:, :-1] - vals[:, 1:]) <= 1e-3).sum()),
        "min_margin": margin.min().item(),
        "max_abs_probs_sum_minus_1": (probs.double().sum(-1) - 1).abs().max().item(),
        "max_draft_prob": probs.max().item(),
        "logit_std": logits.std().item(),
    }
    out = {
        "argmax": lowest.to(torch.int32),
        "top2_margin": margin.float(),
        "top_k_ids": ids.to(torch.int32),
        "top_k_logprobs": vals.float(),
        "draft_probs": probs.float(),
    }
    return {k: v.contiguous() for k, v in out.items()}, facts


def run_model(name, out_dir, tmp, env):
    t0 = time.time()
    d = HERE / "models" / name
    gpath = HERE / f"goldens_{name}.safetensors"
    print(f"\n=== {name} ===")
    gmeta, seqs, ref_finals, ref_key = read_goldens(gpath)
    cfg = json.loads((d / "config.json").read_text())
    tcfg = text_config(cfg)
    import transformers

    cls_name = gmeta.get("hf_class") or cfg["architectures"][0]
    if cfg.get("architectures") and cls_name != cfg["architectures"][0]:
        problem(f"{name}: goldens say {cls_name}, config.json {cfg['architectures']}")
    cls = getattr(transformers, cls_name)
    fp8 = "quantization_config" in cfg
    moe = int(tcfg.get("num_experts", 0) or 0) > 0
    if fp8:
        load_dir, quant, tensors = dequantized_checkpoint(name, d, tmp)
        if str(len(quant)) != str(gmeta.get("fp8_weights", len(quant))):
            problem(f"{name}: {len(quant)} FP8 weights, the goldens metadata says {gmeta.get('fp8_weights')}")
    else:
        load_dir, quant, tensors = d, None, mg.read_safetensors_dir(d)
    W, head_name = head_weight(tensors, cfg)
    cpu = torch.device("cpu")
    # make_fp8_goldens.run_model's / make_moe_goldens.run_model's / make_goldens' fp32 load
    model = mmg.load_eager(cls, load_dir, torch.float32, cpu) if moe else mg.load(cls, load_dir, torch.float32, cpu)
    if fp8:
        mfg.check_loaded(model, quant, load_dir, name)
    V = int(tcfg["vocab_size"])
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    model_head = (out_emb if out_emb is not None else model.lm_head).weight.detach().float().cpu()
    if tuple(model_head.shape) != tuple(W.shape) or not torch.equal(model_head, W):
        problem(f"{name}: the model's output embedding is not {head_name} of the checkpoint "
                f"(shapes {tuple(model_head.shape)} vs {tuple(W.shape)}): a tied/untied head mix-up")
    if V < DRAFT_VOCAB_SIZE or W.shape[0] != V:
        raise SystemExit(f"{name}: vocab {V}, head {tuple(W.shape)}")
    draft = torch.randperm(V, generator=mg.gen(SEED))[:DRAFT_VOCAB_SIZE]
    if len(set(draft.tolist())) != DRAFT_VOCAB_SIZE or torch.equal(draft, draft.sort().values):
        problem(f"{name}: draft vocabulary not distinct or sorted")

    results, facts_all, logits_all = [], [], []
    head_diff = final_diff = 0.0
    head_exact = True
    for i, ids in enumerate(seqs):
        label = f"{name} fp32 cpu seq{i} (L={len(ids)})"
        with OutputCapture(model) as cap, torch.no_grad():
            r = mg.run_one(model, ids, label)
        logits = cap.got["logits"][0].float().cpu().contiguous()
        last = cap.got["last_hidden"]
        if tuple(logits.shape) != (len(ids), V):
            raise SystemExit(f"{label}: logits {tuple(logits.shape)}, want ({len(ids)}, {V})")
        if logits.dtype != torch.float32 or cap.got["logits"].dtype != torch.float32:
            problem(f"{label}: logits are {cap.got['logits'].dtype}, not float32")
        if not torch.isfinite(logits).all():
            problem(f"{label}: non-finite logits")
        # The head: hidden_states[-1] (final-normed; run_one checked it is norm(last layer)) @ W^T.
        with torch.no_grad():
            manual = F.linear(last.float().cpu(), W)[0]
        if not torch.equal(manual, logits):
            head_exact = False
            dd = (manual - logits).abs().max().item()
            head_diff = max(head_diff, dd)
            if dd > HEAD_REL_TOL * max(1.0, logits.abs().max().item()):
                problem(f"{label}: hidden_states[-1] @ {head_name}^T differs from the model's logits by {dd:.3e}")
        if not torch.equal(last[0].float().cpu(), r["final"]):
            problem(f"{label}: the output's hidden_states[-1] is not run_one's final state")
        ref = ref_finals[i]
        dd = (r["final"] - ref).abs().max().item() if r["final"].shape == ref.shape else float("inf")
        final_diff = max(final_diff, dd)
        if not dd <= FINAL_REL_TOL * max(1.0, ref.abs().max().item()):
            problem(f"{label}: final state differs from {gpath.name}'s {ref_key} by {dd:.3e}: not the same "
                    f"model or not the same run")
        o, f = outputs_from_logits(logits, draft)
        for k, v in o.items():
            if v.is_floating_point() and not torch.isfinite(v).all():
                problem(f"{label}: non-finite {k}")
        if f["torch_argmax_not_lowest"]:
            note(f"{label}: torch.argmax is not the lowest id among the maxima for {f['torch_argmax_not_lowest']} "
                 f"tokens; stored the lowest (draftfeed's rule)")
        if f["topk_values_differ_from_torch_topk"]:
            problem(f"{label}: sorted log_softmax values differ from torch.topk's")
        if f["top1_not_argmax"]:
            note(f"{label}: top_k_ids[:, 0] != argmax for {f['top1_not_argmax']} tokens (logits one ulp apart "
                 f"rounding to one log-prob)")
        if f["max_abs_probs_sum_minus_1"] > 1e-5:
            problem(f"{label}: draft probs sum to 1 +- {f['max_abs_probs_sum_minus_1']:.2e}")
        o["input_ids"] = ids.to(torch.int32).contiguous()
        results.append(o)
        facts_all.append(f)
        logits_all.append(logits)
    del model

    tot = lambda k: sum(f[k] for f in facts_all)  # noqa: E731
    summary = {
        "vocab": V, "tokens": sum(len(s) for s in seqs), "head": head_name,
        "head_check": "exact" if head_exact else f"max abs diff {head_diff:.3e}",
        f"final_vs_goldens_{ref_key}_max_abs": final_diff,
        "exact_argmax_ties": tot("exact_argmax_ties"), "torch_argmax_not_lowest": tot("torch_argmax_not_lowest"),
        "topk_ids_differ_from_torch_topk": tot("topk_ids_differ_from_torch_topk"),
        "tokens_margin_le_1e-3": tot("margin_le_1e-3"), "topk_gaps_le_1e-3": tot("topk_gaps_le_1e-3"),
        "min_top2_margin": min(f["min_margin"] for f in facts_all),
        "max_draft_prob": max(f["max_draft_prob"] for f in facts_all),
        "logit_std": sum(f["logit_std"] for f in facts_all) / len(facts_all),
    }
    if head_diff:
        note(f"{name}: hidden_states[-1] @ W^T equals the logits within {head_diff:.3e}, not bit for bit")

    reference = ("transformers fp32 on the dequantized weights float32(e4m3) * float32(weight_scale_inv) "
                 "(make_fp8_goldens.py's ref), cpu" if fp8 else
                 "transformers fp32 (dtype=float32 from the bf16 checkpoint), cpu (IEEE fp32, no TF32)")
    meta = {
        "model": name, "model_dir": f"models/{name}", "hf_class": cls_name,
        "source_goldens": gpath.name, "vocab_size": V, "num_seqs": len(seqs),
        "seq_lens": ",".join(str(len(s)) for s in seqs), "top_k": TOP_K,
        "draft_vocab_size": DRAFT_VOCAB_SIZE,
        "draft_vocab_rule": f"torch.randperm(vocab_size, generator=manual_seed({SEED}))[:{DRAFT_VOCAB_SIZE}]",
        "seed": SEED, "head": head_name, "reference": reference,
        "transformers_version": env["transformers"], "torch_version": env["torch"],
        "safetensors_version": env["safetensors"], "python": env["python"], "device": "cpu",
        "dtype": "float32", "attn_implementation": "eager",
        "experts_implementation": "eager" if moe else "n/a",
        "call": "batch 1, one sequence alone, position_ids=arange(L)[None], attention_mask=None, "
                "use_cache=False, output_hidden_states=True, return_dict=True; logits = the output's logits "
                "(checked equal to hidden_states[-1] @ head^T)",
        "tie_rule": "argmax and top-k: larger first, exact ties to the lower id",
        "layout": "draft_vocab I32[Vd]; seq{i}.input_ids I32[T]; seq{i}.argmax I32[T]; seq{i}.top2_margin "
                  "F32[T] (top1 - top2 logit); seq{i}.top_k_ids I32[T,k] and seq{i}.top_k_logprobs F32[T,k] "
                  "(log_softmax over the full vocabulary, best first); seq{i}.draft_probs F32[T,Vd] = "
                  "softmax(logits[:, draft_vocab]) (columns in draft_vocab's order)",
        "summary": json.dumps(summary),
        "date_utc": env["date_utc"],
    }
    t = {"draft_vocab": draft.to(torch.int32).contiguous()}
    for i, o in enumerate(results):
        for k, v in o.items():
            t[f"seq{i}.{k}"] = v
    path = Path(out_dir) / f"goldens_outputs_{name}.safetensors"
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file(t, str(path), metadata={k: str(v) for k, v in meta.items()})
    with safe_open(str(path), framework="pt") as f:
        if set(f.keys()) != set(t) or not all(torch.equal(f.get_tensor(k), t[k]) for k in t):
            problem(f"{path}: does not read back to what was written")
    summary["seconds"] = round(time.time() - t0, 1)
    print(f"  wrote {path} ({path.stat().st_size} bytes, {len(t)} tensors) in {summary['seconds']} s")
    print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    return summary, logits_all, seqs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE), help="output folder (default: next to this script)")
    ap.add_argument("--only", default="all", help="comma-separated model directory names (default: all)")
    args = ap.parse_args()
    t0 = time.time()
    mg.set_fp32_exact()
    import safetensors
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise SystemExit(f"transformers {transformers.__version__}: these goldens need >= 5 (as the MoE goldens)")
    env = {"transformers": transformers.__version__, "torch": torch.__version__,
           "safetensors": safetensors.__version__, "python": sys.version.split()[0],
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    print(json.dumps(env, indent=1))
    found = sorted(p.name for p in (HERE / "models").iterdir() if (p / "config.json").exists())
    names = [n for n in KNOWN if n in found] + [n for n in found if n not in KNOWN]
    if args.only != "all":
        want = args.only.split(",")
        bad = [n for n in want if n not in found]
        if bad:
            ap.error(f"no model directory {bad}; have {found}")
        names = [n for n in names if n in want]
    for n in names:
        if not (HERE / f"goldens_{n}.safetensors").exists():
            problem(f"models/{n} has no goldens_{n}.safetensors to take its input_ids from: skipped")
    names = [n for n in names if (HERE / f"goldens_{n}.safetensors").exists()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summaries, logits = {}, {}
    tmp = Path(tempfile.mkdtemp(prefix="outputgoldens-"))
    try:
        for n in names:
            try:
                summaries[n], lg, sq = run_model(n, out, tmp, env)
                logits[n] = (lg, sq)
            except SystemExit:
                raise
            except Exception:
                problem(f"{n}: failed:\n" + traceback.format_exc())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # The ConditionalGeneration checkpoint holds qwen35_text's weights: the same logits, exactly.
    if "qwen35_text" in logits and "qwen35_mm" in logits:
        (a, sa), (b, sb) = logits["qwen35_text"], logits["qwen35_mm"]
        same_ids = len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa, sb))
        eq = same_ids and all(torch.equal(x, y) for x, y in zip(a, b))
        print(f"\nqwen35_mm logits equal qwen35_text's bit for bit: {eq}")
        if same_ids and not eq:
            problem("qwen35_mm's logits differ from qwen35_text's (same text weights, same sequences)")

    print(f"\n=== report ({time.time() - t0:.1f} s) ===")
    print(f"{'model':<16} {'V':>4} {'tok':>4} {'head':<11} {'final_diff':>10} {'ties':>4} {'m<=1e-3':>7} "
          f"{'gap<=1e-3':>9} {'min_margin':>10} {'max_p':>7} {'logit_std':>9}")
    for n, s in summaries.items():
        fd = next(v for k, v in s.items() if k.startswith("final_vs_goldens"))
        print(f"{n:<16} {s['vocab']:>4} {s['tokens']:>4} {s['head_check'][:11]:<11} {fd:>10.2e} "
              f"{s['exact_argmax_ties']:>4} {s['tokens_margin_le_1e-3']:>7} {s['topk_gaps_le_1e-3']:>9} "
              f"{s['min_top2_margin']:>10.2e} {s['max_draft_prob']:>7.4f} {s['logit_std']:>9.3f}")
    print(f"done in {time.time() - t0:.1f} s; wrote {len(summaries)} files to {out}; notes: {len(mg.NOTES)}; "
          f"problems: {len(mg.PROBLEMS)}")
    for p in mg.PROBLEMS:
        print(f"PROBLEM: {p}")
    return 1 if mg.PROBLEMS else 0


if __name__ == "__main__":
    sys.exit(main())
