#!/usr/bin/env python3
"""The baseline draftfeed's engine is measured against: Hugging Face
transformers running the same model shape (random weights, bf16, sdpa,
output_hidden_states=True) on the same GPU, over the same packed batch
(token count and sequence lengths from the same seed as draftfeed-bench).

    python3 bench/transformers_prefill.py --shape qwen3.6-27b --tokens 16384

Prints tokens/s (median of --iters) and peak GPU memory. transformers sees the
packed batch as one [1, T] row with per-sequence position_ids; with sdpa its
attention spans the whole row (slightly more work than draftfeed's
block-diagonal attention, < 1% of the FLOPs at these sizes).
"""

import argparse
import statistics
import time

import torch

SHAPES = {
    "qwen3.6-27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                        head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_num_key_heads=16,
                        linear_num_value_heads=48, rms_norm_eps=1e-6, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                         "partial_rotary_factor": 0.25}),
}


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


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.6-27b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draftfeed-tokens-per-s", type=float, default=0.0,
                   help="draftfeed-bench's rate on the same batch, to print the ratio")
    args = p.parse_args()

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    cfg = Qwen3_5TextConfig(**SHAPES[args.shape])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    print(f"transformers: {args.shape} built on the GPU in {time.time() - t0:.1f}s, "
          f"weights {weights / 2**30:.2f} GiB", flush=True)
    lens = mixed_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens), device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens])[None]
    torch.cuda.reset_peak_memory_stats()
    times = []
    with torch.no_grad():
        for i in range(args.iters + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.model(input_ids=ids, position_ids=pos, use_cache=False,
                              output_hidden_states=True)
            torch.cuda.synchronize()
            if i > 0:
                times.append(time.perf_counter() - t)
            del out
    med = statistics.median(times)
    peak = torch.cuda.max_memory_allocated()
    print(f"transformers: {args.tokens} tokens in {len(lens)} sequences: median {med * 1e3:.0f} ms "
          f"= {args.tokens / med:,.0f} tokens/s; peak GPU memory {peak / 2**30:.1f} GiB "
          f"(weights + {(peak - weights) / 2**30:.1f} GiB)", flush=True)
    if args.draftfeed_tokens_per_s > 0:
        print(f"ratio: draftfeed {args.draftfeed_tokens_per_s:,.0f} / transformers "
              f"{args.tokens / med:,.0f} tokens/s = {args.draftfeed_tokens_per_s * med / args.tokens:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
