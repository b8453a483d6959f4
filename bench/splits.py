#!/usr/bin/env python3
"""Split benchmark: given N devices, how many should run targets (T) and how many drafter
trainers (D), T + D = N?  (docs: /work/shared/design/ARCHITECTURE.md section 6, issue 7.)

For every split T-D it starts T draftfeed-target processes and D trainer processes
(bench/split_trainer.py, each with its own draftfeed.Feed over all T targets), runs a warm-up,
then a fixed number of tokens, and reports end-to-end tokens/s, target and drafter utilisation,
queue depth over time, transfer GB/s and per-process peak memory. An advisor measures one
target's rate and one drafter's rate first and predicts every split as
min(T * target_rate, D * drafter_rate, link_rate), naming the best split and its bottleneck.

    PYTHONPATH=build/python /usr/bin/python3 bench/splits.py --gpus 8 --splits 5-3,4-4 \\
        --model tiny-random --device cpu --target-rate 3000 --out bench/results/splits-cpu

Only --device cpu runs now: each "GPU" is emulated by a process (targets capped with
--throttle_tokens_per_s=R, drafters optionally capped with --drafter-rate). The GPU modes
(--device cuda: one GPU shared, 2 GPUs, 8 GPUs) are planned and refused for now.

Outputs: a table on the terminal, DIR/splits.json (config, advisor, per-split results,
invariants), DIR/splits.png (tokens/s per split, measured vs predicted; queue depth over time).
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAINER = pathlib.Path(__file__).resolve().parent / "split_trainer.py"


# ---------------------------------------------------------------------------- processes

class Target:
    def __init__(self, binary, model, device, rate, workdir, index):
        self.dir = tempfile.mkdtemp(prefix=f"target{index}-", dir=workdir)
        port_file = os.path.join(self.dir, "port")
        self.log = open(os.path.join(self.dir, "log"), "w+")
        cmd = [binary, f"--model={model}", "--listen=127.0.0.1:0", f"--port_file={port_file}",
               "--threads=1", f"--device={device}"]
        if rate > 0:
            cmd.append(f"--throttle_tokens_per_s={rate}")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if self.proc.poll() is not None:
                raise RuntimeError(f"target exited: {self.output()}")
            if time.time() > deadline:
                raise RuntimeError("target did not start within 60 s")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{int(open(port_file).read())}"

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def peak_rss_bytes(self):
        """VmHWM (peak resident set) of the running process; None if unavailable."""
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def cpu_seconds(pid):
    """utime + stime of a process (all threads) from /proc; 0 if it is gone."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def trainer_cmd(args, name, targets, tokens, warmup, drafter, seed, extra=()):
    return [sys.executable, str(TRAINER), f"--name={name}", f"--targets={','.join(targets)}",
            f"--layers={args.layers}", f"--tokens={tokens}", f"--warmup-tokens={warmup}",
            f"--batch-tokens={args.batch_tokens}", f"--drafter={drafter}",
            f"--flops-per-token={args.drafter_flops_per_token}",
            f"--drafter-rate={args.drafter_rate if drafter != 'none' else 0}",
            f"--device={args.device}", f"--seed={seed}", *extra]


def last_json_line(text, what):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{what} printed no JSON report:\n{text[-3000:]}")


def run_trainers(cmds, workdir, timeout_s, target_pids=()):
    """Starts the trainers, waits until all warmed up, releases them together, returns their
    reports and the CPU seconds the targets used meanwhile."""
    go = os.path.join(workdir, "go")
    procs = []
    for i, cmd in enumerate(cmds):
        ready = os.path.join(workdir, f"ready{i}")
        err = open(os.path.join(workdir, f"trainer{i}.err"), "w+")
        procs.append((subprocess.Popen(cmd + [f"--ready-file={ready}", f"--go-file={go}"],
                                       stdout=subprocess.PIPE, stderr=err, text=True), ready, err))
    try:
        deadline = time.time() + timeout_s
        while not all(os.path.exists(r) for _, r, _ in procs):
            for p, _, err in procs:
                if p.poll() is not None:
                    err.seek(0)
                    raise RuntimeError(f"trainer exited {p.returncode} in warm-up:\n"
                                       f"{err.read()[-3000:]}")
            if time.time() > deadline:
                raise RuntimeError("trainers did not finish warm-up in time")
            time.sleep(0.02)
        cpu0 = sum(cpu_seconds(p) for p in target_pids)
        open(go, "w").close()
        reports = []
        for p, _, err in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
            if p.returncode != 0:
                err.seek(0)
                raise RuntimeError(f"trainer exited {p.returncode}:\n{err.read()[-3000:]}")
            reports.append(last_json_line(out, "trainer"))
        return reports, sum(cpu_seconds(p) for p in target_pids) - cpu0
    finally:
        for p, _, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()


# ---------------------------------------------------------------------------- advisor

def calibrate(args, workdir):
    """One target alone (trivial drafter) and one drafter alone (timed steps on random hidden
    states of the right shape)."""
    d = tempfile.mkdtemp(prefix="calibrate-", dir=workdir)
    t = Target(args.binary, args.model, args.device, args.target_rate, d, 0)
    try:
        info_cmd = [sys.executable, "-c",
                    "import json, sys, draftfeed; print(json.dumps(draftfeed.describe_target(sys.argv[1])))",
                    t.address]
        info = json.loads(subprocess.run(info_cmd, check=True, capture_output=True,
                                         text=True).stdout)
        tokens = args.calibrate_tokens or max(1000, int(args.target_rate * 1.0)
                                              if args.target_rate > 0 else 20000)
        reps, target_cpu = run_trainers([trainer_cmd(args, "calibrate-target", [t.address],
                                                     tokens, args.batch_tokens, "none", 999)],
                                        d, 300, [t.proc.pid])
        rep = reps[0]
    finally:
        t.stop()
    k = len(args.layers.split(","))
    out = subprocess.run(trainer_cmd(args, "calibrate-drafter", [], 0, 0, args.drafter, 998,
                                     ["--calibrate", f"--hidden-size={info['hidden_size']}",
                                      f"--num-layers={k}", f"--vocab={min(4096, info['vocab_size'])}",
                                      f"--calibrate-s={args.calibrate_s}"]),
                         check=True, capture_output=True, text=True).stdout
    drep = last_json_line(out, "drafter calibration")
    return {
        "target_tokens_per_s": rep["tokens_per_s"],
        "target_calibration_tokens": rep["tokens"],
        "drafter_tokens_per_s": drep["drafter_tokens_per_s"],
        "drafter_compute_tokens_per_s": drep["compute_tokens_per_s"],
        "drafter_step_ms": drep["step_ms"],
        "drafter_flops_per_token": drep["flops_per_token"],
        "drafter_gflops_per_s": drep["gflops_per_s"],
        # Loopback: no network link between targets and trainers to measure.
        "link_tokens_per_s": None, "link_note": "skipped: loopback",
        # Host CPU seconds per token of the feed itself (target process + trainer client, no
        # drafter work): in CPU mode all emulated devices share this host's cores.
        "pipeline_cpu_s_per_token": (target_cpu + rep["cpu_s"]) / max(1, rep["tokens"]),
        "model": info,
    }


def predict(cal, t, d, cpu_mode):
    """Predicted tokens/s of split T-D and its bottleneck."""
    limits = {"target": t * cal["target_tokens_per_s"], "drafter": d * cal["drafter_tokens_per_s"]}
    if cal["link_tokens_per_s"]:
        limits["link"] = cal["link_tokens_per_s"]
    if cpu_mode:
        # Every emulated device is a process on this host: per token the host spends the
        # feed's CPU time (target forward + gRPC + client) plus the drafter's compute, so
        # cores / (that sum) caps any split. Not a term of the GPU modes.
        per_token = cal["pipeline_cpu_s_per_token"] + 1.0 / cal["drafter_compute_tokens_per_s"]
        limits["host-cpu"] = (os.cpu_count() or 1) / per_token
    bottleneck = min(limits, key=limits.get)
    return limits[bottleneck], bottleneck, limits


# ---------------------------------------------------------------------------- one split

def run_split(args, t_count, d_count, workdir):
    d = tempfile.mkdtemp(prefix=f"split{t_count}-{d_count}-", dir=workdir)
    targets = []
    try:
        for i in range(t_count):
            targets.append(Target(args.binary, args.model, args.device, args.target_rate, d, i))
        addrs = [t.address for t in targets]
        per = -(-args.tokens_per_split // d_count)
        warm = -(-args.warmup_tokens // d_count)
        cmds = [trainer_cmd(args, f"trainer{j}", addrs, per, warm, args.drafter, 100 * j + 7)
                for j in range(d_count)]
        reports, target_cpu = run_trainers(cmds, d, args.split_timeout_s,
                                           [t.proc.pid for t in targets])
        target_rss = {t.address: t.peak_rss_bytes() for t in targets}
    finally:
        for t in targets:
            t.stop()
    start = min(r["start"] for r in reports)
    end = max(r["end"] for r in reports)
    wall = end - start
    tokens = sum(r["tokens"] for r in reports)
    fwd = {a: sum(r["forward_ms_by_target"].get(a, 0.0) for r in reports) / 1000.0 for a in addrs}
    ttok = {a: sum(r["tokens_by_target"].get(a, 0) for r in reports) for a in addrs}
    sub = sum(r["tokens_submitted"] for r in reports)
    dlv = sum(r["tokens_delivered"] for r in reports)
    return {
        "split": f"{t_count}-{d_count}", "targets": t_count, "trainers": d_count,
        "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
        "sum_trainer_tokens_per_s": sum(r["tokens_per_s"] for r in reports),
        "target_utilisation": {a: fwd[a] / wall for a in addrs},
        "target_utilisation_mean": sum(fwd.values()) / wall / t_count,
        "tokens_by_target": ttok,
        "drafter_utilisation": {r["trainer"]: r["drafter_busy"] for r in reports},
        "drafter_utilisation_mean": sum(r["drafter_busy"] for r in reports) / d_count,
        "transfer_GB_per_s": sum(r["bytes_received"] for r in reports) / wall / 1e9,
        "bytes_received": sum(r["bytes_received"] for r in reports),
        "queue_depth": {r["trainer"]: [[round(r["start"] - start + ts, 3), q]
                                       for ts, q in r["queue_depth"]] for r in reports},
        "peak_memory_bytes": {**{f"target {a}": v for a, v in target_rss.items()},
                              **{r["trainer"]: r["peak_rss_bytes"] for r in reports}},
        "peak_memory_kind": "ru_maxrss / VmHWM (host RSS)",
        "host_cpu_utilisation": (target_cpu + sum(r["cpu_s"] for r in reports))
                                / wall / (os.cpu_count() or 1),
        "tokens_submitted": sub, "tokens_delivered": dlv,
        "feed_tokens_delivered": sum(r["feed_tokens_delivered"] for r in reports),
        "feed_failed": sum(r["feed_failed"] for r in reports),
        "feed_resent": sum(r["feed_resent"] for r in reports),
        "per_trainer": [{k: r[k] for k in ("trainer", "tokens", "wall_s", "tokens_per_s",
                                           "drafter_busy", "drafter_tokens_per_s",
                                           "tokens_submitted", "tokens_delivered")}
                        for r in reports],
    }


# ---------------------------------------------------------------------------- output

def fmt_bytes(n):
    return "-" if n is None else f"{n / 2**20:,.0f}M"


def print_table(results):
    hdr = (f"{'split':>6} {'tok/s':>9} {'predicted':>9} {'ratio':>6} {'bottleneck':>10} "
           f"{'tgt util':>8} {'drf util':>8} {'q mean':>6} {'q max':>5} {'GB/s':>7} "
           f"{'host cpu':>8} {'peak tgt':>8} {'peak trn':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        qs = [q for series in r["queue_depth"].values() for _, q in series]
        mem = r["peak_memory_bytes"]
        tgt = max((v or 0) for k, v in mem.items() if k.startswith("target "))
        trn = max((v or 0) for k, v in mem.items() if not k.startswith("target "))
        print(f"{r['split']:>6} {r['tokens_per_s']:>9,.0f} {r['predicted_tokens_per_s']:>9,.0f} "
              f"{r['measured_over_predicted']:>6.2f} {r['predicted_bottleneck']:>10} "
              f"{r['target_utilisation_mean']:>8.0%} {r['drafter_utilisation_mean']:>8.0%} "
              f"{sum(qs) / max(1, len(qs)):>6.1f} {max(qs, default=0):>5} "
              f"{r['transfer_GB_per_s']:>7.4f} {r['host_cpu_utilisation']:>8.0%} "
              f"{fmt_bytes(tgt):>8} {fmt_bytes(trn):>8}")


def plot(results, predictions, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["split"] for r in results]
    colors = [f"C{i}" for i in range(len(results))]
    x = list(range(len(results)))
    ax1.bar(x, [r["tokens_per_s"] for r in results], color=colors, label="measured")
    ax1.scatter(x, [r["predicted_tokens_per_s"] for r in results], marker="D", color="black",
                zorder=3, label="predicted (measured splits)")
    other = [p for p in predictions if p["split"] not in names]
    if other:
        xo = list(range(len(results), len(results) + len(other)))
        ax1.scatter(xo, [p["tokens_per_s"] for p in other], marker="D", facecolors="none",
                    edgecolors="black", zorder=3, label="predicted (not run)")
        names = names + [p["split"] for p in other]
        x = x + xo
    ax1.set_xticks(x)
    ax1.set_xticklabels(names)
    ax1.set_xlabel("split (targets-trainers)")
    ax1.set_ylabel("end-to-end tokens/s")
    ax1.set_title("throughput per split")
    ax1.legend(fontsize=8)
    for r, c in zip(results, colors):
        first = True
        for series in r["queue_depth"].values():
            if series:
                ax2.plot([p[0] for p in series], [p[1] for p in series], color=c, alpha=0.8,
                         drawstyle="steps-post", label=r["split"] if first else None)
                first = False
    ax2.set_xlabel("seconds since split start")
    ax2.set_ylabel("feed queue depth (batches, per trainer)")
    ax2.set_title("queue depth over time")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------- main

def parse_splits(text, gpus):
    out = []
    for part in text.split(","):
        try:
            t, d = (int(v) for v in part.strip().split("-"))
        except ValueError:
            raise SystemExit(f"--splits: {part!r} is not T-D (e.g. 5-3)")
        if t < 1 or d < 1 or t + d != gpus:
            raise SystemExit(f"--splits: {part} needs T >= 1, D >= 1 and T + D = --gpus ({gpus})")
        out.append((t, d))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, required=True, help="devices to split (T + D)")
    p.add_argument("--splits", required=True, help="comma-separated T-D, e.g. 5-3,4-4")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: emulated devices (runs now); cuda: real GPUs (not implemented yet)")
    p.add_argument("--gpu-mode", default="per-process", choices=["per-process", "shared"],
                   help="GPU modes (planned): one process per GPU, or all on one shared GPU")
    p.add_argument("--tokens-per-split", type=int, default=20000, help="measured tokens per split")
    p.add_argument("--warmup-tokens", type=int, default=2000, help="warm-up tokens per split")
    p.add_argument("--drafter", choices=["synthetic", "dflash"], default="synthetic")
    p.add_argument("--drafter-flops-per-token", type=float, default=2e5,
                   help="synthetic drafter's load (FLOPs per token, forward matmuls)")
    p.add_argument("--drafter-rate", type=float, default=0.0,
                   help="CPU mode: cap each drafter at this tokens/s (emulated device speed); "
                        "0: compute-bound only")
    p.add_argument("--target-rate", type=float, default=3000.0,
                   help="CPU mode: each target's --throttle_tokens_per_s (emulated device speed)")
    p.add_argument("--layers", default="1,2,3", help="layer ids the trainers ask for")
    p.add_argument("--batch-tokens", type=int, default=512, help="packing token budget")
    p.add_argument("--calibrate-tokens", type=int, default=0,
                   help="tokens for the single-target measurement (default: ~1 s of it)")
    p.add_argument("--calibrate-s", type=float, default=1.0, help="drafter calibration time")
    p.add_argument("--split-timeout-s", type=float, default=600.0)
    p.add_argument("--binary", default=str(REPO / "build" / "bin" / "draftfeed-target"))
    p.add_argument("--out", default="splits-out", help="directory for splits.json / splits.png")
    args = p.parse_args(argv)

    if args.device != "cpu":
        print("splits.py: GPU modes (one GPU shared, 2 GPUs with NCCL/gRPC, 8 GPUs) are not "
              "implemented yet; use --device cpu", file=sys.stderr)
        return 2
    splits = parse_splits(args.splits, args.gpus)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="draftfeed-splits-")
    t_start = time.time()
    try:
        print(f"splits: {args.gpus} emulated devices, splits {args.splits}, model {args.model}, "
              f"target rate {args.target_rate:,.0f} tok/s, drafter {args.drafter}"
              + (f" ({args.drafter_flops_per_token:.3g} FLOPs/token)"
                 if args.drafter == "synthetic" else "")
              + (f" capped at {args.drafter_rate:,.0f} tok/s" if args.drafter_rate else ""),
              flush=True)
        cal = calibrate(args, workdir)
        print(f"advisor: one target {cal['target_tokens_per_s']:,.0f} tok/s; one drafter "
              f"{cal['drafter_tokens_per_s']:,.0f} tok/s ({cal['drafter_step_ms']:.1f} ms per "
              f"{args.batch_tokens}-token step, {cal['drafter_gflops_per_s']:.2f} GFLOP/s); "
              f"link {cal['link_note']}; feed costs "
              f"{cal['pipeline_cpu_s_per_token'] * 1e6:.0f} host CPU-us per token", flush=True)
        predictions = []
        for t in range(1, args.gpus):
            rate, neck, limits = predict(cal, t, args.gpus - t, args.device == "cpu")
            predictions.append({"split": f"{t}-{args.gpus - t}", "tokens_per_s": rate,
                                "bottleneck": neck, "limits": limits})
        best = max(predictions, key=lambda q: q["tokens_per_s"]) if predictions else None
        if best:
            print(f"advisor: best split {best['split']} at {best['tokens_per_s']:,.0f} tok/s "
                  f"(bottleneck: {best['bottleneck']})", flush=True)
        results = []
        for t, d in splits:
            print(f"split {t}-{d}: running ...", flush=True)
            r = run_split(args, t, d, workdir)
            rate, neck, limits = predict(cal, t, d, args.device == "cpu")
            r.update(predicted_tokens_per_s=rate, predicted_bottleneck=neck, predicted_limits=limits,
                     measured_over_predicted=r["tokens_per_s"] / rate)
            results.append(r)
            print(f"split {t}-{d}: {r['tokens_per_s']:,.0f} tok/s measured, {rate:,.0f} predicted "
                  f"({neck}-bound)", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print_table(results)
    if best:
        measured_best = max(results, key=lambda r: r["tokens_per_s"])
        print(f"\nadvisor: best split {best['split']} (predicted {best['tokens_per_s']:,.0f} tok/s, "
              f"{best['bottleneck']}-bound); best measured {measured_best['split']} "
              f"({measured_best['tokens_per_s']:,.0f} tok/s)")

    invariants = {
        "every_split_ran": [r["split"] for r in results] == [f"{t}-{d}" for t, d in splits],
        "tokens_submitted_eq_delivered": {r["split"]: r["tokens_submitted"] == r["tokens_delivered"]
                                          == r["feed_tokens_delivered"] for r in results},
        "no_failed_batches": all(r["feed_failed"] == 0 for r in results),
    }
    invariants["all_ok"] = (invariants["every_split_ran"] and invariants["no_failed_batches"]
                            and all(invariants["tokens_submitted_eq_delivered"].values()))
    doc = {
        "config": {**vars(args), "cpu_count": os.cpu_count(),
                   "python": sys.version.split()[0], "mode": "cpu-emulated",
                   "started": t_start, "elapsed_s": time.time() - t_start},
        "advisor": {"calibration": cal, "predictions": predictions, "best": best},
        "splits": results,
        "invariants": invariants,
    }
    (out / "splits.json").write_text(json.dumps(doc, indent=1))
    plot(results, predictions, out / "splits.png")
    print(f"wrote {out / 'splits.json'} and {out / 'splits.png'}; invariants "
          f"{'OK' if invariants['all_ok'] else 'FAILED'}")
    return 0 if invariants["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
