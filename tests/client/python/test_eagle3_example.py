"""client/python/examples/train_eagle3.py against real CPU targets: the EAGLE-3 drafter learns
from the target's own distributions (Feed(draft_vocab=..., argmax=True)), and its lm_head
baseline (--compare-lm-head) computes the same distributions in the trainer.

The runs are deterministic (fixed seeds, one torch thread per op here, targets that compute
the same bits every time), so the thresholds below are about how much the drafter must learn,
not about luck; the margins are still several times the batch-to-batch noise.
"""

import re
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("torch")

EXAMPLE = REPO / "client/python/examples/train_eagle3.py"
CHECKPOINT = REPO / "tests/data/models/qwen35_text"  # vocab 512, hidden 64, with its lm_head
STEP = re.compile(r"^(lm_head )?step\s+(\d+)\s+loss ([\d.]+)\s+acc0 ([\d.]+)\s+acc1 ([\d.]+)"
                  r"\s+acc2 ([\d.]+)", re.M)


def run_example(address, *args, timeout=300):
    cmd = [sys.executable, str(EXAMPLE), "--targets", address, "--log-every", "1", *args]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stdout
    return p.stdout


def steps_of(out, baseline=False):
    """{step: (loss, acc0, acc1, acc2)} of one run's per-step lines."""
    return {int(m[2]): tuple(float(x) for x in m.groups()[2:])
            for m in STEP.finditer(out) if bool(m[1]) == baseline}


def test_drafter_learns_the_tiny_targets_distributions(target):
    # 50 steps of 128 tokens (~6k tokens): on 2 CPU cores with the reference BLAS Debian's
    # torch links, a step of this drafter (D=64, 4096-wide draft head, 3 TTT steps) takes
    # ~0.3-0.5 s, so the run stays within a minute. The lr is high for a tiny, short run.
    steps = 50
    out = run_example(target.address, "--steps", str(steps), "--token-budget", "128",
                      "--dim", "64", "--lr", "1e-2", "--sequences", "512")
    assert "layers [0, 1, 2], draft vocab 4096" in out, out  # min(32000, vocab) by default
    assert "holds the target's argmax at 100.0%" in out, out  # the draft vocab is everything
    rows = steps_of(out)
    assert sorted(rows) == list(range(1, steps + 1)), out
    n = steps // 10
    first = [rows[s] for s in range(1, n + 1)]
    last = [rows[s] for s in range(steps - n + 1, steps + 1)]
    mean = lambda rs, i: sum(r[i] for r in rs) / len(rs)  # noqa: E731

    # Step-0 accuracy: matching the target's argmax among 4096 ids by chance is ~0.0002, and
    # the first 10% of the steps stay below ~0.1 (the drafter starts learning at once). The
    # target's argmax along this chain is a function of the last token at ~50% of positions
    # (measured on tiny-random), which the drafter picks up: the last 10% reach ~0.3-0.4. One
    # batch's accuracy varies by ~0.08 (about 100 positions, varied sequences), a 5-step mean
    # by ~0.035; a 0.15 margin is 4 of those below what the run shows, and clearly learning.
    acc_first, acc_last = mean(first, 1), mean(last, 1)
    assert acc_last >= acc_first + 0.15, (acc_first, acc_last, out)
    # The later TTT steps, from the drafter's own features, learn too (less is asked of them).
    for i in (2, 3):
        assert mean(last, i) >= mean(first, i) + 0.08, (i, out)
    # The loss is 3 weighted soft cross-entropies against near-uniform targets (entropy ~7.8
    # nats of log(4096) = 8.3): from ~20.5 it can fall ~1.4 at most; 0.3 is a clear decrease.
    loss_first, loss_last = mean(first, 0), mean(last, 0)
    assert loss_last <= loss_first - 0.3, (loss_first, loss_last, out)

    # The printed summary says the same.
    m = re.search(r"^accuracy step0: first ([\d.]+) -> last ([\d.]+)$", out, re.M)
    assert m, out
    assert abs(float(m[1]) - acc_first) < 2e-3 and abs(float(m[2]) - acc_last) < 2e-3, out
    assert re.search(r"^accuracy step2: first [\d.]+ -> last [\d.]+$", out, re.M), out


def test_lm_head_baseline_computes_the_distributions_the_target_sends(make_target):
    # A checkpoint target: the baseline reads the very lm_head.weight the target serves from,
    # so both paths train the same initial drafter on the same batches against the same
    # distributions: the target's from its fp32 final state, sent as bf16; the baseline's from
    # the bf16 final state on the wire. A draft vocabulary of 200 of the 512 ids makes the
    # softmax over the draft columns, their order and the position mask matter. The losses
    # then agree to ~1e-5 relative (bf16's ~0.4% per probability averages out over the
    # columns); 1e-3 would still catch a wrong column, normalisation or mask.
    ckpt = make_target(model=str(CHECKPOINT))
    out = run_example(ckpt.address, "--steps", "3", "--token-budget", "128",
                      "--sequences", "64", "--draft-vocab-size", "200", "--compare-lm-head")
    assert f"lm_head.weight from {CHECKPOINT}" in out, out
    assert "draft vocab 200" in out, out
    ours, base = steps_of(out), steps_of(out, baseline=True)
    assert sorted(ours) == sorted(base) == [1, 2, 3], out
    for s in ours:
        assert abs(ours[s][0] - base[s][0]) < 1e-3 * ours[s][0], (s, out)
    covered = [float(c) for c in re.findall(r"holds the target's argmax at ([\d.]+)%", out)]
    assert len(covered) == 2 and 5 < covered[0] < 95, out  # a real subset of the vocabulary
    assert abs(covered[0] - covered[1]) <= 1.0, out  # the same argmax, up to bf16 near-ties

    mem = {k: (float(mib), int(t)) for k, mib, t in re.findall(
        r"^memory, (target outputs|lm_head in the trainer): ([\d.]+) MiB .* T=(\d+)", out, re.M)}
    assert set(mem) == {"target outputs", "lm_head in the trainer"}, out
    # fp32 [T, Vd] probs + int32 argmax, against the fp32 lm_head [V, H] (a CPU trainer's
    # dtype) + fp32 [T, V] logits + [T, Vd] probs + int64 argmax.
    V, H, Vd = 512, 64, 200
    mib, T = mem["target outputs"]
    assert 24 <= T <= 128 and mib == pytest.approx((T * Vd * 4 + T * 4) / 2**20, abs=1e-3), out
    mib, T = mem["lm_head in the trainer"]
    assert mib == pytest.approx((V * H * 4 + T * V * 4 + T * Vd * 4 + T * 8) / 2**20,
                                abs=1e-3), out
