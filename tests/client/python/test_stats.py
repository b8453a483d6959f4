"""Feed.stats(): since-start and windowed rates, the flat form, the numbers after close(), and
Feed(progress=True)."""

import sys

import numpy as np
import pytest

import draftfeed
from draftfeed.stats import RateWindow, flatten

LENS = [[5], [1, 2, 3], [64, 65], [200], [17, 1]]


def batches():
    rng = np.random.default_rng(3)
    return [(rng.integers(0, 4096, size=sum(l), dtype=np.int32), l) for l in LENS]


def test_rate_window_takes_its_base_from_the_window_start():
    w = RateWindow(window_s=10, start=0.0, zero={"n": 0})
    for t in range(0, 31):  # one count a second for 30 s
        w.record(float(t), {"n": t})
    rates, span = w.rates(30.0, {"n": 30})
    # The base is the newest sample at or before 30 - 10 = 20 s.
    assert span == pytest.approx(10.0)
    assert rates["n"] == pytest.approx(1.0)
    # A burst of 50 in the last second shows in the window rate.
    rates, span = w.rates(31.0, {"n": 80})
    assert span == pytest.approx(10.0)
    assert rates["n"] == pytest.approx((80 - 21) / 10)


def test_rate_window_bounds_its_samples():
    w = RateWindow(window_s=1.0, start=0.0, zero={"n": 0})
    for i in range(100_000):
        w.record(i * 1e-4, {"n": i})  # 10 s of a batch every 0.1 ms
    assert len(w._samples) <= 66
    with pytest.raises(ValueError, match="window_s=0 must be > 0"):
        RateWindow(window_s=0)


def test_rate_window_before_time_passes_is_zero():
    w = RateWindow(window_s=5, start=2.0, zero={"n": 0})
    assert w.rates(2.0, {"n": 4}) == ({"n": 0.0}, 0.0)


def test_flatten_keeps_numbers_one_level_deep():
    s = {"delivered": 3, "tokens_per_s": 1.5, "closed": True, "targets": [
        {"address": "h:1", "state": "live", "delivered_batches": 3, "last_error": "",
         "transport": "grpc"},
        {"address": "h:2", "state": "down", "delivered_batches": 0, "last_error": "x",
         "transport": ""}]}
    assert flatten(s) == {"delivered": 3, "tokens_per_s": 1.5, "closed": 1,
                          "target.h:1.delivered_batches": 3, "target.h:1.live": 1,
                          "target.h:2.delivered_batches": 0, "target.h:2.live": 0}


def test_stats_rates_flat_and_after_close(target):
    feed = draftfeed.Feed(targets=[target.address], layers=[1, -1], prefetch=2,
                          stats_window_s=600)
    results = list(feed.map(batches()))
    s = feed.stats()
    n_tokens = sum(map(sum, LENS))
    n_bytes = sum(r.num_tokens * r.bytes_per_token for r in results)
    assert s["delivered"] == 5 and s["tokens_delivered"] == n_tokens
    assert s["closed"] is False
    assert s["tokens_per_s"] == pytest.approx(n_tokens / s["elapsed_s"])
    assert s["batches_per_s"] == pytest.approx(5 / s["elapsed_s"])
    assert s["bytes_per_s"] == pytest.approx(s["bytes_received"] / s["elapsed_s"])
    # The window (600 s) holds the whole run: its rates times its span are the totals.
    assert s["window_s"] > 0
    assert s["window_batches_per_s"] * s["window_s"] == pytest.approx(5)
    assert s["window_tokens_per_s"] * s["window_s"] == pytest.approx(n_tokens)
    assert s["window_bytes_per_s"] * s["window_s"] == pytest.approx(n_bytes)
    assert n_bytes == s["bytes_received"]

    flat = feed.stats(flat=True)
    addr = target.address
    assert flat[f"target.{addr}.delivered_batches"] == 5
    assert flat[f"target.{addr}.delivered_tokens"] == n_tokens
    assert flat[f"target.{addr}.live"] == 1
    assert flat["delivered"] == 5 and "targets" not in flat
    assert all(isinstance(v, (int, float)) for v in flat.values())

    feed.close()
    final = feed.stats()
    assert final["closed"] is True
    assert final["delivered"] == 5 and final["tokens_delivered"] == n_tokens
    assert final["outstanding"] == 0
    # Frozen at close(): asking again later gives the same numbers.
    again = feed.stats()
    assert again == final
    assert feed.stats(flat=True)[f"target.{addr}.delivered_batches"] == 5
    feed.close()  # a second close is a no-op


def test_progress_bar_with_tqdm(target, capsys):
    pytest.importorskip("tqdm")
    with draftfeed.Feed(targets=[target.address], layers=[0], progress=True) as feed:
        assert feed._bar is not None
        list(feed.map(batches()))
    err = capsys.readouterr().err
    assert "draftfeed" in err and "5batch" in err.replace(" ", ""), err


def test_progress_without_tqdm_prints_lines(target, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    with draftfeed.Feed(targets=[target.address], layers=[0], progress=True) as feed:
        assert feed._bar is None and feed.progress_every_s == 10.0
        feed._last_progress = -1e9  # the first result prints a line
        list(feed.map(batches()))
    out = capsys.readouterr().out
    assert "draftfeed: 1 batches" in out, out
