"""bench/splits.py in CPU mode: 3 emulated devices, splits 2-1 and 1-2 (issue 7); the GPU
modes' argument checks, advisor terms and transport hand-over, which need no GPU (issue 8)."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from conftest import BUILD, REPO, TARGET_BIN

SPLITS = REPO / "bench" / "splits.py"
TRAINER = REPO / "bench" / "split_trainer.py"


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def python_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(BUILD / "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_splits(tmp_path, *extra):
    env = python_env()
    return subprocess.run(
        [sys.executable, str(SPLITS), "--binary", str(TARGET_BIN), "--out", str(tmp_path), *extra],
        env=env, capture_output=True, text=True, timeout=110)


def test_cpu_splits_report_invariants_and_prediction(tmp_path):
    # Targets emulate 3000 tok/s devices, drafters 2000 tok/s ones (a small real matmul load
    # padded to that rate), so both sides of the advisor's min() are in play. What is asserted
    # is what does not depend on how fast this machine runs: the bookkeeping of the run (every
    # token submitted is delivered once, counts and shapes add up) and the prediction's
    # arithmetic from the calibration the run saved. How close measured comes to predicted
    # is a timing (a loaded CI box measured 3.55x once): splits.py prints it, and the GPU runs'
    # results record it.
    cal_file = tmp_path / "calibration.json"
    proc = run_splits(tmp_path, "--gpus", "3", "--splits", "2-1,1-2", "--model", "tiny-random",
                      "--device", "cpu", "--tokens-per-split", "6000", "--warmup-tokens", "1000",
                      "--drafter", "synthetic", "--drafter-flops-per-token", "1e5",
                      "--target-rate", "3000", "--drafter-rate", "2000",
                      "--save_calibration", str(cal_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "split" in out and "predicted" in out and "bottleneck" in out  # the table

    splits = load(SPLITS, "splits_bench")
    doc = json.loads((tmp_path / "splits.json").read_text())
    res = {r["split"]: r for r in doc["splits"]}
    assert list(res) == ["2-1", "1-2"]
    assert doc["invariants"]["every_split_ran"] is True
    assert doc["invariants"]["all_ok"] is True
    adv = doc["advisor"]
    cal = adv["calibration"]
    assert cal["target_tokens_per_s"] > 0 and cal["drafter_tokens_per_s"] > 0
    for name, r in res.items():
        # Exactly once: what the trainers submitted, what they received and what the feed
        # counted as delivered are the same tokens, at least the asked-for count, none failed.
        assert r["tokens_submitted"] == r["tokens_delivered"] == r["feed_tokens_delivered"], name
        assert r["tokens"] >= 6000, name
        assert r["feed_failed"] == 0, name
        assert len(r["per_trainer"]) == r["trainers"], name
        assert sum(t["tokens"] for t in r["per_trainer"]) == r["tokens"], name
        assert all(t["tokens"] >= 6000 // r["trainers"] for t in r["per_trainer"]), name
        assert len(r["tokens_by_target"]) == r["targets"], name
        assert all(n > 0 for n in r["tokens_by_target"].values()), name  # the feed used each
        assert len(r["target_utilisation"]) == r["targets"]
        assert len(r["drafter_utilisation"]) == r["trainers"]
        assert all(u >= 0 for u in r["target_utilisation"].values()), name
        assert set(r["queue_depth"]) == {t["trainer"] for t in r["per_trainer"]}, name
        for series in r["queue_depth"].values():
            assert series and all(len(p) == 2 and p[1] >= 0 for p in series), name
            assert [p[0] for p in series] == sorted(p[0] for p in series), name
        assert all(v and v > 0 for v in r["peak_memory_bytes"].values()), name
        assert r["bytes_received"] > 0 and r["transfer_GB_per_s"] > 0
        assert r["end_to_end_tokens_per_s"] > 0 and r["steady_window_s"] > 0
        # The prediction is the advisor's formula on the saved calibration, value for value.
        t, d = r["targets"], r["trainers"]
        rate, neck, limits = splits.predict(cal, t, d, True, "grpc",
                                            cpu_count=doc["config"]["cpu_count"])
        assert (r["predicted_tokens_per_s"], r["predicted_bottleneck"]) == (rate, neck), name
        assert r["predicted_limits"] == limits, name
        assert limits["target"] == t * cal["target_tokens_per_s"], name
        assert limits["drafter"] == d * cal["drafter_tokens_per_s_by_transport"]["grpc"], name
        link = cal["link_by_transport"]["grpc"]["link_tokens_per_s"]
        assert limits.get("link") == (min(t, d) * link if link else None), name
        assert neck == min(limits, key=limits.get) and rate == limits[neck], name
        assert r["measured_over_predicted"] == r["tokens_per_s"] / rate, name

    link = cal["link_by_transport"]["grpc"]
    assert link["send_s"] >= 0 and (link["link_tokens_per_s"] is None
                                     or link["link_tokens_per_s"] > 0)
    assert [p["split"] for p in adv["predictions"]] == ["2-1", "1-2"]
    assert adv["best"] == max(adv["predictions"], key=lambda q: q["tokens_per_s"])

    # The calibration file holds the same rates, and predicts the same splits again.
    saved = json.loads(cal_file.read_text())
    assert saved["kind"] == splits.CALIBRATION_KIND and saved["mode"] == "cpu-emulated"
    for key in ("target_tokens_per_s", "drafter_tokens_per_s", "link_by_transport",
                "pipeline_cpu_s_per_token"):
        assert saved["calibration"][key] == cal[key], key
    again, mode, cpus, _ = splits.load_calibration(cal_file)
    assert mode == "cpu-emulated" and cpus == doc["config"]["cpu_count"]
    for q in adv["predictions"]:
        rate = splits.predict(again, q["targets"], q["trainers"], True, "grpc", cpu_count=cpus)[0]
        assert rate == q["tokens_per_s"], q

    png = (tmp_path / "splits.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


# The 2-GPU 27B calibration of 2026-11-30 (bench/results/splits-h200-2gpu-2026-11-30d: one
# target 11,701 tokens/s, one dflash-full drafter 48,215 over NCCL, 32,024 over gRPC with its
# host->GPU copy, gRPC link 28,714) predicts 8 GPUs. These are docs/performance.md's figures.
CAL_27B = REPO / "bench" / "results" / "splits-h200-2gpu-2026-11-30d" / "calibration.json"


def test_predict_8_gpus_from_rates():
    splits = load(SPLITS, "splits_bench")
    cal = splits.calibration_from_rates(11700, 48200)
    preds = splits.predict_all(cal, 8, ["nccl"], False)
    rate = {q["split"]: q["tokens_per_s"] for q in preds}
    assert list(rate) == [f"{t}-{8 - t}/nccl" for t in range(7, 0, -1)]
    # T x 11,700 against D x 48,200: the drafters bound only 7-1.
    assert rate == {"7-1/nccl": 48200, "6-2/nccl": 70200, "5-3/nccl": 58500,
                    "4-4/nccl": 46800, "3-5/nccl": 35100, "2-6/nccl": 23400,
                    "1-7/nccl": 11700}
    assert rate["6-2/nccl"] > rate["5-3/nccl"] > rate["4-4/nccl"]
    assert splits.best_by_transport(preds)["nccl"]["split"] == "6-2/nccl"
    assert {q["split"]: q["bottleneck"] for q in preds}["7-1/nccl"] == "drafter"
    with pytest.raises(SystemExit, match="--drafter-tokens-per-s must be > 0"):
        splits.calibration_from_rates(11700, 0)


def test_predict_8_gpus_from_the_saved_27b_calibration():
    splits = load(SPLITS, "splits_bench")
    cal, mode, _, doc = splits.load_calibration(CAL_27B)
    assert mode == "cuda" and doc["gpus"] == 2 and doc["measured_utc"].startswith("2026-11-30")
    assert round(cal["target_tokens_per_s"]) == 11701
    assert round(cal["drafter_tokens_per_s_by_transport"]["nccl"]) == 48215
    assert splits.calibration_transports(cal) == ["grpc", "nccl"]
    preds = splits.predict_all(cal, 8, ["grpc", "nccl"], False)
    by = {q["split"]: q for q in preds}
    nccl = {s: round(by[f"{s}/nccl"]["tokens_per_s"]) for s in ("6-2", "5-3", "4-4")}
    assert nccl == {"6-2": 70207, "5-3": 58506, "4-4": 46805}  # 6, 5, 4 x 11,701
    assert nccl["6-2"] > nccl["5-3"] > nccl["4-4"]
    best = splits.best_by_transport(preds)
    assert best["nccl"]["split"] == "6-2/nccl"
    # Over gRPC each trainer's stream carries 28,714 tokens/s, so two trainers cap 6-2 at
    # 57,428, just under 5-3's five targets (58,506).
    assert by["6-2/grpc"]["bottleneck"] == "link"
    assert round(by["6-2/grpc"]["tokens_per_s"]) == 57428
    assert best["grpc"]["split"] == "5-3/grpc"


def test_predict_cli(tmp_path):
    saved = tmp_path / "rates.json"
    proc = subprocess.run(
        [sys.executable, str(SPLITS), "--predict", "8", "--target-tokens-per-s", "11700",
         "--drafter-tokens-per-s", "48200", "--save_calibration", str(saved)],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "best split over nccl 6-2/nccl at 70,200 tok/s" in proc.stdout
    lines = [ln for ln in proc.stdout.splitlines() if "predicted" in ln]
    assert len(lines) == 7 and "6-2/nccl predicted    70,200" in lines[1]
    # The saved file predicts the same, and so does the committed 27B calibration.
    for cal in (saved, CAL_27B):
        proc = subprocess.run([sys.executable, str(SPLITS), "--predict", "8", "--calibration",
                               str(cal), "--transport", "nccl"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "best split over nccl 6-2/nccl" in proc.stdout, proc.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "draftfeed-splits-calibration",
                               "calibration": {"target_tokens_per_s": 0}}))
    proc = subprocess.run([sys.executable, str(SPLITS), "--predict", "8", "--calibration",
                           str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "calibration.target_tokens_per_s is 0, not a rate > 0" in proc.stderr
    proc = subprocess.run([sys.executable, str(SPLITS), "--splits", "1-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--gpus and --splits are required" in proc.stderr


def test_shared_gpu_mode_takes_only_split_1_1(tmp_path):
    proc = run_splits(tmp_path, "--gpus", "1", "--splits", "1-1,2-1", "--device", "cuda")
    assert proc.returncode != 0
    assert "only split is 1-1" in proc.stderr
    proc = run_splits(tmp_path, "--gpus", "1", "--splits", "1-1", "--device", "cuda",
                      "--transport", "both")
    assert proc.returncode != 0
    assert "NCCL refuses two ranks on one device" in proc.stderr


def test_transport_parsing():
    splits = load(SPLITS, "splits_bench")
    assert splits.parse_transports("both", "cuda", 2) == ["grpc", "nccl"]
    assert splits.parse_transports("auto", "cuda", 8) == ["auto"]
    assert splits.parse_transports("grpc", "cpu", 3) == ["grpc"]
    with pytest.raises(SystemExit, match="only grpc runs there"):
        splits.parse_transports("nccl", "cpu", 3)
    with pytest.raises(SystemExit, match="is not one of"):
        splits.parse_transports("tcp", "cuda", 2)
    assert splits.parse_splits("6-2,5-3,4-4,3-5", 8, "cuda") == [(6, 2), (5, 3), (4, 4), (3, 5)]
    assert splits.parse_splits("1-1", 1, "cuda") == [(1, 1)]
    with pytest.raises(SystemExit, match="T \\+ D = --gpus"):
        splits.parse_splits("1-1", 1, "cpu")  # no shared mode for emulated devices


def test_advisor_link_term():
    splits = load(SPLITS, "splits_bench")
    cal = {"target_tokens_per_s": 10000.0, "drafter_tokens_per_s": 20000.0,
           "drafter_tokens_per_s_by_transport": {"grpc": 16000.0, "nccl": 20000.0},
           "link_by_transport": {"grpc": {"link_tokens_per_s": 15000.0},
                                 "nccl": {"link_tokens_per_s": None}}}
    # gRPC: two targets make 20,000, one trainer drafts 16,000 (its copy from host memory
    # included), and one trainer's link carries 15,000: the link bounds it.
    rate, neck, limits = splits.predict(cal, 2, 1, False, "grpc")
    assert (rate, neck) == (15000.0, "link")
    assert limits == {"target": 20000.0, "drafter": 16000.0, "link": 15000.0}
    # The link scales with the smaller side: 3 targets x 3 trainers drive 3 streams at once.
    rate, neck, limits = splits.predict(cal, 3, 3, False, "grpc")
    assert limits["link"] == 45000.0 and (rate, neck) == (30000.0, "target")
    # A link too fast to time is no term at all.
    rate, neck, limits = splits.predict(cal, 3, 1, False, "nccl")
    assert "link" not in limits and (rate, neck) == (20000.0, "drafter")
    # One shared GPU: forward and drafter step take turns, 1 / (1/10,000 + 1/20,000).
    rate, neck, _ = splits.predict(cal, 1, 1, False, "nccl", shared_gpu=True)
    assert neck == "shared-gpu" and rate == pytest.approx(20000.0 / 3)
    assert splits.link_rate(49152, 2.0) == 24576.0
    assert splits.link_rate(512, 0.0) is None
    # Steady state: the first delivery opens the window and its tokens are not counted.
    reports = [{"deliveries": [[10.0, 100], [12.0, 100]]}, {"deliveries": [[11.0, 100]]}]
    assert splits.steady_rate(reports) == (100.0, 2.0)
    # Two targets fill together: their first round (10.0, 10.1) opens the window.
    reports = [{"deliveries": [[10.0, 100], [14.1, 100]]}, {"deliveries": [[10.1, 100], [14.1, 100]]}]
    assert splits.steady_rate(reports, 2) == pytest.approx((50.0, 4.0))


class FakeResult:
    def __init__(self, target, hidden):
        self.target, self._hidden, self.probes = target, hidden, 0

    @property
    def hidden(self):
        self.probes += 1
        return self._hidden if not isinstance(self._hidden, np.ndarray) else self._hidden.copy()

    def torch(self):
        torch = pytest.importorskip("torch")
        return torch.from_numpy(self._hidden).to(torch.bfloat16)


def test_trainer_takes_device_tensors_as_they_come():
    torch = pytest.importorskip("torch")
    trainer = load(TRAINER, "split_trainer_bench")
    dev = torch.device("cpu")  # stands in for the trainer's GPU
    on_dev = torch.ones(4, 2, 8, dtype=torch.bfloat16)
    host = np.ones((4, 2, 8), dtype=np.float32)
    # nccl: the tensor the feed put on the device, the very object, no copy.
    assert trainer.to_drafter(FakeResult("a", on_dev), "nccl", dev, {}) is on_dev
    # grpc: from the host buffer.
    h = trainer.to_drafter(FakeResult("a", host), "grpc", dev, {})
    assert h.dtype == torch.bfloat16 and tuple(h.shape) == (4, 2, 8)
    # nccl promised but host memory came: a clear error, not a silent copy.
    with pytest.raises(RuntimeError, match="expected the hidden states as a tensor"):
        trainer.to_drafter(FakeResult("a", host), "nccl", dev, {})
    # auto: probed once per target, then remembered.
    side = {}
    r1, r2 = FakeResult("a", host), FakeResult("a", host)
    trainer.to_drafter(r1, "auto", dev, side)
    trainer.to_drafter(r2, "auto", dev, side)
    assert side == {"a": False} and (r1.probes, r2.probes) == (1, 0)
    assert trainer.to_drafter(FakeResult("b", on_dev), "auto", dev, side) is on_dev
    assert side == {"a": False, "b": True}
    # A client whose results say where they are (Result.device, -1 = host): no probe.
    r = FakeResult("c", host)
    r.device = -1
    trainer.to_drafter(r, "auto", dev, side)
    assert r.probes == 0 and "c" not in side


def test_trainer_feed_without_transport_keyword():
    trainer = load(TRAINER, "split_trainer_bench")
    opened = []

    class OldFeed:  # the Feed before transport=/cuda_device= existed
        def __init__(self, targets, layers, prefetch=8, prefetch_bytes=1 << 30, ordered=True,
                     credits_per_target=4, **advanced):
            opened.append(advanced)

    old = types.SimpleNamespace(Feed=OldFeed, __file__="old/draftfeed/__init__.py")
    trainer.open_feed(old, ["t:1"], [1], 8, 1 << 30, 4, "grpc", 1)
    assert opened == [{}]  # grpc is what such a Feed does anyway: no keyword passed
    with pytest.raises(SystemExit, match="needs a draftfeed client whose Feed takes transport"):
        trainer.open_feed(old, ["t:1"], [1], 8, 1 << 30, 4, "nccl", 1)

    class NewFeed:
        def __init__(self, targets, layers, prefetch=8, prefetch_bytes=1 << 30, ordered=True,
                     credits_per_target=4, transport="grpc", cuda_device=None, **advanced):
            opened.append((transport, cuda_device))

    trainer.open_feed(types.SimpleNamespace(Feed=NewFeed), ["t:1"], [1], 8, 1 << 30, 4, "nccl", 3)
    assert opened[-1] == ("nccl", 3)


def test_full_width_drafter_steps_on_cpu():
    # The GPU modes' realistic drafter, at a tiny width, on an odd batch (not a multiple of the
    # 16-token draft block): it trains (loss, backward, AdamW) and reports its rate.
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(TRAINER), "--calibrate", "--drafter", "dflash-full", "--device",
         "cpu", "--hidden-size", "64", "--num-layers", "3", "--batch-tokens", "100",
         "--vocab", "500", "--draft-vocab", "256", "--drafter-layers", "2", "--calibrate-s", "0.2"],
        env=python_env(), capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["drafter_tokens_per_s"] > 0 and rep["steps"] >= 3
    assert rep["h2d_ms"] == 0.0  # no host->device copy on the CPU
    assert rep["flops_per_token"] > 6 * (3 * 64 * 64)  # at least the fc's weights


def test_bad_split_is_refused(tmp_path):
    proc = run_splits(tmp_path, "--gpus", "3", "--splits", "2-2")
    assert proc.returncode != 0
    assert "T + D = --gpus" in proc.stderr


# ---------------------------------------------------------------------------- MoE shapes

def test_layers_follow_the_targets_depth():
    splits = load(SPLITS, "splits_bench")
    # DFlash's five of the 27B's 64 layers (what the GPU runs always asked for) and of the
    # 35B-A3B's 40.
    assert splits.resolve_layers("dflash:5", 64, "m") == "1,16,31,46,61"
    assert splits.resolve_layers("dflash", 40, "m") == "1,10,19,28,37"
    assert splits.resolve_layers("dflash:3", 48, "m") == "1,23,45"
    assert splits.resolve_layers("1,16,-1", 40, "m") == "1,16,-1"
    # The 27B's ids on a 40-layer target: refused up front, naming the ones that do not exist.
    with pytest.raises(SystemExit, match="46, 61 not a layer of random:qwen3.6-35b-a3b "
                                         "\\(40 layers: 0..39"):
        splits.resolve_layers("1,16,31,46,61", 40, "random:qwen3.6-35b-a3b")
    with pytest.raises(SystemExit, match="not comma-separated layer ids"):
        splits.resolve_layers("1;2", 40, "m")
    with pytest.raises(SystemExit, match="dflash:K needs K >= 1"):
        splits.resolve_layers("dflash:0", 40, "m")
    with pytest.raises(SystemExit, match="without repeats"):
        splits.resolve_layers("dflash:5", 6, "m")


def one_gpu_splits_json(path, target, drafter, drafter_grpc, link_grpc):
    """The advisor section a `--gpus 1` run writes (mode cuda-shared, gRPC only)."""
    path.write_text(json.dumps({
        "config": {"mode": "cuda-shared", "gpus": 1, "model": "random:qwen3.6-35b-a3b",
                   "drafter": "dflash-full", "drafter_layers": 5, "batch_tokens": 49152,
                   "layers": "1,10,19,28,37", "cpu_count": 16, "started": 1764590000.0},
        "advisor": {"calibration": {
            "target_tokens_per_s": target, "drafter_tokens_per_s": drafter,
            "drafter_tokens_per_s_by_transport": {"grpc": drafter_grpc},
            "link_by_transport": {"grpc": {"link_tokens_per_s": link_grpc}}}}}))


def test_predict_8_gpus_from_a_one_gpu_calibration(tmp_path):
    splits = load(SPLITS, "splits_bench")
    cal_json = tmp_path / "splits.json"
    one_gpu_splits_json(cal_json, 60000.0, 150000.0, 90000.0, 70000.0)
    saved = tmp_path / "again.json"
    proc = subprocess.run([sys.executable, str(SPLITS), "--predict", "8", "--calibration",
                           str(cal_json), "--save_calibration", str(saved)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "nccl from a one-GPU calibration" in out
    # NCCL: the drafter's own 150,000 tokens/s, no link term; gRPC: its measured terms.
    assert "6-2/nccl predicted   300,000 tok/s, drafter-bound (target 360,000, drafter 300,000)" \
        in out, out
    assert "5-3/nccl predicted   300,000 tok/s, target-bound (target 300,000, drafter 450,000)" \
        in out, out
    assert "4-4/nccl predicted   240,000" in out and "3-5/nccl predicted   180,000" in out
    assert "6-2/grpc predicted   140,000 tok/s, link-bound" in out, out
    assert "best split over nccl 6-2/nccl at 300,000" in out  # a tie goes to more targets
    # The derived rates are a copy: the calibration read is unchanged, and what --save wrote
    # predicts the same again.
    cal, mode, _, _ = splits.load_calibration(cal_json)
    assert mode == "cuda-shared" and "nccl" not in cal["drafter_tokens_per_s_by_transport"]
    derived = splits.with_nccl_from_one_gpu(cal)
    assert derived["drafter_tokens_per_s_by_transport"] == {"grpc": 90000.0, "nccl": 150000.0}
    assert derived["link_by_transport"]["nccl"]["link_tokens_per_s"] is None
    again, mode, _, _ = splits.load_calibration(saved)
    assert mode == "cuda-shared"
    for t in (6, 5, 4, 3):
        assert splits.predict(again, t, 8 - t, False, "nccl") == \
            splits.predict(derived, t, 8 - t, False, "nccl")
    # A two-GPU calibration measured NCCL itself: nothing is derived.
    proc = subprocess.run([sys.executable, str(SPLITS), "--predict", "8", "--calibration",
                           str(CAL_27B)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "one-GPU calibration" not in proc.stdout


def test_drafter_heads_divide_at_every_width():
    trainer = load(TRAINER, "split_trainer_bench")
    assert trainer.attention_heads(5120) == (128, 40, 8)  # the 27B drafter, as before
    assert trainer.attention_heads(2048) == (128, 16, 2)  # 35B-A3B, 30B-A3B: 16 // 5 = 3 does not
    assert trainer.attention_heads(64) == (64, 1, 1)
    for h in (256, 1024, 2048, 3072, 4096, 5120):
        _, heads, kv = trainer.attention_heads(h)
        assert heads % kv == 0, h


def test_full_width_drafter_steps_at_the_moe_width():
    # The 35B-A3B's width: 16 query heads over 2 KV heads train (K and V had 15 heads after
    # repeating 3 KV heads 5 times before).
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(TRAINER), "--calibrate", "--drafter", "dflash-full", "--device",
         "cpu", "--hidden-size", "2048", "--num-layers", "5", "--batch-tokens", "32",
         "--vocab", "300", "--draft-vocab", "256", "--drafter-layers", "1", "--calibrate-s", "0"],
        env=python_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["drafter_tokens_per_s"] > 0 and rep["steps"] >= 3


def test_run_splits_gpu_smoke_command_for_the_35b_shape(tmp_path):
    # The device command's arguments, with a stand-in Python and nvidia-smi: the MoE model,
    # DFlash's layers of whatever depth, 49,152-token batches, the 8-GPU run's 5-layer drafter,
    # the calibration saved as soon as it is measured, the splits bundle's target.
    bundle = tmp_path / "bundle"
    (bundle / "bin").mkdir(parents=True)
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 0, NVIDIA H200, 143771 MiB\n")
    (fake / "py").write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    for f in ("nvidia-smi", "py"):
        (fake / f).chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", PY=str(fake / "py"),
               BUNDLE=str(bundle), MODEL="random:qwen3.6-35b-a3b", BATCH_TOKENS="49152",
               DRAFTER_LAYERS="5")
    proc = subprocess.run(["bash", str(REPO / "bench" / "run_splits_gpu.sh"), "smoke", str(out)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.splitlines()[1:]  # after nvidia-smi's line
    opts = dict(zip(argv[1::2], argv[2::2]))
    assert argv[0] == "bench/splits.py"
    assert opts["--model"] == "random:qwen3.6-35b-a3b" and opts["--layers"] == "dflash:5"
    assert opts["--gpus"] == "1" and opts["--splits"] == "1-1" and opts["--transport"] == "grpc"
    assert opts["--max-batch-tokens"] == "49152" and opts["--warmup-tokens"] == "49152"
    assert opts["--tokens-per-split"] == str(3 * 49152) and opts["--drafter-layers"] == "5"
    assert opts["--save_calibration"] == f"{out}/calibration.json"
    assert opts["--binary"] == f"{bundle}/bin/draftfeed-target"
    # Without the overrides the 27B smoke run is what it was.
    env.pop("BATCH_TOKENS"), env.pop("DRAFTER_LAYERS"), env.pop("MODEL")
    proc = subprocess.run(["bash", str(REPO / "bench" / "run_splits_gpu.sh"), "smoke", str(out)],
                          env=env, capture_output=True, text=True, timeout=60)
    argv = proc.stdout.splitlines()[1:]
    opts = dict(zip(argv[1::2], argv[2::2]))
    assert (opts["--model"], opts["--max-batch-tokens"], opts["--tokens-per-split"],
            opts["--drafter-layers"]) == ("random:qwen3.6-27b", "16384", "131072", "1")


# ---------------------------------------------------------------------------- EAGLE-3 drafters

def test_eagle3_streams_layers_and_draft_vocab():
    trainer = load(TRAINER, "split_trainer_bench")
    assert trainer.eagle3_layers(64) == [1, 31, 60]  # draftfeed.layers.eagle3(64)[:3]
    assert trainer.eagle3_layers(40) == [1, 19, 36]
    assert trainer.eagle3_layers(4) == [0, 2, 3]  # tiny-random: under the recipe's 7 layers
    with pytest.raises(ValueError, match="no 3 distinct"):
        trainer.eagle3_layers(2)
    # The draft vocabulary: deterministic, ascending, the same whatever the trainer's seed.
    a, b = trainer.draft_vocabulary(4096, 512), trainer.draft_vocabulary(4096, 512)
    assert a == b and a.size == 512 and a.target_vocab_size == 4096
    assert list(a.ids) == sorted(a.ids) and len(set(a.ids.tolist())) == 512
    assert trainer.draft_vocabulary(248320).size == 32000  # min(32000, V)
    assert trainer.draft_vocabulary(4096).size == 4096
    with pytest.raises(SystemExit, match="--draft-vocab-size 70000"):
        trainer.draft_vocabulary(248320, 70000)  # a target serves at most 65,536
    # What each stream carries per token: the link's bytes.
    H = 5120
    e3 = trainer.stream_spec("eagle3", "eagle3", 64, H, 248320)
    assert e3["layers"] == [1, 31, 60]
    assert e3["outputs"]["argmax"] is True and len(e3["outputs"]["draft_vocab"]) == 32000
    assert e3["bytes_per_token"] == 3 * H * 2 + 32000 * 2 + 4
    fp8 = trainer.stream_spec("eagle3", "eagle3", 64, H, 248320, probs_encoding="fp8_e4m3")
    assert fp8["bytes_per_token"] == 3 * H * 2 + 32000 + 4 + 4  # codes, one scale, argmax
    lm = trainer.stream_spec("eagle3-lmhead", "eagle3", 64, H, 248320)
    assert lm["layers"] == [1, 31, 60, -1] and lm["outputs"] == {}
    assert lm["bytes_per_token"] == 4 * H * 2 and lm["vocab"] == e3["vocab"]
    plain = trainer.stream_spec("hidden", "1,2,3", 64, H, 248320)
    assert plain["bytes_per_token"] == 3 * H * 2 and plain["vocab"] is None
    with pytest.raises(SystemExit, match="takes 3 feature layers"):
        trainer.stream_spec("eagle3", "1,2,-1", 64, H, 248320)
    splits = load(SPLITS, "splits_bench")
    assert splits.resolve_layers("eagle3", 64, "m") == "1,31,60"
    assert splits.resolve_layers("eagle3", 4, "m") == "0,2,3"


def test_cpu_eagle3_both_calibration_and_split(tmp_path):
    # Both EAGLE-3 trainers on the 4-layer tiny-random target (hidden 128, vocab 4096), a
    # 512-id draft vocabulary: calibrated side by side (rates, memory, what each streams),
    # predicted, and split 1-1 run once with each.
    pytest.importorskip("torch")
    cal_file = tmp_path / "calibration.json"
    proc = run_splits(tmp_path, "--gpus", "2", "--splits", "1-1", "--model", "tiny-random",
                      "--device", "cpu", "--drafter", "eagle3-both", "--tokens-per-split", "1500",
                      "--warmup-tokens", "256", "--batch-tokens", "256", "--target-rate", "3000",
                      "--draft-vocab-size", "512", "--calibrate-s", "0.5",
                      "--calibrate-tokens", "1000", "--save_calibration", str(cal_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "drafters side by side" in out and "eagle3-lmhead" in out
    print(out)  # the numbers, for whoever reads the test log (-s)

    splits = load(SPLITS, "splits_bench")
    doc = json.loads((tmp_path / "splits.json").read_text())
    assert doc["config"]["layers"] == "0,2,3"  # 3 feature layers of a 4-layer target
    adv = doc["advisor"]
    cal = adv["calibration"]
    H, V, Vd, T = 128, 4096, 512, 256
    by = cal["by_drafter"]
    assert list(by) == ["eagle3", "eagle3-lmhead"]
    e3, lm = by["eagle3"], by["eagle3-lmhead"]
    assert cal["drafter_tokens_per_s"] == e3["drafter_tokens_per_s"]  # the top level: eagle3's
    for c in (e3, lm):
        assert c["drafter_tokens_per_s"] > 0 and c["target_tokens_per_s"] > 0
        assert c["drafter_step_ms"] > 0 and c["draft_vocab_size"] == Vd
        assert c["drafter_trainer_bytes"] > 0
        assert c["drafter_trainer_bytes_kind"].startswith("tensor bytes")  # CPU: the tally
    # What each streams, as defined and as the link counted it: eagle3 3 layers + bf16 probs +
    # argmax, eagle3-lmhead 4 layers and no outputs.
    assert e3["bytes_per_token"] == 3 * H * 2 + Vd * 2 + 4
    assert lm["bytes_per_token"] == 4 * H * 2
    for c in (e3, lm):
        link = c["link_by_transport"]["grpc"]
        assert link["bytes_per_token"] == pytest.approx(c["bytes_per_token"], rel=1e-3)
        assert link["stream_bytes_per_token"] == c["bytes_per_token"]
    # The lm_head path holds the lm_head [V, H] bf16 and its [T, V] logits on top of eagle3's.
    lm_head = V * H * 2
    assert lm["drafter_lm_head_bytes"] == lm_head and e3["drafter_lm_head_bytes"] == 0
    assert lm["drafter_held_bytes"]["lm_head"] == lm_head
    assert lm["drafter_held_bytes"]["target_stage"] >= T * V * 2
    assert e3["drafter_held_bytes"]["inputs"] >= T * Vd * 4  # the probabilities it was sent
    assert lm["drafter_trainer_bytes"] >= e3["drafter_trainer_bytes"] + lm_head
    # Side by side in the report, and predictions for both.
    assert set(adv["drafters"]) == {"eagle3", "eagle3-lmhead"}
    assert adv["drafters"]["eagle3-lmhead"]["lm_head_bytes"] == lm_head
    preds = {q["split"]: q for q in adv["predictions"]}
    assert set(preds) == {"1-1/eagle3", "1-1/eagle3-lmhead"}
    cpus = doc["config"]["cpu_count"]
    for kind in ("eagle3", "eagle3-lmhead"):
        q = preds[f"1-1/{kind}"]
        assert q["drafter"] == kind and q["tokens_per_s"] > 0
        rate, neck, limits = splits.predict(by[kind], 1, 1, True, "grpc", cpu_count=cpus)
        assert (q["tokens_per_s"], q["bottleneck"], q["limits"]) == (rate, neck, limits)
        assert limits["drafter"] == by[kind]["drafter_tokens_per_s_by_transport"]["grpc"]
        assert adv["best_by_drafter"][kind]["split"] == f"1-1/{kind}"

    # The measured split ran once with each drafter and delivered every token it sent.
    res = {r["split"]: r for r in doc["splits"]}
    assert list(res) == ["1-1/eagle3", "1-1/eagle3-lmhead"]
    assert doc["invariants"]["every_split_ran"] is True and doc["invariants"]["all_ok"] is True
    for kind, want_bpt in (("eagle3", e3["bytes_per_token"]), ("eagle3-lmhead", 4 * H * 2)):
        r = res[f"1-1/{kind}"]
        assert r["drafter"] == kind and r["bytes_per_token"] == want_bpt
        assert r["tokens_submitted"] == r["tokens_delivered"] == r["feed_tokens_delivered"]
        assert r["tokens"] >= 1500 and r["feed_failed"] == 0
        assert r["tokens_per_s"] > 0 and r["bytes_received"] == r["tokens"] * want_bpt
        assert all(v and v > 0 for v in r["trainer_held_bytes"].values())
        assert r["predicted_tokens_per_s"] == preds[f"1-1/{kind}"]["tokens_per_s"]

    # The saved calibration keeps both kinds and predicts the same splits again.
    again, mode, cpus2, _ = splits.load_calibration(cal_file)
    assert mode == "cpu-emulated" and set(again["by_drafter"]) == {"eagle3", "eagle3-lmhead"}
    for q in splits.predict_drafters(again, 2, ["grpc"], True, cpu_count=cpus2, label=False):
        assert q["tokens_per_s"] == preds[q["split"]]["tokens_per_s"], q
    proc = subprocess.run([sys.executable, str(SPLITS), "--predict", "4", "--calibration",
                           str(cal_file)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "2-2/grpc/eagle3 predicted" in proc.stdout
    assert "2-2/grpc/eagle3-lmhead predicted" in proc.stdout
    assert "best split with eagle3-lmhead" in proc.stdout
