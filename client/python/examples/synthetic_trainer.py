#!/usr/bin/env python3
"""A trainer-shaped draftfeed client over synthetic token data.

Packs random-length sequences into batches under a token budget, streams them
through a target with `Feed.map`, and does what a DFlash drafter's input stage
does with each result: views [T, K, H] as [T, K*H] (the fc input) and reduces
it. Prints progress, tokens/s and a run checksum that is the same on every run
with the same seed and model (it folds the targets' per-batch checksums).
"""

import argparse
import sys
import time

import numpy as np

import draftfeed


def packed_batches(n_batches, token_budget, min_len, max_len, vocab, seed):
    """Yields (token_ids, seq_lens) filling each batch up to the token budget."""
    rng = np.random.default_rng(seed)
    for _ in range(n_batches):
        lens = []
        total = 0
        while True:
            n = int(rng.integers(min_len, max_len + 1))
            if total + n > token_budget:
                if total == 0:
                    n = token_budget
                else:
                    break
            lens.append(n)
            total += n
            if total == token_budget:
                break
        tokens = rng.integers(0, vocab, size=total, dtype=np.int32)
        yield tokens, np.asarray(lens, dtype=np.int32)


def fold(h, x):
    return ((h ^ x) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", required=True,
                   help="target address host:port (repeat for several targets)")
    p.add_argument("--layers", default="",
                   help="comma-separated layer ids; default: every layer plus -1 (final)")
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--token-budget", type=int, default=1024, help="tokens per packed batch")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--prefetch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress-every", type=int, default=50)
    args = p.parse_args()

    info = draftfeed.describe_target(args.target[0])
    if args.layers:
        layers = [int(x) for x in args.layers.split(",")]
    else:
        layers = list(range(info["num_layers"])) + [draftfeed.FINAL_LAYER]
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    print(f"trainer: target {info['model_id']} ({info['architecture']}, {info['num_layers']} layers, "
          f"hidden {info['hidden_size']}, fingerprint {info['fingerprint']}); capturing layers {layers}; "
          f"{args.batches} batches of {args.token_budget} tokens; torch {'yes' if have_torch else 'no'}",
          flush=True)

    run_checksum = 0xCBF29CE484222325
    tokens = 0
    t0 = time.perf_counter()
    sink = 0.0
    with draftfeed.Feed(targets=args.target, layers=layers, prefetch=args.prefetch) as feed:
        batches = packed_batches(args.batches, args.token_budget, args.min_len, args.max_len,
                                 info["vocab_size"], args.seed)
        for i, r in enumerate(feed.map(batches), start=1):
            if have_torch:
                h = r.torch()                           # bf16 [T, K, H], no copy
                fc_in = h.reshape(r.num_tokens, -1)     # DFlash's concatenated input
                sink += float(fc_in[:, :8].float().sum())
            else:
                h = r.hidden                            # float32 [T, K, H]
                sink += float(h.reshape(r.num_tokens, -1)[:, :8].sum())
            assert r.hidden_bits.shape == (r.num_tokens, len(layers), info["hidden_size"])
            run_checksum = fold(run_checksum, r.checksum)
            tokens += r.num_tokens
            if i % args.progress_every == 0 or i == args.batches:
                dt = time.perf_counter() - t0
                print(f"trainer: {i}/{args.batches} batches, {tokens} tokens, "
                      f"{tokens / dt:,.0f} tokens/s, queue {feed.stats()['outstanding']}", flush=True)
        stats = feed.stats()
    dt = time.perf_counter() - t0
    if stats["delivered"] != args.batches or stats["failed"] != 0:
        print(f"trainer: ERROR: delivered {stats['delivered']} of {args.batches}, "
              f"failed {stats['failed']}", file=sys.stderr)
        return 1
    print(f"trainer: done: {args.batches} batches, {tokens} tokens in {dt:.2f}s = "
          f"{tokens / dt:,.0f} tokens/s, {stats['bytes_received'] / dt / 1e6:.1f} MB/s of hidden states; "
          f"checksum {run_checksum:016x}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
