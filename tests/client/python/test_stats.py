"""Feed.stats(): since-start and windowed rates, the flat form, the numbers after close(), and
Feed(progress=True). The window's arithmetic is the C++ client's (tests/client/feed_rates_test.cc);
these check that Python hands it out."""

import sys

import numpy as np
import pytest

import draftfeed
from draftfeed import stats as stats_module
from draftfeed.stats import ProgressBar, flatten

LENS = [[5], [1, 2, 3], [64, 65], [200], [17, 1]]


def batches():
    rng = np.random.default_rng(3)
    return [(rng.integers(0, 4096, size=sum(l), dtype=np.int32), l) for l in LENS]


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

    (t,) = s["targets"]
    assert t["delivered_tokens"] == n_tokens
    assert t["window_tokens_per_s"] * t["window_s"] == pytest.approx(n_tokens)
    assert t["tokens_per_s"] == pytest.approx(t["window_tokens_per_s"])  # both since it joined
    assert 0 < t["window_s"] <= s["elapsed_s"]

    flat = feed.stats(flat=True)
    addr = target.address
    assert flat[f"target.{addr}.window_tokens_per_s"] > 0  # later, so a little lower
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


def test_stats_window_must_be_positive(target):
    with pytest.raises(draftfeed.DraftfeedError, match="stats_window_s must be a number"):
        draftfeed.Feed(targets=[target.address], layers=[0], stats_window_s=0)


def test_progress_bar_asks_the_rate_only_when_it_redraws(monkeypatch):
    class FakeBar:
        def __init__(self):
            self.n, self.postfix = 0, []

        def update(self, k):
            self.n += k

        def set_postfix_str(self, text, refresh):
            self.postfix.append(text)

    now = [100.0]
    monkeypatch.setattr(stats_module.time, "monotonic", lambda: now[0])
    asked = []

    def rate():
        asked.append(now[0])
        return 1234.4

    bar = ProgressBar(FakeBar())
    for t in (100.0, 100.2, 100.49, 100.5, 100.7):
        now[0] = t
        bar.update(3, rate)
    assert bar.bar.n == 5
    assert asked == [100.0, 100.5]  # every 0.5 s, not every batch
    assert bar.bar.postfix == ["1,234 tok/s, queue 3"] * 2


def test_progress_bar_with_tqdm(target, capsys):
    pytest.importorskip("tqdm")
    with draftfeed.Feed(targets=[target.address], layers=[0], progress=True) as feed:
        assert feed._bar is not None
        list(feed.map(batches()))
    err = capsys.readouterr().err
    assert "draftfeed" in err and "5/5" in err, err  # a list has a length: the bar a total


def test_progress_bar_has_a_total_when_the_input_has_a_length(target):
    tqdm = pytest.importorskip("tqdm")
    with draftfeed.Feed(targets=[target.address], layers=[0], progress=True) as feed:
        bar = feed._bar.bar
        assert isinstance(bar, tqdm.tqdm) and bar.total is None
        list(feed.map(batches()))  # a list: 5 batches
        assert (bar.n, bar.total) == (5, 5)
        list(feed.map(batches()[:2]))  # a second pass adds its own
        assert (bar.n, bar.total) == (7, 7)
        list(feed.map(b for b in batches()[:3]))  # a generator has no length: no total
        assert (bar.n, bar.total) == (10, None)


def test_progress_without_tqdm_prints_lines(target, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    with draftfeed.Feed(targets=[target.address], layers=[0], progress=True) as feed:
        assert feed._bar is None and feed.progress_every_s == 10.0
        feed._last_progress = -1e9  # the first result prints a line
        list(feed.map(batches()))
    out = capsys.readouterr().out
    assert "draftfeed: 1 batches" in out, out
