#!/usr/bin/env python3
"""One trainer process of the split benchmark (bench/splits.py starts these).

Opens its own draftfeed.Feed over every target of the split (the feed balances), sends packed
batches of synthetic tokens (draftfeed.packing.pack_sequences) and runs one drafter step per
batch:

- `none`: no drafter work (used to measure a target's rate alone),
- `synthetic`: a matmul chain costing about --flops-per-token FLOPs per token (forward only),
- `dflash`: the small DFlash-style drafter of client/python/examples/train_drafter.py
  (fc over the K concatenated layers, one transformer block, loss, backward, AdamW step),
- `dflash-full`: a DFlash-style drafter at the target's width, the GPU modes' realistic load:
  fc [K*H -> H], --drafter-layers Qwen-style decoder layers (GQA attention inside 16-token
  draft blocks, SwiGLU MLP of ~3.4 H), a norm and an lm head over --draft-vocab ids, bf16
  autocast over fp32 weights, cross-entropy, backward, AdamW step.

Transport (--transport, GPU modes): with `nccl` the feed hands each batch over as a CUDA tensor
on --cuda-device (used as is, no host copy); with `grpc` the host buffer goes to the drafter's
device with a non-blocking copy, timed as part of the step (the trainer waits for it before the
step can run); `auto` takes whatever each result holds. Without --transport the Feed is opened
as before (gRPC into host memory), so older client builds still run the CPU mode.

`--drafter-rate R` (optional) pads every step to at least tokens/R seconds, as the targets'
--throttle_tokens_per_s does, to emulate a drafter device of a given speed on a small CPU box.

Protocol with the orchestrator: warm-up (--warmup-tokens), then create --ready-file, wait for
--go-file, run --tokens measured tokens, print ONE JSON line on stdout (the report).

`--calibrate` instead times drafter steps on random hidden states of the target's shape (no
feed; only --hidden-size/--num-layers needed) and prints {"drafter_tokens_per_s": ...}, with
the host-to-device copy of one batch timed separately (`h2d_ms`; 0 on the CPU).
"""

import argparse
import contextlib
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


def attention_heads(hidden_size):
    """(head_dim, heads, kv_heads) of the `dflash-full` drafter at width H: 128-wide heads and
    about one KV head per 5 query heads (Qwen3.6-27B's 40 / 8), rounded down to a divisor of
    the head count so that K and V repeat evenly: 16 heads at the 35B-A3B's 2,048 get 2."""
    head_dim = min(128, hidden_size)
    heads = max(1, hidden_size // head_dim)
    kv_heads = max(1, heads // 5)
    while heads % kv_heads:
        kv_heads -= 1
    return head_dim, heads, kv_heads


def full_drafter(num_layers, hidden_size, draft_vocab, n_layers, block=16):
    """The `dflash-full` model: a DFlash-style drafter as wide as the target (see the module
    docstring). Attention runs inside fixed 16-token blocks, the cost shape of DFlash's draft
    blocks; sequence boundaries are not masked (the bench trains on random tokens, so only the
    cost has to be right, not what is learnt)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    RMSNorm = load_example_drafter().RMSNorm  # torch.nn.RMSNorm is newer than CI's torch

    def attention(q, k, v):
        if hasattr(F, "scaled_dot_product_attention"):
            return F.scaled_dot_product_attention(q, k, v)
        return (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1) @ v

    H = hidden_size
    head_dim, heads, kv_heads = attention_heads(H)
    inter = 256 * max(1, round(3.4 * H / 256))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = RMSNorm(H), RMSNorm(H)
            self.q = nn.Linear(H, heads * head_dim, bias=False)
            self.kv = nn.Linear(H, 2 * kv_heads * head_dim, bias=False)
            self.o = nn.Linear(heads * head_dim, H, bias=False)
            self.gate_up = nn.Linear(H, 2 * inter, bias=False)
            self.down = nn.Linear(inter, H, bias=False)

        def forward(self, x):  # x: [blocks, block, H]
            B, S, _ = x.shape
            h = self.norm1(x)
            q = self.q(h).view(B, S, heads, head_dim).transpose(1, 2)
            k, v = self.kv(h).view(B, S, 2, kv_heads, head_dim).unbind(2)
            k = k.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
            v = v.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
            a = attention(q, k, v)  # bidirectional inside a draft block
            x = x + self.o(a.transpose(1, 2).reshape(B, S, heads * head_dim))
            g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(g) * u)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(num_layers * H, H, bias=False)
            self.layers = nn.ModuleList(Layer() for _ in range(n_layers))
            self.norm = RMSNorm(H)
            self.lm_head = nn.Linear(H, draft_vocab, bias=False)

        def forward(self, hidden):  # [T, K, H] -> logits [T, draft_vocab]
            T = hidden.shape[0]
            x = self.fc(hidden.reshape(T, -1))
            pad = -T % block
            x = F.pad(x, (0, 0, 0, pad)).view(-1, block, H)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x.reshape(-1, H)[:T]))

    return Model()


class Drafter:
    """A drafter step: `step(hidden [T,K,H] bf16 torch, token_ids int32 np, seq_lens int32 np)`."""

    def __init__(self, kind, num_layers, hidden_size, flops_per_token, device, vocab, seed,
                 drafter_layers=1, draft_vocab=32768):
        self.kind = kind
        self.flops_per_token = 0.0
        if kind == "none":
            return
        import torch
        torch.manual_seed(seed)
        self.torch = torch
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
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
        elif kind == "dflash-full":
            self.vocab = min(vocab, draft_vocab)
            # Made on the device where torch can (2.x): 2B fp32 weights initialised on the
            # host would take tens of seconds per trainer.
            where = self.device if hasattr(self.device, "__enter__") else contextlib.nullcontext()
            with where:
                self.model = full_drafter(num_layers, hidden_size, self.vocab, drafter_layers)
            self.model.to(self.device)
            extra = {"fused": True} if self.device.type == "cuda" else {}
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.0,
                                         **extra)
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
        if self.kind == "dflash-full":
            tok = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(self.device)
            sl = torch.from_numpy(np.asarray(seq_lens, dtype=np.int64)).to(self.device)
            labels = next_token_labels(torch, tok, sl, self.vocab)
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                logits = self.model(hidden)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            loss.item()  # synchronise: the step's time is its GPU time
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


def next_token_labels(torch, token_ids, seq_lens, vocab):
    """labels[t] = token_ids[t + 1] inside a sequence; -100 at sequence ends and outside the
    draft vocabulary (as the example drafter's next_token_targets)."""
    labels = torch.full_like(token_ids, -100)
    labels[:-1] = token_ids[1:]
    labels[torch.cumsum(seq_lens, 0) - 1] = -100
    labels[labels >= vocab] = -100
    return labels


def to_drafter(result, transport, device, device_side):
    """The batch's hidden states as a bf16 [T, K, H] tensor on the drafter's device.

    nccl: the feed already put them there (`result.hidden` is a CUDA tensor): used as is.
    grpc: the host buffer (DLPack, no copy) goes over with a non-blocking copy.
    auto: whichever each result holds: `result.device` (-1: host memory) says so; a client
    without it is probed once per target (cached in `device_side`), since `.hidden` of a host
    result is a float32 copy.
    """
    import torch
    on_device = transport == "nccl"
    if transport == "auto":
        held = getattr(result, "device", None)
        if held is not None:
            on_device = held >= 0
        else:
            on_device = device_side.get(result.target)
            if on_device is None:
                on_device = device_side[result.target] = isinstance(result.hidden, torch.Tensor)
    if on_device:
        h = result.hidden
        if not isinstance(h, torch.Tensor) or h.device != device:
            raise RuntimeError(f"transport {transport}: expected the hidden states as a tensor "
                               f"on {device}, got {type(h).__name__} on "
                               f"{getattr(h, 'device', 'host')}")
        return h
    h = result.torch()
    return h if device.type == "cpu" else h.to(device, non_blocking=True)


def open_feed(draftfeed, targets, layers, prefetch, prefetch_bytes, credits, transport,
              cuda_device):
    kwargs = dict(targets=targets, layers=layers, prefetch=prefetch,
                  prefetch_bytes=prefetch_bytes, ordered=False, credits_per_target=credits)
    if transport:
        import inspect
        if "transport" not in inspect.signature(draftfeed.Feed.__init__).parameters:
            if transport == "grpc":  # what a Feed without the keyword does anyway
                return draftfeed.Feed(**kwargs)
            raise SystemExit(f"split_trainer: --transport {transport} needs a draftfeed client "
                             f"whose Feed takes transport=/cuda_device= (this one, "
                             f"{draftfeed.__file__}, does not); rebuild the Python package")
        kwargs.update(transport=transport, cuda_device=cuda_device)
    return draftfeed.Feed(**kwargs)


def synthetic_batches(rng, total_tokens, budget, vocab, max_len=256):
    """Packed batches of random sequences (16..max_len tokens) adding up to >= total_tokens."""
    from draftfeed.packing import pack_sequences

    def seqs():
        made = 0
        while made < total_tokens:
            n = int(min(rng.integers(16, max(16, max_len) + 1), budget))
            made += n
            yield rng.integers(0, vocab, size=n, dtype=np.int32)

    return pack_sequences(seqs(), token_budget=budget)


def cuda_peak_bytes(torch_mod, device):
    if torch_mod is not None and device.type == "cuda":
        return int(torch_mod.cuda.max_memory_allocated(device))
    return None


def calibrate(args):
    import torch
    torch.set_num_threads(args.torch_threads)
    d = Drafter(args.drafter, args.num_layers, args.hidden_size, args.flops_per_token,
                args.device, args.vocab, args.seed, args.drafter_layers, args.draft_vocab)
    dev = torch.device(args.device)
    rng = np.random.default_rng(args.seed)
    T = args.batch_tokens
    # Made where the drafter runs: a [49152, 5, 5120] batch is 2.5 GB, too slow to randn on
    # the host.
    hidden = torch.randn(T, args.num_layers, args.hidden_size, device=dev).to(torch.bfloat16)
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
    # What gRPC adds to every step on a GPU: the batch's copy from (pageable) host memory,
    # done in the trainer's thread before the step can start.
    h2d_ms = 0.0
    if dev.type == "cuda":
        host = torch.zeros(T, args.num_layers, args.hidden_size, dtype=torch.bfloat16)
        host.to(dev, non_blocking=True)
        torch.cuda.synchronize(dev)
        reps, c0 = 3, time.perf_counter()
        for _ in range(reps):
            host.to(dev, non_blocking=True)
        torch.cuda.synchronize(dev)
        h2d_ms = 1000 * (time.perf_counter() - c0) / reps
    print(json.dumps({"drafter_tokens_per_s": steps * T / dt, "steps": steps,
                      "compute_tokens_per_s": steps * T / compute_s,
                      "step_ms": 1000 * dt / steps, "h2d_ms": h2d_ms,
                      "flops_per_token": d.flops_per_token,
                      "gflops_per_s": steps * T * d.flops_per_token / dt / 1e9,
                      "peak_rss_bytes": peak_rss_bytes(),
                      "cuda_peak_allocated_bytes": cuda_peak_bytes(torch, dev)}), flush=True)
    return 0


def pad(s0, tokens, rate):
    if rate and rate > 0:
        left = s0 + tokens / rate - time.perf_counter()
        if left > 0:
            time.sleep(left)


def run(args):
    import draftfeed
    torch = None
    if args.drafter != "none":
        import torch
        torch.set_num_threads(args.torch_threads)
    targets = args.targets.split(",")
    layers = [int(x) for x in args.layers.split(",")]
    info = draftfeed.describe_target(targets[0])
    vocab = min(args.vocab, int(info["vocab_size"]))
    drafter = Drafter(args.drafter, len(layers), int(info["hidden_size"]), args.flops_per_token,
                      args.device, vocab, args.seed, args.drafter_layers, args.draft_vocab)
    device = torch.device(args.device) if torch is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    rng = np.random.default_rng(args.seed)
    submitted = {"batches": 0, "tokens": 0}
    delivered = {"batches": 0, "tokens": 0}
    device_side = {}

    def counted(batches):
        for b in batches:
            submitted["batches"] += 1
            submitted["tokens"] += b.num_tokens
            yield b

    def hidden_of(r):
        if drafter.kind == "none":  # a receiver only: the link's rate, not a copy's
            return None
        return to_drafter(r, args.transport or "grpc", device, device_side)

    # Unordered: a drafter trains on whichever batch is ready (no head-of-line wait), and
    # the window grows with the number of targets so each has work from every trainer.
    prefetch = args.prefetch or max(8, 2 * len(targets))
    # The byte bound must hold the window: the default 1 GiB would keep one 2.5 GB batch
    # (49,152 tokens x 5 x 5120 bf16) in flight and idle the target during every step.
    batch_bytes = args.batch_tokens * len(layers) * int(info["hidden_size"]) * 2
    prefetch_bytes = max(1 << 30, prefetch * batch_bytes)
    feed = open_feed(draftfeed, targets, layers, prefetch, prefetch_bytes,
                     args.credits_per_target, args.transport, args.cuda_device)
    try:
        # Warm-up: connections, the feed's rate estimates, torch's first-call costs.
        for r in feed.map(counted(synthetic_batches(rng, args.warmup_tokens, args.batch_tokens,
                                                    vocab, args.max_seq_len))):
            delivered["batches"] += 1
            delivered["tokens"] += r.num_tokens
            drafter.step(hidden_of(r), r.token_ids, r.seq_lens)
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
        forward_ms, send_ms, target_tokens = {}, {}, {}
        drafter_s, copy_s, tokens, steps = 0.0, 0.0, 0, 0
        queue, deliveries = [], []
        stop = threading.Event()
        t0 = time.time()

        def sample():  # Feed.stats() takes the feed's lock: safe beside next()/submit()
            while True:
                queue.append((round(time.time() - t0, 3), feed.stats()["queue_depth"]))
                if stop.wait(args.sample_every_s):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for r in feed.map(counted(synthetic_batches(rng, args.tokens, args.batch_tokens, vocab,
                                                    args.max_seq_len))):
            deliveries.append((time.time(), r.num_tokens))
            delivered["batches"] += 1
            delivered["tokens"] += r.num_tokens
            tokens += r.num_tokens
            tm = r.timings
            forward_ms[r.target] = forward_ms.get(r.target, 0.0) + float(tm["forward_ms"])
            send_ms[r.target] = send_ms.get(r.target, 0.0) + float(tm["send_ms"])
            target_tokens[r.target] = target_tokens.get(r.target, 0) + r.num_tokens
            s0 = time.perf_counter()
            h = hidden_of(r)
            copy_s += time.perf_counter() - s0  # grpc: pageable host -> GPU, synchronous
            drafter.step(h, r.token_ids, r.seq_lens)
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
        "copy_s": copy_s,
        "drafter_tokens_per_s": tokens / drafter_s if drafter_s > 0 else None,
        "flops_per_token": drafter.flops_per_token,
        "bytes_received": stats["bytes_received"] - bytes0,
        "forward_ms_by_target": forward_ms, "send_ms_by_target": send_ms,
        "tokens_by_target": target_tokens, "deliveries": deliveries,
        "tokens_submitted": submitted["tokens"], "tokens_delivered": delivered["tokens"],
        "batches_submitted": submitted["batches"], "batches_delivered": delivered["batches"],
        "feed_tokens_delivered": stats["tokens_delivered"], "feed_failed": stats["failed"],
        "feed_resent": stats["resent"], "queue_depth": queue,
        "cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
        "peak_rss_bytes": peak_rss_bytes(),
        "cuda_peak_allocated_bytes": cuda_peak_bytes(torch, device) if device else None,
        "transport": args.transport or "grpc",
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
    p.add_argument("--drafter", choices=["none", "synthetic", "dflash", "dflash-full"],
                   default="synthetic")
    p.add_argument("--drafter-layers", type=int, default=1, help="dflash-full: decoder layers")
    p.add_argument("--draft-vocab", type=int, default=32768, help="dflash-full: lm head size")
    p.add_argument("--max-seq-len", type=int, default=256,
                   help="synthetic sequences are 16..this many tokens")
    p.add_argument("--transport", default="", choices=["", "grpc", "nccl", "auto"],
                   help="passed to draftfeed.Feed (empty: the Feed's default, no keyword)")
    p.add_argument("--cuda-device", type=int, default=0,
                   help="with --transport: the GPU the feed delivers to (the drafter's)")
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
