#!/usr/bin/env python3
"""Balancing benchmark: does one feed over several targets, one of them slow,
deliver the sum of the targets' rates?

Starts N tiny-random targets on loopback, each capped with
--throttle_tokens_per_s (so the 2-core CI machine's CPU is not what is
measured), one of them at a fraction of the others' rate. Measures each
target's rate alone through a feed, then all of them behind one feed, and
prints the ratio combined / sum-of-alone (goal >= 0.90), median of --repeats.

    PYTHONPATH=build/python /usr/bin/python3 bench/feed_balance.py
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import draftfeed

REPO = pathlib.Path(__file__).resolve().parents[1]


def start_target(binary, rate):
    d = tempfile.mkdtemp(prefix="draftfeed-bench-")
    port_file = os.path.join(d, "port")
    proc = subprocess.Popen([binary, "--model=tiny-random", "--listen=127.0.0.1:0",
                             f"--port_file={port_file}", "--threads=1",
                             f"--throttle_tokens_per_s={rate}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        if os.path.exists(port_file):
            return proc, f"127.0.0.1:{int(open(port_file).read())}"
        time.sleep(0.05)
    raise RuntimeError("target did not start")


def batches(n, tokens, seed):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield rng.integers(0, 4096, size=tokens, dtype=np.int32), [tokens]


def measure(addresses, n, tokens, seed):
    with draftfeed.Feed(targets=addresses, layers=[-1], prefetch=4 * len(addresses),
                        credits_per_target=3) as feed:
        list(feed.map(batches(2 * len(addresses), tokens, seed)))  # warm-up
        t0 = time.perf_counter()
        got = sum(r.num_tokens for r in feed.map(batches(n, tokens, seed + 1)))
        dt = time.perf_counter() - t0
        per = {t["address"]: t["delivered_batches"] for t in feed.stats()["targets"]}
    return got / dt, per


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--binary", default=str(REPO / "build" / "bin" / "draftfeed-target"))
    p.add_argument("--targets", type=int, default=3)
    p.add_argument("--rate", type=float, default=3000, help="tokens/s cap of a normal target")
    p.add_argument("--slow-factor", type=float, default=0.25, help="slow target's share of --rate")
    p.add_argument("--tokens", type=int, default=256, help="tokens per batch")
    p.add_argument("--seconds", type=float, default=4.0, help="target length of each measurement")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    rates = [args.rate] * (args.targets - 1) + [args.rate * args.slow_factor]
    procs = []
    try:
        addrs = []
        for r in rates:
            proc, addr = start_target(args.binary, r)
            procs.append(proc)
            addrs.append(addr)
        ratios = []
        for rep in range(args.repeats):
            alone = []
            for a, r in zip(addrs, rates):
                n = max(4, int(r * args.seconds / args.tokens))
                rate, _ = measure([a], n, args.tokens, seed=rep)
                alone.append(rate)
            n = max(4, int(sum(rates) * args.seconds / args.tokens))
            together, per = measure(addrs, n, args.tokens, seed=100 + rep)
            ratio = together / sum(alone)
            ratios.append(ratio)
            print(f"repeat {rep}: alone " + ", ".join(f"{x:,.0f}" for x in alone) +
                  f" tok/s (sum {sum(alone):,.0f}); together {together:,.0f} tok/s; "
                  f"ratio {ratio:.3f}; batches per target {list(per.values())}", flush=True)
        med = statistics.median(ratios)
        print(f"feed_balance: {args.targets} targets, one at {args.slow_factor:.0%} speed: "
              f"combined / sum of alone = {med:.3f} (median of {args.repeats}; goal >= 0.90)")
        return 0 if med >= 0.9 else 1
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
