#!/usr/bin/env python3
"""The baseline draftfeed's engine is measured against: Hugging Face
transformers running the same model shape (random weights, bf16, sdpa,
output_hidden_states=True) on the same GPU, over the same packed batch
(token count and sequence lengths from the same seed as draftfeed-bench).

    python3 bench/transformers_prefill.py --model qwen3.6-27b --tokens 16384
    python3 bench/transformers_prefill.py --model qwen3.6-35b-a3b --tokens 49152 \\
        --draftfeed-tokens-per-s 61000
    python3 bench/transformers_prefill.py --model qwen3-30b-a3b --tokens 49152

Prints tokens/s (median of --iters), peak GPU memory and, given
--draftfeed-tokens-per-s (draftfeed-bench engine's rate on the same batch), the
ratio. transformers sees the packed batch as one [1, T] row with per-sequence
position_ids; with sdpa its attention spans the whole row (slightly more work
than draftfeed's block-diagonal attention, < 1% of the FLOPs at these sizes).

MoE shapes run with the fastest experts implementation transformers has for a
prefill of this size: grouped_mm (tokens sorted by expert, torch._grouped_mm);
if it is missing or fails on the first forward, eager (a Python loop over the
experts), with a printed note. batched_mm is not tried on its own: it copies
each selected expert's weights per token (49,152 tokens x 8 experts x 6 MiB at
the 35B-A3B shape), far past the GPU's memory. --experts-implementation
forces one. MoE shapes are built in bf16 directly (35B parameters in fp32
would not fit); the dense shape is built in fp32 and cast, as before.
"""

import argparse
import statistics
import sys
import time

import torch

SHAPES = {
    # qwen3_5 (dense hybrid): Qwen3_5ForCausalLM.
    "qwen3.6-27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                        head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_num_key_heads=16,
                        linear_num_value_heads=48, rms_norm_eps=1e-6, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                         "partial_rotary_factor": 0.25}),
    # qwen3_5_moe text model: Qwen3_5MoeForCausalLM. 40 layers, 3 GDN + 1 gated attention,
    # 256 experts top-8 of width 512 plus a shared expert of width 512 in every layer.
    "qwen3.6-35b-a3b": dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                            linear_conv_kernel_dim=4, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_num_key_heads=16,
                            linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
                            moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            rms_norm_eps=1e-6, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                             "partial_rotary_factor": 0.25,
                                             "mrope_section": [11, 11, 10],
                                             "mrope_interleaved": True}),
    # qwen3_moe: Qwen3MoeForCausalLM. 48 layers, all MoE (128 experts top-8 of width 768,
    # renormalised), attention 32 Q / 4 KV heads of 128.
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=False,
                          max_position_embeddings=40960,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}
# (config class, model class) in transformers, by shape.
CLASSES = {
    "qwen3.6-27b": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3.6-35b-a3b": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3-30b-a3b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
MOE = {"qwen3.6-35b-a3b", "qwen3-30b-a3b"}
EXPERTS_ORDER = ["grouped_mm", "eager"]  # fastest first, for a prefill of thousands of tokens


def mixed_lengths(tokens, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    lens, left = [], tokens
    while left > 0:
        n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), left)
        if 0 < left - n < lo:
            n = left
        lens.append(n)
        left -= n
    return lens


def classes(shape):
    import transformers

    names = CLASSES[shape]
    missing = [n for n in names if not hasattr(transformers, n)]
    if missing:
        sys.exit(f"transformers {transformers.__version__} has no {', '.join(missing)} "
                 f"(needed for --model {shape}; model types qwen3_5, qwen3_5_moe and qwen3_moe "
                 f"are in transformers >= 5)")
    return tuple(getattr(transformers, n) for n in names)


def make_config(shape):
    cfg_cls, _ = classes(shape)
    spec = SHAPES[shape]
    cfg = cfg_cls(**spec)
    # Read back what the shape depends on: a field this version renames or drops would
    # otherwise build another model without a word.
    wrong = {k: (getattr(cfg, k, None), v) for k, v in spec.items()
             if k != "rope_parameters" and getattr(cfg, k, None) != v}
    if wrong:
        sys.exit(f"{cfg_cls.__name__} did not keep {wrong} (field: (got, asked))")
    if shape == "qwen3.6-35b-a3b":
        want = ["linear_attention"] * 3 + ["full_attention"]
        if list(cfg.layer_types) != want * 10:
            sys.exit(f"{cfg_cls.__name__}.layer_types is not 10 x (3 GDN + 1 attention): "
                     f"{cfg.layer_types}")
    cfg._attn_implementation = "sdpa"
    return cfg


def experts_modules(model):
    """The modules whose forward dispatches on config._experts_implementation (transformers
    5's fused experts: gate_up_proj [E, 2I, D], down_proj [E, D, I])."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj")]


def set_experts(model, impl):
    """Selects `impl` and returns the implementation every experts module will run (what
    their forward reads), or raises if they disagree or it was refused."""
    mods = experts_modules(model)
    if not mods:
        raise RuntimeError(f"{type(model).__name__} has no fused experts modules "
                           f"(*Experts with gate_up_proj): not the transformers 5 MoE layout")
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:  # older 5.x: the attribute the experts' forward reads
        for m in mods:
            m.config._experts_implementation = impl
    got = {getattr(m.config, "_experts_implementation", None) for m in mods}
    if got != {impl}:
        raise RuntimeError(f"experts implementation is {got} after asking for {impl!r}")
    return impl


def forward(model, ids, pos):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.model(input_ids=ids, position_ids=pos, use_cache=False,
                      output_hidden_states=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n = len(out.hidden_states)
    del out
    return dt, n


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", "--shape", dest="shape", default="qwen3.6-27b",
                   help=f"one of {', '.join(sorted(SHAPES))} (a random: prefix is accepted)")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experts-implementation", default="auto",
                   choices=["auto", "grouped_mm", "batched_mm", "eager"],
                   help="MoE shapes: auto tries grouped_mm, then eager")
    p.add_argument("--draftfeed-tokens-per-s", type=float, default=0.0,
                   help="draftfeed-bench's rate on the same batch, to print the ratio")
    args = p.parse_args()
    args.shape = args.shape.removeprefix("random:")
    if args.shape not in SHAPES:
        p.error(f"--model {args.shape}: not one of {', '.join(sorted(SHAPES))}")
    if not torch.cuda.is_available():
        sys.exit("transformers_prefill.py measures on a GPU; torch sees no CUDA device")

    _, model_cls = classes(args.shape)
    cfg = make_config(args.shape)
    moe = args.shape in MOE
    torch.manual_seed(0)
    t0 = time.time()
    if moe:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = model_cls(cfg).eval()
        finally:
            torch.set_default_dtype(prev)
    else:
        with torch.device("cuda"):
            model = model_cls(cfg).to(torch.bfloat16).eval()
    dtypes = {t.dtype for t in model.parameters()}
    if dtypes != {torch.bfloat16}:
        sys.exit(f"parameters are {dtypes}, not all bf16")
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    print(f"transformers: {args.shape} ({model_cls.__name__}) built on the GPU in "
          f"{time.time() - t0:.1f}s, weights {weights / 2**30:.2f} GiB", flush=True)

    lens = mixed_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens])[None]
    want_states = cfg.num_hidden_layers + 1
    tries = [None]
    if moe:
        tries = EXPERTS_ORDER if args.experts_implementation == "auto" else [
            args.experts_implementation]
    impl = None
    with torch.no_grad():
        for i, choice in enumerate(tries):
            try:
                impl = set_experts(model, choice) if choice else None
                torch.cuda.reset_peak_memory_stats()
                warm_s, n = forward(model, ids, pos)  # warm-up; also proves the path runs
                break
            except (RuntimeError, ImportError, NotImplementedError, ValueError, KeyError) as e:
                torch.cuda.empty_cache()
                if i + 1 == len(tries):
                    raise
                print(f"note: experts implementation {choice!r} failed "
                      f"({type(e).__name__}: {str(e).splitlines()[0][:300]}); "
                      f"trying {tries[i + 1]!r}", flush=True)
        if n != want_states:
            sys.exit(f"hidden_states has {n} entries, expected {want_states}")
        if impl:
            print(f"transformers: experts implementation {impl} "
                  f"({len(experts_modules(model))} experts modules), warm-up forward "
                  f"{warm_s * 1e3:.0f} ms", flush=True)
        times = [forward(model, ids, pos)[0] for _ in range(args.iters)]
    med = statistics.median(times)
    peak = torch.cuda.max_memory_allocated()
    rate = args.tokens / med
    print(f"transformers: {args.tokens} tokens in {len(lens)} sequences: median {med * 1e3:.0f} ms "
          f"= {rate:,.0f} tokens/s; peak GPU memory {peak / 2**30:.1f} GiB "
          f"(weights + {(peak - weights) / 2**30:.1f} GiB)"
          + (f"; experts {impl}" if impl else ""), flush=True)
    if args.draftfeed_tokens_per_s > 0:
        print(f"ratio: draftfeed {args.draftfeed_tokens_per_s:,.0f} / transformers "
              f"{rate:,.0f} tokens/s = {args.draftfeed_tokens_per_s / rate:.2f}x", flush=True)


if __name__ == "__main__":
    main()
