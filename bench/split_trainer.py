#!/usr/bin/env python3
"""One trainer process of the split benchmark (bench/splits.py starts these).

Opens its own draftfeed.Feed over every target of the split (the feed balances), sends packed
batches of synthetic tokens (draftfeed.packing.pack_sequences) and runs one drafter step per
batch:

- `none`: no drafter work (used to measure a target's rate alone),
- `synthetic`: a matmul chain costing about --flops-per-token FLOPs per token (forward only),
- `dflash`: the small DFlash-style drafter of client/python/examples/train_drafter.py
  (fc over the K concatenated layers, one transformer block, loss, backward, AdamW step).

`--drafter-rate R` (optional) pads every step to at least tokens/R seconds, as the targets'
--throttle_tokens_per_s does, to emulate a drafter device of a given speed on a small CPU box.

Protocol with the orchestrator: warm-up (--warmup-tokens), then create --ready-file, wait for
--go-file, run --tokens measured tokens, print ONE JSON line on stdout (the report).

`--calibrate` instead times drafter steps on random hidden states of the target's shape (no
feed; only --hidden-size/--num-layers needed) and prints {"drafter_tokens_per_s": ...}.
"""

import argparse
import importlib.util
import json
import os
import pathlib
import resource
import sys
import threading
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def load_example_drafter():
    path = REPO / "client" / "python" / "examples" / "train_drafter.py"
    spec = importlib.util.spec_from_file_location("draftfeed_example_train_drafter", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Drafter:
    """A drafter step: `step(hidden [T,K,H] bf16 torch, token_ids int32 np, seq_lens int32 np)`."""

    def __init__(self, kind, num_layers, hidden_size, flops_per_token, device, vocab, seed):
        self.kind = kind
        self.flops_per_token = 0.0
        if kind == "none":
            return
        import torch
        torch.manual_seed(seed)
        self.torch = torch
        self.device = torch.device(device)
        kh = num_layers * hidden_size
        if kind == "synthetic":
            # fc [K*H, d] then n square [d, d] matmuls: 2*(K*H*d + n*d*d) FLOPs per token.
            f = float(flops_per_token)
            d = 256
            while d > 8 and 2.0 * kh * d > f:
                d //= 2
            n = max(0, int(round((f - 2.0 * kh * d) / (2.0 * d * d))))
            self.fc = torch.randn(kh, d, device=self.device) / kh ** 0.5
            self.ws = [torch.randn(d, d, device=self.device) / d ** 0.5 for _ in range(n)]
            self.flops_per_token = 2.0 * (kh * d + n * d * d)
        elif kind == "dflash":
            ex = load_example_drafter()
            self.ex = ex
            self.vocab = vocab
            dim = 128
            self.model = ex.Drafter(num_layers, hidden_size, dim, vocab).to(self.device)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-3, weight_decay=0.0)
            # Forward + backward ~ 6 FLOPs per parameter per token (attention left out).
            self.flops_per_token = 6.0 * sum(p.numel() for p in self.model.parameters())
        else:
            raise ValueError(f"unknown drafter {kind!r}")

    def step(self, hidden, token_ids, seq_lens):
        if self.kind == "none":
            return
        torch = self.torch
        T = hidden.shape[0]
        if self.kind == "synthetic":
            with torch.no_grad():
                x = hidden.reshape(T, -1).to(self.device).float() @ self.fc
                for w in self.ws:
                    x = torch.tanh(x @ w)
                x.sum().item()  # synchronise (matters on GPU)
            return
        ex = self.ex
        tok = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(self.device)
        sl = torch.from_numpy(np.asarray(seq_lens, dtype=np.int64)).to(self.device)
        seq_ids = torch.repeat_interleave(torch.arange(len(sl), device=self.device), sl)
        logits = self.model(hidden.to(self.device), seq_ids)
        loss = torch.nn.functional.cross_entropy(
            logits.float(), ex.next_token_targets(tok, sl, self.vocab), ignore_index=-100)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        loss.item()


def synthetic_batches(rng, total_tokens, budget, vocab):
    """Packed batches of random sequences (16..256 tokens) adding up to >= total_tokens."""
    from draftfeed.packing import pack_sequences

    def seqs():
        made = 0
        while made < total_tokens:
            n = int(min(rng.integers(16, 257), budget))
            made += n
            yield rng.integers(0, vocab, size=n, dtype=np.int32)

    return pack_sequences(seqs(), token_budget=budget)


def calibrate(args):
    import torch
    torch.set_num_threads(args.torch_threads)
    d = Drafter(args.drafter, args.num_layers, args.hidden_size, args.flops_per_token,
                args.device, args.vocab, args.seed)
    rng = np.random.default_rng(args.seed)
    T = args.batch_tokens
    hidden = torch.randn(T, args.num_layers, args.hidden_size).to(torch.bfloat16)
    tokens = rng.integers(0, args.vocab, size=T, dtype=np.int32)
    seq_lens = np.array([T // 2, T - T // 2], dtype=np.int32)
    for _ in range(3):
        d.step(hidden, tokens, seq_lens)
    steps, compute_s, t0 = 0, 0.0, time.perf_counter()
    while steps < 3 or time.perf_counter() - t0 < args.calibrate_s:
        s0 = time.perf_counter()
        d.step(hidden, tokens, seq_lens)
        compute_s += time.perf_counter() - s0
        pad(s0, T, args.drafter_rate)
        steps += 1
    dt = time.perf_counter() - t0
    print(json.dumps({"drafter_tokens_per_s": steps * T / dt, "steps": steps,
                      "compute_tokens_per_s": steps * T / compute_s,
                      "step_ms": 1000 * dt / steps, "flops_per_token": d.flops_per_token,
                      "gflops_per_s": steps * T * d.flops_per_token / dt / 1e9,
                      "peak_rss_bytes": peak_rss_bytes()}), flush=True)
    return 0


def pad(s0, tokens, rate):
    if rate and rate > 0:
        left = s0 + tokens / rate - time.perf_counter()
        if left > 0:
            time.sleep(left)


def run(args):
    import draftfeed
    if args.drafter != "none":
        import torch
        torch.set_num_threads(args.torch_threads)
    targets = args.targets.split(",")
    layers = [int(x) for x in args.layers.split(",")]
    info = draftfeed.describe_target(targets[0])
    vocab = min(args.vocab, int(info["vocab_size"]))
    drafter = Drafter(args.drafter, len(layers), int(info["hidden_size"]), args.flops_per_token,
                      args.device, vocab, args.seed)
    rng = np.random.default_rng(args.seed)
    submitted = {"batches": 0, "tokens": 0}
    delivered = {"batches": 0, "tokens": 0}

    def counted(batches):
        for b in batches:
            submitted["batches"] += 1
            submitted["tokens"] += b.num_tokens
            yield b

    # Unordered: a drafter trains on whichever batch is ready (no head-of-line wait), and
    # the window grows with the number of targets so each has work from every trainer.
    prefetch = args.prefetch or max(8, 2 * len(targets))
    feed = draftfeed.Feed(targets=targets, layers=layers, prefetch=prefetch, ordered=False,
                          credits_per_target=args.credits_per_target)
    try:
        # Warm-up: connections, the feed's rate estimates, torch's first-call costs.
        for r in feed.map(counted(synthetic_batches(rng, args.warmup_tokens, args.batch_tokens,
                                                    vocab))):
            delivered["batches"] += 1
            delivered["tokens"] += r.num_tokens
            drafter.step(r.torch(), r.token_ids, r.seq_lens)
        if args.ready_file:
            open(args.ready_file, "w").close()
        if args.go_file:
            deadline = time.time() + 300
            while not os.path.exists(args.go_file):
                if time.time() > deadline:
                    raise RuntimeError("no go signal within 300 s")
                time.sleep(0.005)

        bytes0 = feed.stats()["bytes_received"]
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        forward_ms, target_tokens = {}, {}
        drafter_s, tokens, steps = 0.0, 0, 0
        queue = []
        stop = threading.Event()
        t0 = time.time()

        def sample():  # Feed.stats() takes the feed's lock: safe beside next()/submit()
            while True:
                queue.append((round(time.time() - t0, 3), feed.stats()["queue_depth"]))
                if stop.wait(args.sample_every_s):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for r in feed.map(counted(synthetic_batches(rng, args.tokens, args.batch_tokens, vocab))):
            delivered["batches"] += 1
            delivered["tokens"] += r.num_tokens
            tokens += r.num_tokens
            tm = r.timings
            forward_ms[r.target] = forward_ms.get(r.target, 0.0) + float(tm["forward_ms"])
            target_tokens[r.target] = target_tokens.get(r.target, 0) + r.num_tokens
            s0 = time.perf_counter()
            drafter.step(r.torch(), r.token_ids, r.seq_lens)
            pad(s0, r.num_tokens, args.drafter_rate)
            drafter_s += time.perf_counter() - s0
            steps += 1
        t1 = time.time()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        stop.set()
        sampler.join()
        queue.append((round(t1 - t0, 3), feed.stats()["queue_depth"]))
        stats = feed.stats()
    finally:
        feed.close()
    wall = t1 - t0
    print(json.dumps({
        "trainer": args.name, "start": t0, "end": t1, "wall_s": wall,
        "tokens": tokens, "steps": steps, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "drafter_s": drafter_s, "drafter_busy": drafter_s / wall if wall > 0 else 0.0,
        "drafter_tokens_per_s": tokens / drafter_s if drafter_s > 0 else None,
        "flops_per_token": drafter.flops_per_token,
        "bytes_received": stats["bytes_received"] - bytes0,
        "forward_ms_by_target": forward_ms, "tokens_by_target": target_tokens,
        "tokens_submitted": submitted["tokens"], "tokens_delivered": delivered["tokens"],
        "batches_submitted": submitted["batches"], "batches_delivered": delivered["batches"],
        "feed_tokens_delivered": stats["tokens_delivered"], "feed_failed": stats["failed"],
        "feed_resent": stats["resent"], "queue_depth": queue,
        "cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
        "peak_rss_bytes": peak_rss_bytes(),
    }), flush=True)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="trainer")
    p.add_argument("--targets", default="", help="comma-separated host:port")
    p.add_argument("--layers", default="1,2,3")
    p.add_argument("--tokens", type=int, default=20000, help="measured tokens")
    p.add_argument("--warmup-tokens", type=int, default=2000)
    p.add_argument("--batch-tokens", type=int, default=512, help="packing token budget")
    p.add_argument("--vocab", type=int, default=4096, help="token ids drawn from [0, vocab)")
    p.add_argument("--drafter", choices=["none", "synthetic", "dflash"], default="synthetic")
    p.add_argument("--flops-per-token", type=float, default=2e6)
    p.add_argument("--drafter-rate", type=float, default=0.0,
                   help="tokens/s cap of the drafter (emulated device speed); 0: none")
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--prefetch", type=int, default=0, help="0: max(8, 2 x targets)")
    p.add_argument("--credits-per-target", type=int, default=4)
    p.add_argument("--sample-every-s", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-file", default="")
    p.add_argument("--go-file", default="")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--calibrate-s", type=float, default=1.5)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=3)
    args = p.parse_args()
    return calibrate(args) if args.calibrate else run(args)


if __name__ == "__main__":
    sys.exit(main())
