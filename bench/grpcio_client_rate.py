#!/usr/bin/env python3
"""How much of a target's engine rate the pure-Python client (pip grpcio + protobuf, no
compiled module) delivers to a trainer process, every batch's checksum verified.

Streams --batches back-to-back batches of --tokens tokens (sequences uniform in
[--min-len, --max-len], --capture layers: evenly spaced from layer 1, then the final norm, as
bench/bench_batches.h's SpacedLayers) after --warmup untimed ones, --repeats times, and prints
per window and as medians:

  delivered   tokens/s the feed handed to this process (first result to last of the window,
              plus the wait for the first), and the payload GB/s;
  engine      the target's own forward rate over the same batches: their tokens over the
              sum of the forward_ms each BatchDone reports (the engine alone, no transport);
  ratio       delivered / engine.

The target is started here (--target-bin, on --model / --device) or is one already serving
(--target host:port). Needs Python >= 3.9, numpy, grpcio and protobuf, and this repository's
client/python on the path (added below); no compiled draftfeed module, no Debian gRPC.

    python3 bench/grpcio_client_rate.py --target-bin .bundle/bin/draftfeed-target \\
        --model random:qwen3.6-27b --device cuda:0 --tokens 16384 --capture 5
    python3 bench/grpcio_client_rate.py --target 127.0.0.1:50051
    python3 bench/grpcio_client_rate.py --target-bin build/bin/draftfeed-target \\
        --model tiny-random --device cpu --tokens 2048 --min-len 64 --max-len 512   # smoke test
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "client" / "python"))
os.environ.setdefault("DRAFTFEED_TRANSPORT", "grpcio")

import numpy as np  # noqa: E402

import draftfeed  # noqa: E402


def mixed_lengths(tokens: int, lo: int, hi: int, rng) -> list:
    lens, left = [], tokens
    while left > 0:
        n = min(int(rng.integers(lo, hi + 1)), left)
        if 0 < left - n < lo:
            n = left  # no tiny tail
        lens.append(n)
        left -= n
    return lens


def spaced_layers(num_layers: int, k: int) -> list:
    k = max(1, k)
    span = num_layers - 3
    layers = []
    for i in range(k - 1):
        v = 1 + i * span // (k - 1) if span >= k - 1 else min(i, num_layers - 1)
        if not layers or layers[-1] != v:
            layers.append(v)
    return layers + [-1]


def start_target(args) -> tuple:
    d = tempfile.mkdtemp(prefix="grpcio-rate-")
    port_file = os.path.join(d, "port")
    log = open(os.path.join(d, "target.log"), "w+")
    cmd = [args.target_bin, f"--model={args.model}", f"--device={args.device}",
           "--listen=127.0.0.1:0", f"--port_file={port_file}",
           f"--max_batch_tokens={args.tokens}", *args.target_arg]
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + args.start_timeout_s
    while not os.path.exists(port_file) or not open(port_file).read().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            proc.kill()
            sys.exit(f"the target did not start:\n{log.read()[-4000:]}")
        time.sleep(0.1)
    return proc, f"127.0.0.1:{int(open(port_file).read())}", log


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="host:port of a target already serving")
    where.add_argument("--target-bin", help="draftfeed-target to start here")
    p.add_argument("--model", default="random:qwen3.6-27b")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--target-arg", action="append", default=[],
                   help="one more flag for the started target (repeatable)")
    p.add_argument("--start-timeout-s", type=float, default=900)
    p.add_argument("--tokens", type=int, default=16384, help="packed tokens per batch")
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--capture", type=int, default=5, help="captured layers")
    p.add_argument("--encoding", default="bf16", choices=["bf16", "fp8_e4m3"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batches", type=int, default=6, help="batches per timed window")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--credits", type=int, default=4)
    p.add_argument("--connections", type=int, default=1, help="streams to the target")
    p.add_argument("--copy-threads", type=int, default=0,
                   help="threads copying and hashing chunks (0: by cores)")
    p.add_argument("--transport", default="grpcio", choices=["grpcio", "grpc"],
                   help="grpc: the compiled client, where installed (for comparison)")
    p.add_argument("--min-ratio", type=float, default=0.0,
                   help="exit 1 when the median ratio is below this")
    args = p.parse_args()
    if args.transport == "grpc":
        os.environ.pop("DRAFTFEED_TRANSPORT", None)

    proc = log = None
    address = args.target
    if args.target_bin:
        proc, address, log = start_target(args)
    try:
        return run(args, address)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def run(args, address: str) -> int:
    import grpc
    import google.protobuf

    info = draftfeed.describe_target(address, transport=args.transport)
    layers = spaced_layers(info["num_layers"], args.capture)
    rng = np.random.default_rng(1)
    total = args.warmup + args.batches * args.repeats
    batches = []
    for _ in range(total):
        lens = mixed_lengths(args.tokens, min(args.min_len, args.tokens),
                             min(args.max_len, args.tokens), rng)
        batches.append((rng.integers(0, info["vocab_size"], size=args.tokens, dtype=np.int32),
                        np.array(lens, dtype=np.int32)))
    advanced = {"connections_per_target": args.connections}
    if args.transport == "grpcio" and args.copy_threads:
        advanced["copy_threads"] = args.copy_threads
    feed = draftfeed.Feed(targets=[address], layers=layers, prefetch=args.prefetch,
                          credits_per_target=args.credits, encoding=args.encoding,
                          fp8_raw=args.encoding == "fp8_e4m3", verify_checksum=True,
                          transport=args.transport, prefetch_bytes=1 << 36, **advanced)
    print(f"client {feed.client} (Python {platform.python_version()}, grpcio {grpc.__version__}, "
          f"protobuf {google.protobuf.__version__}, numpy {np.__version__}, "
          f"{os.cpu_count()} cores)")
    print(f"target {address}: {info['model_id']} on {','.join(info['devices'])}, "
          f"{info['num_layers']} layers, hidden {info['hidden_size']}; capture {layers} "
          f"({args.encoding}), {args.tokens} tokens a batch, {args.warmup} warm-up + "
          f"{args.repeats} x {args.batches} batches")
    rates, engines, ratios = [], [], []
    with feed:
        it = feed.map(batches)
        for _ in range(args.warmup):
            next(it)
        for w in range(args.repeats):
            t0 = time.perf_counter()
            tokens = forward_s = payload = 0
            for _ in range(args.batches):
                r = next(it)
                tokens += r.num_tokens
                forward_s += r.timings["forward_ms"] / 1000.0
                payload += r.num_tokens * r.bytes_per_token
            dt = time.perf_counter() - t0
            rate, engine = tokens / dt, tokens / forward_s if forward_s > 0 else float("nan")
            rates.append(rate)
            engines.append(engine)
            ratios.append(rate / engine)
            print(f"window {w + 1}: delivered {rate:,.0f} tokens/s ({payload / dt / 1e9:.2f} "
                  f"GB/s), engine {engine:,.0f} tokens/s, ratio {rate / engine:.3f}", flush=True)
        stats = feed.stats()
    verified = stats["delivered"]
    if stats["failed"]:
        print(f"FAILED: {stats['failed']} batches failed (checksum or target errors)")
        return 1
    med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
    print(f"median: delivered {med(rates):,.0f} tokens/s, engine {med(engines):,.0f} tokens/s, "
          f"ratio {med(ratios):.3f} of engine only; {verified} batches, every checksum "
          f"verified, {stats['resent']} re-sent, {stats['buffer_allocations']} buffer "
          f"allocations")
    if med(ratios) < args.min_ratio:
        print(f"ratio below --min-ratio {args.min_ratio}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
