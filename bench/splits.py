#!/usr/bin/env python3
"""Split benchmark: given N devices, how many should run targets (T) and how many drafter
trainers (D), T + D = N?

One file past ~600 lines: the process pool, the calibration, the predictions and the report
share one set of result records, and it is run (and loaded by tests/bench/test_splits.py)
as a single script from its path, with no package around it.

For every split T-D it runs T draftfeed-target processes and D trainer processes
(bench/split_trainer.py, each with its own draftfeed.Feed over all T targets), a warm-up, then a
fixed number of tokens, and reports end-to-end tokens/s, target and drafter utilisation, queue
depth over time, transfer GB/s and per-device peak memory. An advisor first measures one
target's rate, one drafter's rate and the link between them (one target streaming to a trainer
that only receives) and predicts every split as
min(T x target_rate, D x drafter_rate, min(T, D) x link_rate), naming the best split and the
term that bounds each one.

Modes:
  --device cpu   each "GPU" is a process on this host: targets capped with
                 --throttle_tokens_per_s=--target-rate, drafters optionally padded to
                 --drafter-rate; CI runs this.
      PYTHONPATH=build/python /usr/bin/python3 bench/splits.py --gpus 8 --splits 5-3,4-4 \
          --model tiny-random --device cpu --target-rate 3000 --out bench/results/splits-cpu
  --device cuda  real GPUs, no throttling: targets are `draftfeed-target --device cuda:i
                 --model M --max_batch_tokens B` on GPUs 0..T-1, trainers run torch on
                 cuda:T..N-1. --gpus 1 is the shared smoke mode: one target and one trainer on
                 cuda:0 (only split 1-1). --transport grpc|nccl|auto goes to every trainer's
                 Feed(transport=..., cuda_device=<its GPU>); --transport both runs each split
                 once per transport ("1-1/grpc", "1-1/nccl"). bench/run_splits_gpu.sh has the
                 exact commands for 1, 2 and 8 GPUs.

EAGLE-3 drafters (--drafter eagle3 | eagle3-lmhead | eagle3-both; bench/split_trainer.py has
the models): `eagle3` trains on the target's own distribution, computed on the target from its
lm_head and streamed (Feed(draft_vocab=ids, argmax=True): hidden [T, 3, H] plus Vd*2 + 4 bytes a
token of bf16 probabilities and argmax); `eagle3-lmhead` asks for the 3 layers and -1 instead
and holds the target's lm_head [V, H] itself, making the [T, V] logits every step. --layers
defaults to `eagle3` for them (draftfeed.layers.eagle3(L)[:3]), --draft-vocab-size to
min(32000, V). The calibration is per drafter kind: the receiver that times the target and the
link asks for that kind's stream, so the target's rate includes the outputs it computes and the
link's tokens/s counts the bytes per token actually streamed; the drafter is timed on random
inputs of that shape and reports its memory (torch.cuda.max_memory_allocated on a GPU, the
bytes of the tensors it holds on the CPU). `eagle3-both` calibrates both kinds, prints them side
by side (rate, trainer memory, lm_head bytes, bytes per token, target and link rates), predicts
every split for each (labels ".../eagle3", ".../eagle3-lmhead") and runs every split once per
kind, so the advisor accounts for the lighter trainer; splits.json's advisor holds "drafters"
and "best_by_drafter", and its calibration the kinds under "by_drafter" (--predict reads them).
  PYTHONPATH=build/python /usr/bin/python3 bench/splits.py --gpus 2 --splits 1-1 \
      --model tiny-random --device cpu --drafter eagle3-both --draft-vocab-size 512

Targets are started once and reused by later splits (splits are run from the most targets to
the fewest; a target whose GPU a split gives to a trainer is stopped), so a 27B random model is
made once per GPU, not once per split.

Measured tokens/s is the steady state: the tokens delivered after the first round (one batch per
target) over the time from that round's end to the last delivery; the prediction is a
steady-state rate, and a run of a few 49,152-token batches would otherwise be dominated by the
pipeline's fill and drain. The end-to-end rate over the whole window is reported beside it.

Outputs: a table on the terminal, DIR/splits.json (config, advisor, per-split results,
invariants), DIR/splits.png (tokens/s per split, measured vs predicted; queue depth over time);
--save_calibration FILE also writes the advisor's calibration on its own.

Prediction only (runs nothing): every T-D split of N GPUs from one saved calibration, per
transport it has rates for, and the best split:
  bench/splits.py --predict 8 --calibration bench/results/splits-h200-2gpu-2026-11-30d/calibration.json
--calibration also takes a splits.json. A one-GPU calibration (--gpus 1, gRPC only) predicts
NCCL as well: the drafter's own rate without its host copy, no link term. Or from per-GPU
rates measured elsewhere (one target's tokens/s, e.g. draftfeed-bench engine; one drafter's,
split_trainer.py --calibrate):
  bench/splits.py --predict 8 --target-tokens-per-s 11701 --drafter-tokens-per-s 48215 \
      [--link-tokens-per-s R] [--save_calibration FILE]
The rates of one GPU carry over to N because every target and every trainer has its own GPU
and its own stream endpoint; what it does not model is a shared host limit (CPU, PCIe) that
only appears with more processes.
"""

import argparse
import copy
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAINER = pathlib.Path(__file__).resolve().parent / "split_trainer.py"
EAGLE3_KINDS = ("eagle3", "eagle3-lmhead")  # split_trainer.EAGLE3_KINDS
DRAFTERS = ("synthetic", "dflash", "dflash-full") + EAGLE3_KINDS + ("eagle3-both",)


def trainer_module():
    """bench/split_trainer.py as a module (its helpers need numpy only, no torch)."""
    mod = sys.modules.get("split_trainer_for_splits")
    if mod is None:
        spec = importlib.util.spec_from_file_location("split_trainer_for_splits", TRAINER)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def drafter_kinds(drafter):
    """The drafter kinds a run calibrates and measures: eagle3-both is eagle3 and
    eagle3-lmhead side by side."""
    return list(EAGLE3_KINDS) if drafter == "eagle3-both" else [drafter]


def stream_of(kind):
    """What a trainer of this drafter kind receives per token: the eagle3 kinds their own
    streams (split_trainer.stream_spec), every other kind the --layers hidden states."""
    return kind if kind in EAGLE3_KINDS else "hidden"


# ---------------------------------------------------------------------------- processes

class Target:
    """One draftfeed-target process; `start()` launches it, `wait()` blocks until it serves (a
    split's targets start together: a random 27B model takes 10-20 s to make on its GPU)."""

    def __init__(self, args, workdir, index):
        self.index = index
        self.dir = tempfile.mkdtemp(prefix=f"target{index}-", dir=workdir)
        self.port_file = os.path.join(self.dir, "port")
        self.log = open(os.path.join(self.dir, "log"), "w+")
        self.timeout_s = args.target_start_timeout_s
        cmd = [args.binary, f"--model={args.model}", "--listen=127.0.0.1:0",
               f"--port_file={self.port_file}"]
        if args.device == "cuda":
            cmd += [f"--device=cuda:{index}", f"--max_batch_tokens={args.max_batch_tokens}"]
        else:
            cmd += ["--threads=1", "--device=cpu"]
            if args.target_rate > 0:
                cmd.append(f"--throttle_tokens_per_s={args.target_rate}")
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.started = time.time()
        self.address = None

    def wait(self):
        while not os.path.exists(self.port_file) or not open(self.port_file).read().strip():
            if self.proc.poll() is not None:
                raise RuntimeError(f"target {' '.join(self.cmd)} exited: {self.output()[-3000:]}")
            if time.time() > self.started + self.timeout_s:
                raise RuntimeError(f"target did not start within {self.timeout_s:.0f} s: "
                                   f"{self.output()[-3000:]}")
            time.sleep(0.05)
        self.address = f"127.0.0.1:{int(open(self.port_file).read())}"
        self.start_s = time.time() - self.started
        return self

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


class TargetPool:
    """Targets by index (index i runs on GPU i in cuda mode), kept across splits."""

    def __init__(self, args, workdir):
        self.args, self.workdir, self.running = args, workdir, {}

    def take(self, count):
        """Targets 0..count-1 serving; any other running target is stopped first (its GPU
        goes to a trainer)."""
        for i in sorted(self.running):
            if i >= count:
                self.running.pop(i).stop()
        new = [Target(self.args, self.workdir, i) for i in range(count) if i not in self.running]
        try:
            for t in new:
                self.running[t.index] = t.wait()
        except BaseException:
            for t in new:
                t.stop()
            raise
        if new:
            print(f"  started {len(new)} target(s) in {max(t.start_s for t in new):.1f} s",
                  flush=True)
        return [self.running[i] for i in range(count)]

    def stop(self):
        for t in self.running.values():
            t.stop()
        self.running = {}


class GpuMonitor:
    """Samples nvidia-smi in a thread: peak memory.used and mean utilization.gpu per GPU while
    a split runs. Does nothing where nvidia-smi is absent (CPU mode)."""

    QUERY = ["nvidia-smi", "--query-gpu=index,memory.used,utilization.gpu",
             "--format=csv,noheader,nounits"]

    def __init__(self, every_s=0.5):
        self.every_s = every_s
        self.enabled = shutil.which("nvidia-smi") is not None
        self.peak_mib, self.util = {}, {}
        self._stop = threading.Event()
        self._thread = None

    def sample(self):
        out = subprocess.run(self.QUERY, capture_output=True, text=True, timeout=10).stdout
        for line in out.strip().splitlines():
            idx, mem, util = (v.strip() for v in line.split(","))
            i = int(idx)
            self.peak_mib[i] = max(self.peak_mib.get(i, 0), float(mem))
            if util.replace(".", "").isdigit():
                self.util.setdefault(i, []).append(float(util))

    def __enter__(self):
        if self.enabled:
            def loop():
                while True:
                    try:
                        self.sample()
                    except (OSError, ValueError, subprocess.SubprocessError):
                        pass
                    if self._stop.wait(self.every_s):
                        return
            self._thread = threading.Thread(target=loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread:
            self._stop.set()
            self._thread.join()
        return False

    def report(self):
        if not self.enabled:
            return None
        return {str(i): {"peak_memory_bytes": int(self.peak_mib[i] * 2**20),
                         "utilization_gpu_mean": (sum(self.util.get(i, [])) /
                                                  max(1, len(self.util.get(i, [])))) / 100.0,
                         "samples": len(self.util.get(i, []))}
                for i in sorted(self.peak_mib)}


def trainer_gpu(args, t_count, j):
    """The GPU trainer j of a split with t_count targets uses (shared mode: GPU 0)."""
    return 0 if args.gpus == 1 else t_count + j


def trainer_cmd(args, name, targets, tokens, warmup, drafter, seed, gpu=0, transport="",
                extra=(), stream="hidden"):
    """`stream`: what a `none` receiver asks for (an eagle3 kind's stream, for its link)."""
    device = f"cuda:{gpu}" if args.device == "cuda" else "cpu"
    cmd = [sys.executable, str(TRAINER), f"--name={name}", f"--targets={','.join(targets)}",
           f"--layers={args.layers}", f"--tokens={tokens}", f"--warmup-tokens={warmup}",
           f"--batch-tokens={args.batch_tokens}", f"--drafter={drafter}",
           f"--flops-per-token={args.drafter_flops_per_token}",
           f"--drafter-rate={args.drafter_rate if drafter != 'none' else 0}",
           f"--drafter-layers={args.drafter_layers}", f"--draft-vocab={args.draft_vocab}",
           f"--max-seq-len={args.max_seq_len}", f"--device={device}", f"--seed={seed}"]
    if drafter in EAGLE3_KINDS or stream != "hidden":
        cmd += [f"--draft-vocab-size={args.draft_vocab_size}",
                f"--probs-encoding={args.probs_encoding}", f"--ttt-steps={args.ttt_steps}"]
    if stream != "hidden":
        cmd.append(f"--stream={stream}")
    if transport:
        cmd += [f"--transport={transport}", f"--cuda-device={gpu}"]
    return cmd + list(extra)


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

def link_rate(tokens, send_s):
    """Tokens/s a link moves while it is busy (the targets' send_ms: first chunk to BatchDone);
    None when the sends were too short to time."""
    return tokens / send_s if send_s > 1e-3 else None


def dflash_layers(num_layers, k):
    """draftfeed.layers.dflash, loaded from the source tree: pure Python, so it needs neither
    the compiled client nor an import path."""
    path = REPO / "client" / "python" / "draftfeed" / "layers.py"
    spec = importlib.util.spec_from_file_location("draftfeed_layers_for_splits", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.dflash(num_layers, k)


def resolve_layers(text, num_layers, model):
    """--layers as the comma-separated ids the trainers ask for. "dflash" / "dflash:K": DFlash's
    K (default 5) layers of this target's depth (1,16,31,46,61 of 64; 1,10,19,28,37 of 40), so
    one command serves every model; "eagle3": EAGLE-3's 3 feature layers
    (draftfeed.layers.eagle3(L)[:3]: 1,31,60 of 64; 0,2,3 of a 4-layer target), the eagle3
    drafters' default (eagle3-lmhead's trainer adds -1). Explicit ids must exist in the target: 0..L-1, or -1 (the
    final norm); a missing one is refused here rather than by every batch."""
    if text == "eagle3":
        try:
            return ",".join(str(i) for i in trainer_module().eagle3_layers(num_layers))
        except ValueError as e:
            raise SystemExit(f"--layers eagle3: {e}")
    if text == "dflash" or text.startswith("dflash:"):
        k = text.partition(":")[2] or "5"
        if not k.isdigit() or int(k) < 1:
            raise SystemExit(f"--layers {text}: dflash:K needs K >= 1")
        try:
            return ",".join(str(i) for i in dflash_layers(num_layers, int(k)))
        except ValueError as e:
            raise SystemExit(f"--layers {text}: {e}")
    try:
        ids = [int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"--layers {text!r}: not comma-separated layer ids (or dflash[:K])")
    bad = [i for i in ids if not (i == -1 or 0 <= i < num_layers)]
    if bad:
        raise SystemExit(f"--layers {text}: {', '.join(map(str, bad))} not a layer of {model} "
                         f"({num_layers} layers: 0..{num_layers - 1}, -1 the final norm); "
                         f"--layers dflash:5 picks DFlash's for any depth")
    return ",".join(map(str, ids))


def calibrate(args, pool, workdir, transports):
    """One target streaming to one trainer that only receives (the target's rate from its
    forward_ms, the link's from its send_ms), once per transport; then one drafter alone (timed
    steps on random inputs of the right shape on its device).

    Per drafter kind (eagle3-both: eagle3 and eagle3-lmhead): the receiver asks for what that
    kind's trainers will (its stream: eagle3's 3 layers + draft probabilities + argmax,
    eagle3-lmhead's 4 layers), so the target's rate includes the outputs it computes and the
    link's tokens/s counts the bytes per token actually streamed. One kind: its calibration,
    as before. Several: the first kind's at the top level (what older readers use) and every
    kind's under "by_drafter"."""
    d = tempfile.mkdtemp(prefix="calibrate-", dir=workdir)
    t = pool.take(1)[0]
    info_cmd = [sys.executable, "-c",
                "import json, sys, draftfeed; print(json.dumps(draftfeed.describe_target(sys.argv[1])))",
                t.address]
    info = json.loads(subprocess.run(info_cmd, check=True, capture_output=True,
                                     text=True).stdout)
    args.layers = resolve_layers(args.layers, int(info["num_layers"]), args.model)
    kinds = drafter_kinds(args.drafter)
    if any(k in EAGLE3_KINDS for k in kinds):
        ids = args.layers.split(",")
        if len(ids) != 3 or "-1" in ids:
            raise SystemExit(f"--layers {args.layers}: the eagle3 drafters take 3 feature "
                             f"layers, not -1 (--layers eagle3 picks EAGLE-3's)")
        args.draft_vocab_size = trainer_module().default_draft_vocab_size(
            int(info["vocab_size"]), args.draft_vocab_size)
    print(f"  layers {args.layers} of the target's {info['num_layers']}"
          + (f"; draft vocabulary {args.draft_vocab_size} of {info['vocab_size']} ids"
             if any(k in EAGLE3_KINDS for k in kinds) else ""), flush=True)
    if args.device == "cuda":
        tokens = args.calibrate_tokens or 4 * args.batch_tokens
    else:
        tokens = args.calibrate_tokens or max(1000, int(args.target_rate * 1.0)
                                              if args.target_rate > 0 else 20000)
    gpu = trainer_gpu(args, 1, 0)
    streams, by = {}, {}
    for kind in kinds:
        stream = stream_of(kind)
        if stream not in streams:
            streams[stream] = calibrate_stream(args, t, d, transports, tokens, gpu, stream)
        by[kind] = {**streams[stream],
                    **calibrate_drafter(args, info, kind, transports, gpu),
                    "model": info}
    if len(kinds) == 1:
        return by[kinds[0]]
    return {**copy.deepcopy(by[kinds[0]]), "by_drafter": by}


def calibrate_stream(args, t, workdir, transports, tokens, gpu, stream="hidden"):
    """The target's rate and the link's, per transport, for one stream: a `none` trainer
    receiving what the stream carries."""
    links, target = {}, None
    for transport in transports:
        reps, target_cpu = run_trainers(
            [trainer_cmd(args, "calibrate-target", [t.address], tokens, args.batch_tokens, "none",
                         999, gpu, transport if args.device == "cuda" else "", stream=stream)],
            workdir, args.split_timeout_s, [t.proc.pid])
        rep = reps[0]
        fwd_s = sum(rep["forward_ms_by_target"].values()) / 1000.0
        send_s = sum(rep["send_ms_by_target"].values()) / 1000.0
        links[transport] = {"link_tokens_per_s": link_rate(rep["tokens"], send_s),
                            "delivered_tokens_per_s": steady_rate([rep])[0],
                            "send_s": send_s, "GB_per_s": rep["bytes_received"] / send_s / 1e9
                            if send_s > 1e-3 else None,
                            # What one token costs the link: the stream's bytes (hidden states
                            # and any target outputs), measured and as the stream defines it.
                            "bytes_per_token": rep["bytes_received"] / max(1, rep["tokens"]),
                            "stream_bytes_per_token": rep.get("bytes_per_token")}
        if target is None:
            target = {"target_tokens_per_s": rep["tokens"] / fwd_s if fwd_s > 0
                      else rep["tokens_per_s"],
                      "target_calibration_tokens": rep["tokens"],
                      # Host CPU seconds per token of the feed itself (target process + trainer
                      # client, no drafter work): in CPU mode all emulated devices share this
                      # host's cores.
                      "pipeline_cpu_s_per_token": (target_cpu + rep["cpu_s"]) / max(1, rep["tokens"]),
                      "stream": stream, "bytes_per_token": rep.get("bytes_per_token")}
    return {**target, "link_by_transport": links}


def calibrate_drafter(args, info, kind, transports, gpu):
    """One drafter of `kind` alone: its rate (per transport: gRPC adds the batch's host->GPU
    copy) and its memory."""
    k = len(args.layers.split(","))
    extra = ["--calibrate", f"--hidden-size={info['hidden_size']}", f"--num-layers={k}",
             f"--vocab={min(4096, info['vocab_size'])}", f"--calibrate-s={args.calibrate_s}"]
    if kind in EAGLE3_KINDS:
        extra.append(f"--target-vocab-size={info['vocab_size']}")
    out = subprocess.run(trainer_cmd(args, "calibrate-drafter", [], 0, 0, kind, 998, gpu,
                                     extra=extra),
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"drafter calibration ({kind}) exited {out.returncode}:\n"
                           f"{out.stderr[-3000:]}")
    drep = last_json_line(out.stdout, "drafter calibration")
    # gRPC on a GPU: every step first copies its batch in from host memory (the trainer's
    # thread waits for it); NCCL delivers on the device. Per transport, the drafter rate a
    # trainer sees.
    per_token_s = 1.0 / drep["drafter_tokens_per_s"]
    h2d_per_token_s = drep["h2d_ms"] / 1000.0 / args.batch_tokens
    drafter_by_transport = {
        tr: 1.0 / (per_token_s + (h2d_per_token_s if tr == "grpc" else 0.0))
        for tr in transports}
    return {
        "drafter": kind,
        "drafter_tokens_per_s": drep["drafter_tokens_per_s"],
        "drafter_tokens_per_s_by_transport": drafter_by_transport,
        "drafter_compute_tokens_per_s": drep["compute_tokens_per_s"],
        "drafter_step_ms": drep["step_ms"],
        "drafter_h2d_ms": drep["h2d_ms"],
        "drafter_flops_per_token": drep["flops_per_token"],
        "drafter_gflops_per_s": drep["gflops_per_s"],
        "drafter_cuda_peak_allocated_bytes": drep.get("cuda_peak_allocated_bytes"),
        "drafter_peak_rss_bytes": drep.get("peak_rss_bytes"),
        "drafter_trainer_bytes": drep.get("trainer_bytes"),
        "drafter_trainer_bytes_kind": drep.get("trainer_bytes_kind"),
        "drafter_held_bytes": drep.get("held_bytes"),
        "drafter_lm_head_bytes": drep.get("lm_head_bytes"),
        "draft_vocab_size": drep.get("draft_vocab_size"),
        "ttt_steps": drep.get("ttt_steps"),
    }


def drafter_calibrations(cal):
    """{kind: calibration} of a calibration: its by_drafter, else {its drafter (or ""): it}."""
    return dict(cal.get("by_drafter") or {cal.get("drafter", ""): cal})


def drafters_summary(cal, transports):
    """The drafters side by side: per kind, one trainer's rate and memory, what it streams,
    the target's rate and the link's for that stream."""
    out = {}
    for kind, c in drafter_calibrations(cal).items():
        out[kind] = {
            "drafter_tokens_per_s": c["drafter_tokens_per_s"],
            "drafter_tokens_per_s_by_transport": c.get("drafter_tokens_per_s_by_transport"),
            "drafter_step_ms": c.get("drafter_step_ms"),
            "trainer_bytes": c.get("drafter_trainer_bytes"),
            "trainer_bytes_kind": c.get("drafter_trainer_bytes_kind"),
            "lm_head_bytes": c.get("drafter_lm_head_bytes"),
            "bytes_per_token": c.get("bytes_per_token"),
            "target_tokens_per_s": c["target_tokens_per_s"],
            "link_tokens_per_s": {tr: c.get("link_by_transport", {}).get(tr, {}).get(
                "link_tokens_per_s") for tr in transports},
        }
    return out


def print_drafters(summary, batch_tokens=None, out=sys.stdout):
    """The side-by-side table of drafters_summary (several kinds only)."""
    if len(summary) < 2:
        return
    print("advisor: drafters side by side (one trainer"
          + (f", {batch_tokens}-token steps" if batch_tokens else "") + "):", file=out)
    print(f"  {'drafter':<14} {'tok/s':>9} {'step ms':>8} {'trainer mem':>11} "
          f"{'lm_head':>9} {'B/token':>8} {'target tok/s':>12} {'link tok/s':>10}", file=out)
    for kind, v in summary.items():
        link = [x for x in v["link_tokens_per_s"].values() if x]
        print(f"  {kind:<14} {v['drafter_tokens_per_s']:>9,.0f} {v['drafter_step_ms'] or 0:>8.1f} "
              f"{fmt_mem(v['trainer_bytes']):>11} {fmt_mem(v['lm_head_bytes']):>9} "
              f"{v['bytes_per_token'] or 0:>8,.0f} {v['target_tokens_per_s']:>12,.0f} "
              f"{(f'{min(link):,.0f}' if link else '-'):>10}", file=out)
    kinds = {v["trainer_bytes_kind"] for v in summary.values() if v["trainer_bytes_kind"]}
    if kinds:
        print(f"  trainer mem: {'; '.join(sorted(kinds))}", file=out, flush=True)


def predict(cal, t, d, cpu_mode, transport="grpc", shared_gpu=False, cpu_count=None):
    """Predicted tokens/s of split T-D, the term that bounds it, and every term.

    target: T x one target's rate. drafter: D x one drafter's rate (with the batch's copy from
    host memory when the transport is gRPC). link: min(T, D) x one target->trainer link's rate:
    every target sends and every trainer receives through its own stream endpoint, so the
    pairs the smaller side can drive at once bound the data plane. shared-gpu (--gpus 1): the
    target's forward and the drafter's step take turns on one GPU, so their times per token
    add up."""
    drafter = cal.get("drafter_tokens_per_s_by_transport", {}).get(
        transport, cal["drafter_tokens_per_s"])
    limits = {"target": t * cal["target_tokens_per_s"], "drafter": d * drafter}
    link = cal.get("link_by_transport", {}).get(transport, {}).get("link_tokens_per_s")
    if link:
        limits["link"] = min(t, d) * link
    if shared_gpu:
        limits["shared-gpu"] = 1.0 / (1.0 / limits["target"] + 1.0 / limits["drafter"])
    if cpu_mode:
        # Every emulated device is a process on this host: per token the host spends the
        # feed's CPU time (target forward + gRPC + client) plus the drafter's compute, so
        # cores / (that sum) caps any split. Not a term of the GPU modes.
        per_token = cal["pipeline_cpu_s_per_token"] + 1.0 / cal["drafter_compute_tokens_per_s"]
        limits["host-cpu"] = (cpu_count or os.cpu_count() or 1) / per_token
    bottleneck = min(limits, key=limits.get)
    return limits[bottleneck], bottleneck, limits


def steady_rate(reports, skip=1):
    """(tokens/s, seconds) in steady state, across the split's trainers: from the skip-th
    delivery to the last, counting the tokens delivered after the skip-th. skip = the number of
    targets: they fill in parallel, so the first round of deliveries lands almost at once and
    only the time after it measures the rate. (0, 0) when too few deliveries."""
    ds = sorted((t, n) for r in reports for t, n in r.get("deliveries", []))
    skip = max(1, min(skip, len(ds) - 1))
    if len(ds) < 2 or ds[-1][0] <= ds[skip - 1][0]:
        return 0.0, 0.0
    span = ds[-1][0] - ds[skip - 1][0]
    return sum(n for _, n in ds[skip:]) / span, span


def predict_all(cal, gpus, transports, cpu_mode, shared=False, cpu_count=None, label=True):
    """Every split T-D of `gpus` devices (1-1 shared when `shared`), once per transport: a list
    of {split, transport, tokens_per_s, bottleneck, limits}, most targets first."""
    candidates = [(1, 1)] if shared else [(t, gpus - t) for t in range(gpus - 1, 0, -1)]
    out = []
    for tr in transports:
        for t, d in candidates:
            rate, neck, limits = predict(cal, t, d, cpu_mode, tr, shared, cpu_count)
            out.append({"split": f"{t}-{d}" + (f"/{tr}" if label else ""), "targets": t,
                        "trainers": d, "transport": tr, "tokens_per_s": rate,
                        "bottleneck": neck, "limits": limits})
    return out


def predict_drafters(cal, gpus, transports, cpu_mode, shared=False, cpu_count=None, label=True):
    """predict_all for every drafter kind of the calibration (by_drafter): each prediction
    from that kind's own rates (target with its outputs, drafter, link for its stream), its
    split labelled "/kind" and its "drafter" set. A calibration of one kind: predict_all."""
    by = cal.get("by_drafter")
    if not by:
        return predict_all(cal, gpus, transports, cpu_mode, shared, cpu_count, label)
    out = []
    for kind, sub in by.items():
        for q in predict_all(sub, gpus, transports, cpu_mode, shared, cpu_count, label):
            q["split"] += f"/{kind}"
            q["drafter"] = kind
            out.append(q)
    return out


def best_by_drafter(predictions):
    """{drafter kind: its prediction with the most tokens/s} (ties to more targets)."""
    best = {}
    for q in predictions:
        k = q.get("drafter", "")
        if k not in best or q["tokens_per_s"] > best[k]["tokens_per_s"]:
            best[k] = q
    return best


def best_by_transport(predictions):
    """{transport: the prediction with the most tokens/s}; ties go to more targets (listed
    first), which leaves more trainers' memory free of a second model copy."""
    best = {}
    for q in predictions:
        if q["transport"] not in best or q["tokens_per_s"] > best[q["transport"]]["tokens_per_s"]:
            best[q["transport"]] = q
    return best


CALIBRATION_KIND = "draftfeed-splits-calibration"


def calibration_from_rates(target_tokens_per_s, drafter_tokens_per_s, link_tokens_per_s=None,
                           transport="nccl"):
    """A calibration from per-GPU rates given by hand: one target's tokens/s (draftfeed-bench
    engine, or a split run's calibration) and one drafter's (split_trainer.py --calibrate), for
    one transport; the link is no term unless given (NCCL between GPUs of one host moves a
    27B batch in ~1% of its forward)."""
    for name, v in (("target", target_tokens_per_s), ("drafter", drafter_tokens_per_s)):
        if not v or v <= 0:
            raise SystemExit(f"--{name}-tokens-per-s must be > 0 (got {v})")
    if link_tokens_per_s is not None and link_tokens_per_s <= 0:
        raise SystemExit(f"--link-tokens-per-s must be > 0 (got {link_tokens_per_s})")
    return {"target_tokens_per_s": float(target_tokens_per_s),
            "drafter_tokens_per_s": float(drafter_tokens_per_s),
            "drafter_tokens_per_s_by_transport": {transport: float(drafter_tokens_per_s)},
            "link_by_transport": {transport: {"link_tokens_per_s": link_tokens_per_s}}}


def calibration_doc(cal, mode, source, **meta):
    """The file --save_calibration writes and --calibration reads. `mode` is the mode the
    rates were measured in (cpu-emulated calibrations keep their host's core count: the
    host-cpu term depends on it)."""
    keep = ("target_tokens_per_s", "drafter_tokens_per_s", "drafter_tokens_per_s_by_transport",
            "drafter_compute_tokens_per_s", "drafter_step_ms", "drafter_h2d_ms",
            "drafter_flops_per_token", "link_by_transport", "pipeline_cpu_s_per_token", "model",
            "drafter", "stream", "bytes_per_token", "drafter_cuda_peak_allocated_bytes",
            "drafter_trainer_bytes", "drafter_trainer_bytes_kind", "drafter_held_bytes",
            "drafter_lm_head_bytes", "draft_vocab_size", "ttt_steps")
    out = {k: cal[k] for k in keep if k in cal}
    if cal.get("by_drafter"):
        out["by_drafter"] = {kind: {k: c[k] for k in keep if k in c}
                             for kind, c in cal["by_drafter"].items()}
    return {"kind": CALIBRATION_KIND, "version": 1, "mode": mode, "source": source, **meta,
            "calibration": out}


def load_calibration(path):
    """(calibration, mode, cpu_count, doc) from a file --save_calibration wrote or from a
    splits.json (its advisor's calibration); a clear error naming the file otherwise."""
    try:
        doc = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--calibration {path}: cannot read it as JSON: {e}")
    if isinstance(doc, dict) and doc.get("kind") == CALIBRATION_KIND:
        cal, mode, cpus = doc.get("calibration"), doc.get("mode", "cuda"), doc.get("cpu_count")
    elif isinstance(doc, dict) and isinstance(doc.get("advisor"), dict):
        cfg = doc.get("config", {})
        cal, mode, cpus = doc["advisor"].get("calibration"), cfg.get("mode", "cuda"), cfg.get(
            "cpu_count")
    else:
        raise SystemExit(f"--calibration {path}: neither a calibration (kind "
                         f"{CALIBRATION_KIND!r}) nor a splits.json with an advisor section")
    for key in ("target_tokens_per_s", "drafter_tokens_per_s"):
        v = (cal or {}).get(key)
        if not isinstance(v, (int, float)) or v <= 0:
            raise SystemExit(f"--calibration {path}: calibration.{key} is {v!r}, not a rate > 0")
    if mode == "cpu-emulated" and "pipeline_cpu_s_per_token" not in cal:
        raise SystemExit(f"--calibration {path}: a cpu-emulated calibration needs "
                         f"calibration.pipeline_cpu_s_per_token")
    return cal, mode, cpus, doc


def with_nccl_from_one_gpu(cal):
    """The NCCL rates of a one-GPU (shared-mode) calibration, which can only measure gRPC (NCCL
    refuses two ranks on one device). A trainer's drafter rate over NCCL is the drafter's own
    rate, the batch arriving on its device with no host copy: the very number a two-GPU
    calibration records for nccl, since the drafter is timed alone either way. The link is no
    term: NCCL between two GPUs of one host moved 6.2M tokens/s of 27B states in the 2-GPU
    calibration of 2026-11-30, 530x one target. A copy; the calibration given is unchanged."""
    out = copy.deepcopy(cal)
    for c in [out] + list((out.get("by_drafter") or {}).values()):
        c.setdefault("drafter_tokens_per_s_by_transport", {})["nccl"] = c["drafter_tokens_per_s"]
        c.setdefault("link_by_transport", {})["nccl"] = {
            "link_tokens_per_s": None, "derived": "one-GPU calibration: NCCL not measured"}
    return out


def calibration_transports(cal):
    """The transports a calibration has rates for, in a stable order; [""] for none."""
    names = set(cal.get("drafter_tokens_per_s_by_transport", {})) | set(
        cal.get("link_by_transport", {}))
    order = ["grpc", "nccl", "auto"]
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n)) or [""]


def print_predictions(predictions, out=sys.stdout):
    """One line per split (terms included), then the best split per transport."""
    for q in predictions:
        terms = ", ".join(f"{k} {v:,.0f}" for k, v in q["limits"].items())
        print(f"advisor: {q['split']:>10} predicted {q['tokens_per_s']:>9,.0f} tok/s, "
              f"{q['bottleneck']}-bound ({terms})", file=out, flush=True)
    for tr, q in best_by_transport(predictions).items():
        print(f"advisor: best split{' over ' + tr if tr else ''} {q['split']} at "
              f"{q['tokens_per_s']:,.0f} tok/s (bottleneck: {q['bottleneck']})", file=out,
              flush=True)
    by_drafter = best_by_drafter(predictions)
    if len(by_drafter) > 1:
        for kind, q in by_drafter.items():
            print(f"advisor: best split with {kind} {q['split']} at {q['tokens_per_s']:,.0f} "
                  f"tok/s (bottleneck: {q['bottleneck']})", file=out, flush=True)


def predict_main(args):
    """--predict N: every split of N GPUs from one saved calibration (or from rates given on
    the command line), without running anything."""
    if args.calibration:
        if args.target_tokens_per_s or args.drafter_tokens_per_s:
            raise SystemExit("--calibration and --target/--drafter-tokens-per-s exclude each other")
        cal, mode, cpus, src = load_calibration(args.calibration)
        source = f"{args.calibration}" + (f" ({src['source']})" if src.get("source") else "")
        if "config" in src:  # a splits.json: what its run measured, to keep beside the rates
            cfg = src["config"]
            meta = {k: cfg.get(k) for k in ("model", "gpus", "drafter", "drafter_layers",
                                            "batch_tokens", "layers", "cpu_count")}
            if cfg.get("started"):
                meta["measured_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                     time.gmtime(cfg["started"]))
        else:
            meta = {k: v for k, v in src.items()
                    if k not in ("kind", "version", "mode", "source", "calibration")}
    elif args.target_tokens_per_s or args.drafter_tokens_per_s:
        cal = calibration_from_rates(args.target_tokens_per_s, args.drafter_tokens_per_s,
                                     args.link_tokens_per_s, args.rates_transport)
        mode, cpus, source = "cuda", None, "rates given on the command line"
        meta = {}
    else:
        raise SystemExit("--predict needs --calibration FILE or --target-tokens-per-s and "
                         "--drafter-tokens-per-s")
    cpu_mode = mode == "cpu-emulated"
    derived_nccl = mode == "cuda-shared" and "nccl" not in calibration_transports(cal)
    if derived_nccl:
        cal = with_nccl_from_one_gpu(cal)
    transports = calibration_transports(cal)
    if args.transport:
        if args.transport not in transports:
            raise SystemExit(f"--transport {args.transport}: the calibration has rates for "
                             f"{', '.join(t or '(none)' for t in transports)} only")
        transports = [args.transport]
    if args.predict < 2:
        raise SystemExit("--predict N needs N >= 2 (one GPU is the shared mode, split 1-1; "
                         "it needs its own calibration run)")
    predictions = predict_drafters(cal, args.predict, transports, cpu_mode, cpu_count=cpus,
                                   label=transports != [""])
    for kind, c in drafter_calibrations(cal).items():
        print(f"advisor: {args.predict} GPUs from {source}: one target "
              f"{c['target_tokens_per_s']:,.0f} tok/s, one {kind + ' ' if kind else ''}drafter "
              + ", ".join(f"{v:,.0f} ({tr})" for tr, v in
                          c.get("drafter_tokens_per_s_by_transport", {}).items())
              + f" tok/s; prediction = min(T x target, D x drafter, min(T, D) x link)",
              flush=True)
    if derived_nccl and "nccl" in transports:
        print("advisor: nccl from a one-GPU calibration (gRPC only there): the drafter's own "
              "rate, no host copy; the link not measured, no term", flush=True)
    print_drafters(drafters_summary(cal, transports),
                   meta.get("batch_tokens"))
    print_predictions(predictions)
    if args.save_calibration:
        save_calibration(args.save_calibration, calibration_doc(cal, mode, source, **meta))
    return 0


def save_calibration(path, doc):
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote calibration {path}", flush=True)


# ---------------------------------------------------------------------------- one split

def run_split(args, pool, t_count, d_count, transport, workdir, drafter=None, suffix=""):
    """One split T-D with `drafter` (default --drafter) in every trainer; `suffix` ends its
    label (eagle3-both: "/eagle3", "/eagle3-lmhead")."""
    drafter = drafter or args.drafter
    label = f"{t_count}-{d_count}" + (f"/{transport}" if args.device == "cuda" else "") + suffix
    d = tempfile.mkdtemp(prefix=f"split{t_count}-{d_count}-{transport}-{drafter}-", dir=workdir)
    targets = pool.take(t_count)
    addrs = [t.address for t in targets]
    per = -(-args.tokens_per_split // d_count)
    warm = -(-args.warmup_tokens // d_count)
    cmds = [trainer_cmd(args, f"trainer{j}", addrs, per, warm, drafter, 100 * j + 7,
                        trainer_gpu(args, t_count, j),
                        transport if args.device == "cuda" else "")
            for j in range(d_count)]
    with GpuMonitor(args.gpu_sample_s) as gpus:
        reports, target_cpu = run_trainers(cmds, d, args.split_timeout_s,
                                           [t.proc.pid for t in targets])
    target_rss = {t.address: t.peak_rss_bytes() for t in targets}
    start = min(r["start"] for r in reports)
    end = max(r["end"] for r in reports)
    wall = end - start
    tokens = sum(r["tokens"] for r in reports)
    steady, steady_s = steady_rate(reports, t_count)
    fwd = {a: sum(r["forward_ms_by_target"].get(a, 0.0) for r in reports) / 1000.0 for a in addrs}
    ttok = {a: sum(r["tokens_by_target"].get(a, 0) for r in reports) for a in addrs}
    sub = sum(r["tokens_submitted"] for r in reports)
    dlv = sum(r["tokens_delivered"] for r in reports)
    gpu = gpus.report()
    if gpu is not None:
        roles = {str(t.index): f"target {t.address}" for t in targets}
        for j, r in enumerate(reports):
            g = str(trainer_gpu(args, t_count, j))
            roles[g] = f"{roles[g]} + {r['trainer']}" if g in roles else r["trainer"]
        for g, v in gpu.items():
            v["role"] = roles.get(g, "idle")
    if args.device == "cuda":
        peak = {**{f"gpu {g}": v["peak_memory_bytes"] for g, v in (gpu or {}).items()
                   if v.get("role") != "idle"},
                **{f"{r['trainer']} torch": r.get("cuda_peak_allocated_bytes") for r in reports}}
        peak_kind = "nvidia-smi memory.used peak per GPU; torch.cuda.max_memory_allocated per trainer"
    else:
        peak = {**{f"target {a}": v for a, v in target_rss.items()},
                **{r["trainer"]: r["peak_rss_bytes"] for r in reports}}
        peak_kind = "ru_maxrss / VmHWM (host RSS; targets are reused across splits)"
    return {
        "split": label, "targets": t_count, "trainers": d_count, "transport": transport,
        "drafter": drafter, "bytes_per_token": reports[0].get("bytes_per_token"),
        "wall_s": wall, "tokens": tokens,
        "tokens_per_s": steady or tokens / wall, "steady_window_s": steady_s,
        "end_to_end_tokens_per_s": tokens / wall,
        "sum_trainer_tokens_per_s": sum(r["tokens_per_s"] for r in reports),
        "target_utilisation": {a: fwd[a] / wall for a in addrs},
        "target_utilisation_mean": sum(fwd.values()) / wall / t_count,
        "tokens_by_target": ttok,
        "drafter_utilisation": {r["trainer"]: r["drafter_busy"] for r in reports},
        "drafter_utilisation_mean": sum(r["drafter_busy"] for r in reports) / d_count,
        "copy_s_by_trainer": {r["trainer"]: r.get("copy_s", 0.0) for r in reports},
        "transfer_GB_per_s": sum(r["bytes_received"] for r in reports) / wall / 1e9,
        "bytes_received": sum(r["bytes_received"] for r in reports),
        "queue_depth": {r["trainer"]: [[round(r["start"] - start + ts, 3), q]
                                       for ts, q in r["queue_depth"]] for r in reports},
        "peak_memory_bytes": peak, "peak_memory_kind": peak_kind,
        "target_peak_rss_bytes": target_rss,
        # The eagle3 kinds' tally of the tensors each trainer's path holds (split_trainer's
        # held_bytes); None for the other kinds.
        "trainer_held_bytes": {r["trainer"]: r.get("held_total_bytes") for r in reports},
        "gpus": gpu,
        "host_cpu_utilisation": (target_cpu + sum(r["cpu_s"] for r in reports))
                                / wall / (os.cpu_count() or 1),
        "tokens_submitted": sub, "tokens_delivered": dlv,
        "feed_tokens_delivered": sum(r["feed_tokens_delivered"] for r in reports),
        "feed_failed": sum(r["feed_failed"] for r in reports),
        "feed_resent": sum(r["feed_resent"] for r in reports),
        "per_trainer": [{k: r.get(k) for k in ("trainer", "tokens", "wall_s", "tokens_per_s",
                                               "drafter_busy", "drafter_tokens_per_s", "copy_s",
                                               "tokens_submitted", "tokens_delivered",
                                               "cuda_peak_allocated_bytes", "transport")}
                        for r in reports],
    }


# ---------------------------------------------------------------------------- output

def fmt_bytes(n):
    return "-" if n is None else f"{n / 2**20:,.0f}M"


def fmt_mem(n):
    """Bytes as GiB or MiB with one decimal ("-" for none; "0" for none held)."""
    if n is None:
        return "-"
    if n == 0:
        return "0"
    return f"{n / 2**30:,.1f}G" if n >= 2**30 else f"{n / 2**20:,.1f}M"


def peaks(r):
    """(largest target peak, largest trainer peak) in bytes: GPU memory.used in cuda mode (a
    shared GPU counts as the target's), host RSS in CPU mode."""
    if r.get("gpus"):
        tgt = [v["peak_memory_bytes"] for v in r["gpus"].values() if v["role"].startswith("target")]
        trn = [v["peak_memory_bytes"] for v in r["gpus"].values()
               if v["role"] not in ("idle",) and not v["role"].startswith("target")]
    else:
        mem = r["peak_memory_bytes"]
        tgt = [v or 0 for k, v in mem.items() if k.startswith("target ")]
        trn = [v or 0 for k, v in mem.items() if not k.startswith("target ")]
    return max(tgt, default=None), max(trn, default=None)


def print_table(results):
    w = max([10] + [len(r["split"]) for r in results])
    hdr = (f"{'split':>{w}} {'tok/s':>9} {'e2e':>9} {'predicted':>9} {'ratio':>6} "
           f"{'bottleneck':>10} {'tgt util':>8} {'drf util':>8} {'gpu util':>8} {'q mean':>6} "
           f"{'q max':>5} {'GB/s':>7} {'host cpu':>8} {'peak tgt':>8} {'peak trn':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        qs = [q for series in r["queue_depth"].values() for _, q in series]
        tgt, trn = peaks(r)
        gpu = r.get("gpus") or {}
        used = [v["utilization_gpu_mean"] for v in gpu.values() if v["role"] != "idle"]
        gutil = f"{sum(used) / len(used):.0%}" if used else "-"
        print(f"{r['split']:>{w}} {r['tokens_per_s']:>9,.0f} {r['end_to_end_tokens_per_s']:>9,.0f} "
              f"{r['predicted_tokens_per_s']:>9,.0f} "
              f"{r['measured_over_predicted']:>6.2f} {r['predicted_bottleneck']:>10} "
              f"{r['target_utilisation_mean']:>8.0%} {r['drafter_utilisation_mean']:>8.0%} "
              f"{gutil:>8} {sum(qs) / max(1, len(qs)):>6.1f} {max(qs, default=0):>5} "
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
    ax1.set_xticklabels(names, rotation=30 if len(names) > 4 else 0, fontsize=8)
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

def parse_splits(text, gpus, device="cpu"):
    """[(T, D), ...] from "5-3,4-4". cuda with --gpus 1 is the shared mode: 1 target and 1
    trainer on the one GPU, so 1-1 is its only split."""
    out = []
    shared = device == "cuda" and gpus == 1
    for part in text.split(","):
        try:
            t, d = (int(v) for v in part.strip().split("-"))
        except ValueError:
            raise SystemExit(f"--splits: {part!r} is not T-D (e.g. 5-3)")
        if shared:
            if (t, d) != (1, 1):
                raise SystemExit(f"--splits: {part} with --device cuda --gpus 1: one GPU is "
                                 f"shared by 1 target and 1 trainer, so the only split is 1-1")
        elif t < 1 or d < 1 or t + d != gpus:
            raise SystemExit(f"--splits: {part} needs T >= 1, D >= 1 and T + D = --gpus ({gpus})")
        out.append((t, d))
    return out


def parse_transports(text, device, gpus):
    """--transport: grpc | nccl | auto | both (grpc then nccl) -> the list to run."""
    choices = {"grpc": ["grpc"], "nccl": ["nccl"], "auto": ["auto"], "both": ["grpc", "nccl"]}
    if text not in choices:
        raise SystemExit(f"--transport: {text!r} is not one of {', '.join(choices)}")
    got = choices[text]
    if device == "cpu" and got != ["grpc"]:
        raise SystemExit(f"--transport {text}: the CPU mode has no GPUs to move states between; "
                         f"only grpc runs there")
    if device == "cuda" and gpus == 1 and "nccl" in got:
        raise SystemExit(f"--transport {text}: with --gpus 1 the target and the trainer share "
                         f"one GPU, and NCCL refuses two ranks on one device; use grpc")
    return got


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=0,
                   help="devices to split (T + D); --device cuda --gpus 1: shared smoke mode")
    p.add_argument("--splits", default="", help="comma-separated T-D, e.g. 5-3,4-4")
    p.add_argument("--model", default="tiny-random",
                   help="draftfeed-target --model (e.g. random:qwen3.6-27b in cuda mode)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: emulated devices; cuda: one process per real GPU")
    p.add_argument("--transport", default=None,
                   help="grpc (default) | nccl | auto | both (cuda mode: every split once per "
                        "transport); with --predict: one of the calibration's (default: all)")
    p.add_argument("--max-batch-tokens", type=int, default=16384,
                   help="cuda mode: the targets' --max_batch_tokens (token budget of a batch)")
    p.add_argument("--tokens-per-split", type=int, default=20000, help="measured tokens per split")
    p.add_argument("--warmup-tokens", type=int, default=2000, help="warm-up tokens per split")
    p.add_argument("--drafter", choices=DRAFTERS, default="synthetic",
                   help="the trainers' drafter; eagle3-both calibrates, predicts and runs "
                        "eagle3 (target-side probabilities) and eagle3-lmhead (lm_head in the "
                        "trainer) side by side")
    p.add_argument("--drafter-flops-per-token", type=float, default=2e5,
                   help="synthetic drafter's load (FLOPs per token, forward matmuls)")
    p.add_argument("--drafter-layers", type=int, default=1,
                   help="dflash-full: decoder layers at the target's width")
    p.add_argument("--draft-vocab", type=int, default=32768, help="dflash-full: lm head size")
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="eagle3 drafters: draft vocabulary size (0: min(32000, target vocab))")
    p.add_argument("--probs-encoding", default="bf16", choices=["bf16", "fp8_e4m3"],
                   help="eagle3: the draft probabilities on the wire")
    p.add_argument("--ttt-steps", type=int, default=1,
                   help="eagle3 drafters: training-time-test steps per batch")
    p.add_argument("--drafter-rate", type=float, default=0.0,
                   help="CPU mode: cap each drafter at this tokens/s (emulated device speed); "
                        "0: compute-bound only")
    p.add_argument("--target-rate", type=float, default=3000.0,
                   help="CPU mode: each target's --throttle_tokens_per_s (emulated device speed)")
    p.add_argument("--layers", default=None,
                   help="layer ids the trainers ask for, or dflash[:K]: DFlash's K (5) layers "
                        "of the target's depth, or eagle3: EAGLE-3's 3 feature layers (default: "
                        "eagle3 for the eagle3 drafters, else 1,2,3)")
    p.add_argument("--batch-tokens", type=int, default=0,
                   help="packing token budget (default: 512 on CPU, --max-batch-tokens on cuda)")
    p.add_argument("--max-seq-len", type=int, default=0,
                   help="synthetic sequences are 16..this many tokens (default 256 CPU, 2048 cuda)")
    p.add_argument("--calibrate-tokens", type=int, default=0,
                   help="tokens for the single-target measurement (default: ~1 s of it on CPU, "
                        "4 batches on cuda)")
    p.add_argument("--calibrate-s", type=float, default=1.0, help="drafter calibration time")
    p.add_argument("--split-timeout-s", type=float, default=600.0)
    p.add_argument("--target-start-timeout-s", type=float, default=0,
                   help="default 60 s on CPU, 300 s on cuda (random 27B weights take 10-20 s)")
    p.add_argument("--gpu-sample-s", type=float, default=0.5, help="nvidia-smi sampling period")
    p.add_argument("--binary", default=str(REPO / "build" / "bin" / "draftfeed-target"))
    p.add_argument("--out", default="splits-out", help="directory for splits.json / splits.png")
    p.add_argument("--predict", type=int, default=0, metavar="N",
                   help="run nothing: print every T-D split of N GPUs predicted from "
                        "--calibration FILE (or from --target/--drafter-tokens-per-s)")
    p.add_argument("--calibration", default="",
                   help="with --predict: a file --save_calibration wrote, or a splits.json")
    p.add_argument("--save-calibration", "--save_calibration", dest="save_calibration",
                   default="", metavar="FILE",
                   help="write the calibration (measured, or built from the rates given) here")
    p.add_argument("--target-tokens-per-s", type=float, default=0.0,
                   help="with --predict: one target GPU's tokens/s (instead of --calibration)")
    p.add_argument("--drafter-tokens-per-s", type=float, default=0.0,
                   help="with --predict: one drafter GPU's tokens/s (instead of --calibration)")
    p.add_argument("--link-tokens-per-s", type=float, default=None,
                   help="with --predict and rates: one target->trainer link's tokens/s "
                        "(default: no link term)")
    p.add_argument("--rates-transport", default="nccl",
                   help="with --predict and rates: the transport they were measured over")
    args = p.parse_args(argv)

    if args.predict:
        return predict_main(args)
    args.transport = args.transport or "grpc"
    kinds = drafter_kinds(args.drafter)
    if args.layers is None:
        args.layers = "eagle3" if kinds[0] in EAGLE3_KINDS else "1,2,3"
    if not args.gpus or not args.splits:
        p.error("--gpus and --splits are required (unless --predict N)")
    cuda = args.device == "cuda"
    mode = ("cuda-shared" if args.gpus == 1 else "cuda") if cuda else "cpu-emulated"
    splits = parse_splits(args.splits, args.gpus, args.device)
    transports = parse_transports(args.transport, args.device, args.gpus)
    args.batch_tokens = args.batch_tokens or (args.max_batch_tokens if cuda else 512)
    args.max_seq_len = args.max_seq_len or (2048 if cuda else 256)
    args.target_start_timeout_s = args.target_start_timeout_s or (300.0 if cuda else 60.0)
    if cuda and args.batch_tokens > args.max_batch_tokens:
        raise SystemExit(f"--batch-tokens {args.batch_tokens} exceeds the targets' "
                         f"--max-batch-tokens {args.max_batch_tokens}")
    if cuda and shutil.which("nvidia-smi") is None:
        print("splits.py: --device cuda but no nvidia-smi here: per-GPU memory and utilisation "
              "will be missing", file=sys.stderr)
    # Most targets first: a later split reuses running targets and stops the surplus.
    order = sorted(range(len(splits)), key=lambda i: -splits[i][0])
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="draftfeed-splits-")
    pool = TargetPool(args, workdir)
    t_start = time.time()
    results = []
    try:
        if cuda:
            print(f"splits: {args.gpus} GPU(s){' shared' if args.gpus == 1 else ''}, splits "
                  f"{args.splits}, transport {'/'.join(transports)}, model {args.model}, batch "
                  f"{args.batch_tokens} tokens, drafter {args.drafter}", flush=True)
        else:
            print(f"splits: {args.gpus} emulated devices, splits {args.splits}, model "
                  f"{args.model}, target rate {args.target_rate:,.0f} tok/s, drafter "
                  f"{args.drafter}"
                  + (f" ({args.drafter_flops_per_token:.3g} FLOPs/token)"
                     if args.drafter == "synthetic" else "")
                  + (f" capped at {args.drafter_rate:,.0f} tok/s" if args.drafter_rate else ""),
                  flush=True)
        cal = calibrate(args, pool, workdir, transports)
        cals = drafter_calibrations(cal) if len(kinds) > 1 else {args.drafter: cal}
        for kind, c in cals.items():
            links = "; ".join(
                f"{tr} link {v['link_tokens_per_s']:,.0f} tok/s" if v["link_tokens_per_s"]
                else f"{tr} link too fast to time" for tr, v in c["link_by_transport"].items())
            mem = c.get("drafter_trainer_bytes")
            print(f"advisor: {kind + ': ' if len(kinds) > 1 else ''}one target "
                  f"{c['target_tokens_per_s']:,.0f} tok/s; one drafter "
                  f"{c['drafter_tokens_per_s']:,.0f} tok/s ({c['drafter_step_ms']:.1f} ms per "
                  f"{args.batch_tokens}-token step, {c['drafter_gflops_per_s']:.2f} GFLOP/s"
                  + (f", +{c['drafter_h2d_ms']:.1f} ms host->GPU copy over gRPC" if cuda else "")
                  + (f", trainer memory {fmt_mem(mem)}" if mem is not None else "")
                  + f"); {links}"
                  + (f" at {c['bytes_per_token']:,} B/token" if c.get("bytes_per_token") else "")
                  + ("" if cuda else f"; feed costs {c['pipeline_cpu_s_per_token'] * 1e6:.0f} "
                                     f"host CPU-us per token"), flush=True)
        drafters = drafters_summary(cal, transports)
        print_drafters(drafters, args.batch_tokens)
        if args.save_calibration:
            save_calibration(args.save_calibration, calibration_doc(
                cal, mode, f"bench/splits.py --device {args.device} --gpus {args.gpus} "
                f"--model {args.model}", measured_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                     time.gmtime()),
                cpu_count=os.cpu_count(), drafter=args.drafter, batch_tokens=args.batch_tokens,
                layers=args.layers))
        predictions = predict_drafters(cal, args.gpus, transports, not cuda,
                                       shared=cuda and args.gpus == 1, label=cuda)
        print_predictions(predictions)
        best = max(predictions, key=lambda q: q["tokens_per_s"]) if predictions else None
        by_index = {}
        for i in order:
            t, d = splits[i]
            for tr in transports:
                for kind, c in cals.items():
                    suffix = f"/{kind}" if len(kinds) > 1 else ""
                    print(f"split {t}-{d}{'/' + tr if cuda else ''}{suffix}: running ...",
                          flush=True)
                    r = run_split(args, pool, t, d, tr, workdir, kind, suffix)
                    rate, neck, limits = predict(c, t, d, not cuda, tr, cuda and args.gpus == 1)
                    r.update(predicted_tokens_per_s=rate, predicted_bottleneck=neck,
                             predicted_limits=limits,
                             measured_over_predicted=r["tokens_per_s"] / rate)
                    by_index.setdefault(i, []).append(r)
                    print(f"split {r['split']}: {r['tokens_per_s']:,.0f} tok/s measured "
                          f"({r['end_to_end_tokens_per_s']:,.0f} end to end), {rate:,.0f} "
                          f"predicted ({neck}-bound), ratio {r['measured_over_predicted']:.2f}",
                          flush=True)
        results = [r for i in range(len(splits)) for r in by_index.get(i, [])]
    finally:
        pool.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    print()
    print_table(results)
    if best:
        measured_best = max(results, key=lambda r: r["tokens_per_s"])
        print(f"\nadvisor: best split {best['split']} (predicted {best['tokens_per_s']:,.0f} tok/s, "
              f"{best['bottleneck']}-bound); best measured {measured_best['split']} "
              f"({measured_best['tokens_per_s']:,.0f} tok/s)")

    expected = [f"{t}-{d}" + (f"/{tr}" if cuda else "") + (f"/{k}" if len(kinds) > 1 else "")
                for t, d in splits for tr in transports for k in kinds]
    invariants = {
        "every_split_ran": [r["split"] for r in results] == expected,
        "tokens_submitted_eq_delivered": {r["split"]: r["tokens_submitted"] == r["tokens_delivered"]
                                          == r["feed_tokens_delivered"] for r in results},
        "no_failed_batches": all(r["feed_failed"] == 0 for r in results),
        "within_15_percent": {r["split"]: abs(r["measured_over_predicted"] - 1) <= 0.15
                              for r in results},
    }
    invariants["all_ok"] = (invariants["every_split_ran"] and invariants["no_failed_batches"]
                            and all(invariants["tokens_submitted_eq_delivered"].values()))
    doc = {
        "config": {**vars(args), "cpu_count": os.cpu_count(),
                   "python": sys.version.split()[0],
                   "mode": mode,
                   "transports": transports,
                   "started": t_start, "elapsed_s": time.time() - t_start},
        "advisor": {"calibration": cal, "predictions": predictions, "best": best,
                    "drafters": drafters, "best_by_drafter": best_by_drafter(predictions)},
        "splits": results,
        "invariants": invariants,
    }
    (out / "splits.json").write_text(json.dumps(doc, indent=1))
    plot(results, predictions, out / "splits.png")
    print(f"wrote {out / 'splits.json'} and {out / 'splits.png'}; invariants "
          f"{'OK' if invariants['all_ok'] else 'FAILED'} (within 15%: "
          f"{sum(invariants['within_15_percent'].values())}/{len(results)} splits)")
    return 0 if invariants["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
