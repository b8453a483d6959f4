#!/usr/bin/env python3
"""Load test on loopback: many trainer processes over a few CPU targets.

Phase "steady": --trainers trainer processes (default 32), each its own
draftfeed.Feed over all --targets tiny-random targets (default 2), feed batches
for --duration seconds (default 120). Phase "kill": the same again, and half
way through one target is killed with SIGKILL; the feeds must re-send what it
held to the other. Then one fresh target alone computes every delivered batch
(the reference).

Every batch has a global id; trainer r sends ids r, r + N, r + 2N, ... (all of
--batch-tokens tokens, in sequences of random lengths), so each trainer's
share is its delivered batches. Checked, per phase:
  - zero failed batches (no error from the feed, stats()["failed"] == 0);
  - every batch sent came back exactly once (each id once, across all
    trainers) with the tokens that were sent;
  - every batch is bit-identical to the single-target reference (sha256 of
    the bf16 bits, per batch id; the target's checksum is verified by the
    client as well);
  - each trainer's share is within +-15% (--share-tolerance) of equal;
  - the targets' resident memory: VmRSS sampled every 0.25 s from
    /proc/<pid>/status and VmHWM at the end, reported (peak).
Prints a summary table; exits 1 when a check fails.

    PYTHONPATH=build/python /usr/bin/python3 bench/load_test.py [--duration 120]
    PYTHONPATH=build/python /usr/bin/python3 bench/load_test.py --duration 20   # quick
"""

import argparse
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 4096  # tiny-random's vocabulary is larger; ids below it are valid
LAYERS = [0, 2, -1]


def batch_of(batch_id, tokens, seed):
    """Batch `batch_id`: the same tokens and lengths on every run."""
    rng = np.random.default_rng([seed, batch_id])
    lens = []
    left = tokens
    while left > 0:
        n = min(left, int(rng.integers(8, 129)))
        lens.append(n)
        left -= n
    return rng.integers(0, VOCAB, size=tokens, dtype=np.int32), np.asarray(lens, dtype=np.int32)


def digest(result):
    return hashlib.sha256(result.hidden_bits.tobytes()).hexdigest()


# ----------------------------------------------------------------------------
# Trainer process: `load_test.py --trainer ...`


def trainer_main(args):
    import draftfeed

    rank, world = args.rank, args.world
    sent = []
    deadline = None

    def batches():
        i = rank
        while time.time() < deadline:
            tokens, lens = batch_of(i, args.batch_tokens, args.seed)
            sent.append((i, tokens))
            yield tokens, lens
            i += world

    delivered = {}
    error = None
    stats = {}
    try:
        with draftfeed.Feed(targets=args.target_list.split(","), layers=LAYERS, prefetch=4,
                            credits_per_target=2, batch_timeout_s=30.0,
                            unavailable_timeout_s=60.0, client_name=f"load-{rank}",
                            reconnect_backoff_max_s=1.0) as feed:
            # Every trainer starts at the same moment (the driver writes it to
            # the go file once all are ready) and stops sending at the same
            # moment; what is in flight at the deadline is still collected.
            pathlib.Path(args.out + ".ready").touch()
            while not os.path.exists(args.go):
                time.sleep(0.01)
            start_at = float(open(args.go).read())
            deadline = start_at + args.duration
            while time.time() < start_at:
                time.sleep(0.001)
            for n, r in enumerate(feed.map(batches())):
                batch_id, tokens = sent[n]
                if not np.array_equal(r.token_ids, tokens):
                    raise AssertionError(f"batch {batch_id}: tokens differ from those sent")
                if batch_id in delivered:
                    raise AssertionError(f"batch {batch_id} delivered twice")
                delivered[batch_id] = digest(r)
            stats = feed.stats()
    except Exception as e:  # reported, and fails the phase
        error = f"{type(e).__name__}: {e}"
    json.dump({"rank": rank, "sent": [i for i, _ in sent], "delivered": delivered,
               "error": error, "stats": stats}, open(args.out, "w"))
    return 0


# ----------------------------------------------------------------------------
# Driver


class Target:
    def __init__(self, binary, threads):
        self.dir = tempfile.mkdtemp(prefix="draftfeed-load-")
        port_file = os.path.join(self.dir, "port")
        self.log = open(os.path.join(self.dir, "log"), "w+")
        self.proc = subprocess.Popen(
            [binary, "--model=tiny-random", "--listen=127.0.0.1:0", f"--port_file={port_file}",
             f"--threads={threads}"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"target did not start: {self.output()}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{int(open(port_file).read())}"
        self.rss_peak_kb = 0
        self.hwm_kb = 0

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def sample(self):
        """VmRSS now and VmHWM so far (kB), while the process lives."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        self.rss_peak_kb = max(self.rss_peak_kb, int(line.split()[1]))
                    elif line.startswith("VmHWM:"):
                        self.hwm_kb = max(self.hwm_kb, int(line.split()[1]))
        except (FileNotFoundError, ProcessLookupError):
            pass

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_phase(name, args, targets, kill_at=None):
    """Runs the trainers over `targets`; returns (results, notes)."""
    work = tempfile.mkdtemp(prefix=f"draftfeed-load-{name}-")
    outs = [os.path.join(work, f"trainer-{r}.json") for r in range(args.trainers)]
    go = os.path.join(work, "go")
    env = dict(os.environ)
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--trainer", "--rank", str(r), "--world", str(args.trainers),
         "--target-list", ",".join(t.address for t in targets), "--go", go,
         "--duration", str(args.duration), "--batch-tokens", str(args.batch_tokens),
         "--seed", str(args.seed), "--out", outs[r]],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        for r in range(args.trainers)]
    # Start together once every trainer has its feed open (imports and
    # connections take a while on a loaded machine).
    ready_by = time.time() + args.startup_s
    while not all(os.path.exists(o + ".ready") for o in outs):
        if time.time() > ready_by or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    start_at = time.time() + 0.5
    with open(go + ".tmp", "w") as f:
        f.write(repr(start_at))
    os.rename(go + ".tmp", go)
    stop = threading.Event()
    killed = []

    def sampler():
        while not stop.is_set():
            for t in targets:
                t.sample()
            if kill_at is not None and not killed and time.time() >= start_at + kill_at:
                targets[-1].sample()
                targets[-1].proc.send_signal(signal.SIGKILL)
                killed.append(time.time() - start_at)
            stop.wait(0.25)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    errs = []
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=args.duration + args.startup_s + 300)
        if p.returncode != 0:
            errs.append(f"trainer {r} exited {p.returncode}: {err[-2000:]}")
    stop.set()
    th.join()
    for t in targets:
        t.sample()
    results = [json.load(open(o)) for o in outs if os.path.exists(o)]
    return results, errs, killed


def reference_digests(args, ids):
    """Every batch in `ids` from one fresh target alone, one feed."""
    import draftfeed

    t = Target(args.binary, args.reference_threads)
    try:
        ids = sorted(ids)
        out = {}
        with draftfeed.Feed(targets=[t.address], layers=LAYERS, prefetch=8) as feed:
            for i, r in zip(ids, feed.map(batch_of(i, args.batch_tokens, args.seed)
                                          for i in ids)):
                out[i] = digest(r)
        return out
    finally:
        t.stop()


def check_phase(name, args, results, errs, reference, expect_resent):
    """The phase's figures and failed checks."""
    failures = list(errs)
    if len(results) != args.trainers:
        failures.append(f"{args.trainers - len(results)} trainers wrote no result")
    seen = {}
    shares = []
    failed = resent = dups = 0
    for res in results:
        if res["error"]:
            failures.append(f"trainer {res['rank']}: {res['error']}")
        delivered = {int(k): v for k, v in res["delivered"].items()}
        if sorted(delivered) != sorted(res["sent"]):
            missing = set(res["sent"]) - set(delivered)
            failures.append(f"trainer {res['rank']}: {len(missing)} batches sent, not delivered")
        for i, d in delivered.items():
            if i in seen:
                failures.append(f"batch {i} delivered to trainers {seen[i][0]} and {res['rank']}")
            seen[i] = (res["rank"], d)
        shares.append(len(delivered))
        st = res["stats"] or {}
        failed += st.get("failed", 0)
        resent += st.get("resent", 0)
        dups += st.get("duplicates_dropped", 0)
    if failed:
        failures.append(f"{failed} failed batches")
    mismatched = [i for i, (_, d) in seen.items() if reference.get(i) != d]
    if mismatched:
        failures.append(f"{len(mismatched)} batches differ from the single-target run "
                        f"(first: {sorted(mismatched)[:5]})")
    mean = sum(shares) / len(shares) if shares else 0
    worst = max((abs(s - mean) / mean for s in shares), default=0) if mean else 1
    if worst > args.share_tolerance:
        failures.append(f"a trainer's share is {worst:.1%} from equal "
                        f"(min {min(shares)}, max {max(shares)}, mean {mean:.1f})")
    if expect_resent and resent == 0:
        failures.append("no batch was re-sent after the kill (did the kill land mid-run?)")
    row = {"phase": name, "batches": len(seen), "tokens": len(seen) * args.batch_tokens,
           "tok_per_s": len(seen) * args.batch_tokens / args.duration, "failed": failed,
           "resent": resent, "duplicates_dropped": dups, "share_min": min(shares, default=0),
           "share_max": max(shares, default=0), "share_dev": worst,
           "mismatched": len(mismatched)}
    return row, failures


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load per phase")
    p.add_argument("--trainers", type=int, default=32)
    p.add_argument("--targets", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="engine threads per target")
    p.add_argument("--batch-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--share-tolerance", type=float, default=0.15)
    p.add_argument("--startup-s", type=float, default=120.0,
                   help="the longest wait for every trainer to be ready before the start")
    p.add_argument("--reference-threads", type=int, default=0,
                   help="engine threads of the reference target (0: all cores)")
    p.add_argument("--phases", default="steady,kill")
    p.add_argument("--build-dir", default=os.environ.get("DRAFTFEED_BUILD_DIR",
                                                         str(REPO / "build")))
    p.add_argument("--json", help="also write the summary here")
    # Trainer-process arguments (internal).
    p.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--go", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--target-list", help=argparse.SUPPRESS)
    args, _ = p.parse_known_args()
    if args.trainer:
        return trainer_main(args)
    args.binary = str(pathlib.Path(args.build_dir) / "bin" / "draftfeed-target")
    if not os.access(args.binary, os.X_OK):
        print(f"load_test: {args.binary} not found (--build-dir)", file=sys.stderr)
        return 2
    if args.targets < 2 and "kill" in args.phases:
        print("load_test: the kill phase needs --targets >= 2", file=sys.stderr)
        return 2

    rows, phase_results, failures = [], {}, {}
    for name in args.phases.split(","):
        targets = [Target(args.binary, args.threads) for _ in range(args.targets)]
        try:
            kill_at = args.duration / 2 if name == "kill" else None
            results, errs, killed = run_phase(name, args, targets, kill_at)
        finally:
            for t in targets:
                t.stop()
        phase_results[name] = (results, errs, targets, killed)
        print(f"{name}: {sum(len(r['delivered']) for r in results)} batches from "
              f"{len(results)} trainers" + (f", target killed at {killed[0]:.1f} s"
                                            if killed else ""), flush=True)

    ids = set()
    for results, _, _, _ in phase_results.values():
        for r in results:
            ids.update(int(k) for k in r["delivered"])
    t0 = time.time()
    reference = reference_digests(args, ids)
    print(f"reference: {len(reference)} batches from one target in {time.time() - t0:.0f} s",
          flush=True)

    for name, (results, errs, targets, killed) in phase_results.items():
        row, fails = check_phase(name, args, results, errs, reference, bool(killed))
        row["rss_peak_mib"] = [round(t.rss_peak_kb / 1024, 1) for t in targets]
        row["hwm_mib"] = [round(t.hwm_kb / 1024, 1) for t in targets]
        row["killed_at_s"] = round(killed[0], 1) if killed else None
        rows.append(row)
        failures[name] = fails

    print()
    print(f"{args.trainers} trainers, {args.targets} tiny-random CPU targets "
          f"(--threads={args.threads}), {args.duration:.0f} s per phase, "
          f"{args.batch_tokens}-token batches, layers {LAYERS}")
    head = ("phase", "batches", "tok/s", "failed", "resent", "dups", "share min..max",
            "share dev", "!= ref", "target RSS peak MiB (VmHWM)")
    print(" | ".join(head))
    for r in rows:
        rss = ", ".join(f"{a} ({b})" for a, b in zip(r["rss_peak_mib"], r["hwm_mib"]))
        kill = f" [kill -9 at {r['killed_at_s']} s]" if r["killed_at_s"] is not None else ""
        print(" | ".join([r["phase"] + kill, str(r["batches"]), f"{r['tok_per_s']:.0f}",
                          str(r["failed"]), str(r["resent"]), str(r["duplicates_dropped"]),
                          f"{r['share_min']}..{r['share_max']}", f"{r['share_dev']:.1%}",
                          str(r["mismatched"]), rss]))
    ok = True
    for name, fails in failures.items():
        for f in fails:
            ok = False
            print(f"FAIL {name}: {f}")
    print("load_test: " + ("every check passed" if ok else "FAILED"))
    if args.json:
        json.dump({"rows": rows, "failures": failures}, open(args.json, "w"), indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
