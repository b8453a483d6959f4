"""Many targets, many trainer ranks, and targets that die, hang, restart or join."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import draftfeed
from conftest import REPO, TargetProcess

WORKER = REPO / "tests" / "client" / "python" / "rank_worker.py"
N_BATCHES = 200


def start_rank(targets, rank, world, out, batches=N_BATCHES):
    env = dict(os.environ)
    return subprocess.Popen(
        [sys.executable, str(WORKER), "--targets", ",".join(targets), "--rank", str(rank),
         "--world", str(world), "--batches", str(batches), "--out", out],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(proc, timeout=300):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.fixture(scope="module")
def reference():
    """Digests of every batch from a single target, one rank."""
    t = TargetProcess()
    try:
        out = tempfile.mktemp(suffix=".json")
        finish(start_rank([t.address], 0, 1, out))
        return json.load(open(out))["digests"]
    finally:
        t.kill()


def run_ranks(targets, world=2, during=None):
    outs = [tempfile.mktemp(suffix=".json") for _ in range(world)]
    procs = [start_rank(targets, r, world, outs[r]) for r in range(world)]
    if during:
        during(procs)
    logs = [finish(p) for p in procs]
    results = [json.load(open(o)) for o in outs]
    digests = {}
    for r in results:
        for k, v in r["digests"].items():
            assert k not in digests, f"batch {k} delivered to two ranks"
            digests[k] = v
    return digests, results, logs


def wait_for_progress(proc_list, lines=10, timeout=120):
    """Blocks until the first rank has printed `lines` batch lines."""
    deadline = time.time() + timeout
    seen = 0
    while seen < lines and time.time() < deadline:
        line = proc_list[0].stdout.readline()
        if line.startswith("rank"):
            seen += 1
    assert seen >= lines


def test_three_targets_two_ranks_every_batch_once_and_bit_identical(make_target, reference):
    targets = [make_target() for _ in range(3)]
    digests, results, _ = run_ranks([t.address for t in targets])
    assert digests == reference
    used = set()
    for r in results:
        for ts in r["stats"]["targets"]:
            if ts["delivered_batches"] > 0:
                used.add(ts["address"])
    assert used == {t.address for t in targets}


def test_kill_9_one_target_mid_run_loses_nothing(make_target, reference):
    targets = [make_target() for _ in range(3)]

    def kill_one(procs):
        wait_for_progress(procs, lines=15)
        targets[1].proc.send_signal(signal.SIGKILL)

    digests, results, _ = run_ranks([t.address for t in targets], during=kill_one)
    assert digests == reference
    assert targets[1].proc.wait(5) == -signal.SIGKILL
    lost = [ts for r in results for ts in r["stats"]["targets"]
            if ts["address"] == targets[1].address]
    assert all(ts["state"] in ("down", "connecting") for ts in lost)
    assert any(ts["failures"] >= 1 for ts in lost)


def tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 4096, size=n, dtype=np.int32)


def test_target_added_mid_run_receives_work(make_target):
    a = make_target()
    with draftfeed.Feed(targets=[a.address], layers=[-1], prefetch=6, credits_per_target=3) as feed:
        first = list(feed.map([(tokens(40, i), [40]) for i in range(10)]))
        b = make_target()
        feed.add_target(b.address)
        deadline = time.time() + 30
        while time.time() < deadline:
            if any(t["address"] == b.address and t["state"] == "live" for t in feed.stats()["targets"]):
                break
            time.sleep(0.05)
        rest = list(feed.map([(tokens(40, i), [40]) for i in range(10, 40)]))
        stats = feed.stats()
    assert [r.batch_id for r in first + rest] == list(range(1, 41))
    per = {t["address"]: t for t in stats["targets"]}
    assert per[b.address]["delivered_batches"] > 0
    assert per[a.address]["delivered_batches"] > 0


def test_target_with_other_model_added_later_is_refused(make_target):
    a = make_target()
    other = make_target(model="tiny-random-qwen3")
    with draftfeed.Feed(targets=[a.address], layers=[0, -1]) as feed:
        feed.add_target(other.address)
        deadline = time.time() + 30
        state = None
        while time.time() < deadline:
            state = {t["address"]: t for t in feed.stats()["targets"]}[other.address]
            if state["state"] == "refused":
                break
            time.sleep(0.05)
        assert state["state"] == "refused"
        assert "tiny-random-qwen3" in state["last_error"] and "tiny-random:0" in state["last_error"]
        results = list(feed.map([(tokens(20, i), [20]) for i in range(5)]))
        assert {r.target for r in results} == {a.address}


def test_hung_target_is_bypassed(make_target):
    a, b = make_target(), make_target()
    with draftfeed.Feed(targets=[a.address, b.address], layers=[-1], prefetch=4,
                        credits_per_target=2, batch_timeout_s=1.5) as feed:
        list(feed.map([(tokens(30, i), [30]) for i in range(4)]))
        b.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.time()
            results = list(feed.map([(tokens(30, i), [30]) for i in range(4, 24)]))
            elapsed = time.time() - t0
            stats = feed.stats()
        finally:
            b.proc.send_signal(signal.SIGCONT)
    assert [r.batch_id for r in results] == list(range(5, 25))
    assert elapsed < 30
    per = {t["address"]: t for t in stats["targets"]}
    assert per[b.address]["failures"] >= 1
    assert "no progress" in per[b.address]["last_error"]


def test_restarted_target_rejoins(make_target):
    a, b = make_target(), make_target()
    port = b.port
    with draftfeed.Feed(targets=[a.address, b.address], layers=[-1], prefetch=4,
                        reconnect_backoff_max_s=0.5) as feed:
        list(feed.map([(tokens(30, i), [30]) for i in range(6)]))
        b.kill()
        list(feed.map([(tokens(30, i), [30]) for i in range(6, 12)]))
        b2 = make_target(extra=(f"--listen=127.0.0.1:{port}",))
        deadline = time.time() + 30
        while time.time() < deadline:
            st = {t["address"]: t for t in feed.stats()["targets"]}[b.address]
            if st["state"] == "live":
                break
            time.sleep(0.1)
        assert st["state"] == "live"
        before = st["delivered_batches"]
        list(feed.map([(tokens(30, i), [30]) for i in range(12, 40)]))
        after = {t["address"]: t for t in feed.stats()["targets"]}[b.address]["delivered_batches"]
    assert after > before


def test_all_targets_down_errors_within_the_wait(make_target):
    a, b = make_target(), make_target()
    feed = draftfeed.Feed(targets=[a.address, b.address], layers=[-1], prefetch=4,
                          unavailable_timeout_s=2.0)
    list(feed.map([(tokens(30, i), [30]) for i in range(4)]))
    a.kill()
    b.kill()
    feed.submit(tokens(30, 99), [30])
    t0 = time.time()
    with pytest.raises(draftfeed.DraftfeedError) as e:
        feed.next()
    waited = time.time() - t0
    assert e.value.code_name == "UNAVAILABLE"
    assert a.address in str(e.value) and b.address in str(e.value)
    assert waited < 10
    with pytest.raises(draftfeed.DraftfeedError):
        feed.submit(tokens(30, 100), [30])
    feed.close()


def test_unordered_returns_every_batch_once(make_target):
    a, b = make_target(), make_target(extra=("--throttle_tokens_per_s=2000",))
    with draftfeed.Feed(targets=[a.address, b.address], layers=[-1], prefetch=8,
                        ordered=False) as feed:
        ids = [r.batch_id for r in feed.map([(tokens(40, i), [40]) for i in range(30)])]
    assert sorted(ids) == list(range(1, 31))


def test_second_sigterm_mid_drain_batches_are_resent_and_arrive_once(make_target):
    """A second SIGTERM during the drain exits the target at once (status 1), abandoning the
    batches it had accepted. The client must re-send them to the other target: every batch
    arrives exactly once, bit-identical to a run against one healthy target."""
    import hashlib
    import re
    n = 16
    batches = [(tokens(64, 500 + i), [40, 24]) for i in range(n)]

    def digests_of(results):
        return [hashlib.sha256(r.hidden_bits.tobytes()).hexdigest() for r in results]

    healthy = make_target()
    with draftfeed.Feed(targets=[healthy.address], layers=[0, -1]) as feed:
        reference = digests_of(feed.map(batches))
    healthy.kill()

    # 64 tokens at 100 tokens/s: each batch runs 0.64 s, so the one the signals hit has
    # accepted batches left whatever the timing.
    a, b = (make_target(extra=("--throttle_tokens_per_s=100",)) for _ in range(2))
    with draftfeed.Feed(targets=[a.address, b.address], layers=[0, -1], prefetch=n,
                        credits_per_target=2, unavailable_timeout_s=30.0) as feed:
        for t, lens in batches:
            feed.submit(t, lens)
        results = [feed.next()]
        deadline = time.time() + 60

        def on_b():
            return {t["address"]: t for t in feed.stats()["targets"]}[b.address]

        while not (on_b()["delivered_batches"] >= 1 and on_b()["outstanding_batches"] >= 1):
            assert time.time() < deadline, feed.stats()
            time.sleep(0.01)
        b.proc.send_signal(signal.SIGTERM)
        while "SIGTERM received, finishing accepted batches" not in b.output():
            assert time.time() < deadline, b.output()
            time.sleep(0.01)
        abandoned = on_b()["outstanding_batches"]  # accepted or sent, not yet delivered
        b.proc.send_signal(signal.SIGTERM)
        assert b.proc.wait(10) == 1, b.output()
        assert abandoned >= 1
        m = re.search(r"second SIGTERM during the drain: exiting now, abandoning 1 open streams "
                      r"and (\d+) queued batches", b.output())
        assert m, b.output()
        results += [feed.next() for _ in range(n - 1)]
        stats = feed.stats()
        assert stats["outstanding"] == 0
    assert [r.batch_id for r in results] == list(range(1, n + 1))
    assert digests_of(results) == reference
    per = {t["address"]: t for t in stats["targets"]}
    # The batches lost with b were delivered by a instead, none twice.
    assert stats["resent"] >= abandoned, stats
    assert per[b.address]["delivered_batches"] + per[a.address]["delivered_batches"] == n
    assert stats["delivered"] == n and stats["failed"] == 0
