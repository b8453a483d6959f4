"""stats()' rates: since a start, and over a recent window from samples of running totals
(client/src/feed_rates.h, the same arithmetic, so both clients report the same numbers)."""

from __future__ import annotations

import collections
from typing import Sequence, Tuple

SAMPLES_PER_WINDOW = 64


class RateWindow:
    """Rates of N cumulative counters over the last `window_s` seconds. A sample is kept at
    most every window_s / 64 seconds; the base of the rates is the newest sample at or before
    the window's start (or the oldest, early on)."""

    def __init__(self, window_s: float, start_s: float, zero: Sequence[int]):
        self._window_s = window_s
        self._spacing_s = window_s / SAMPLES_PER_WINDOW
        self._samples = collections.deque([(start_s, tuple(zero))])

    def record(self, now_s: float, counts: Sequence[int]) -> None:
        if now_s - self._samples[-1][0] >= self._spacing_s:
            self._samples.append((now_s, tuple(counts)))
        while len(self._samples) >= 2 and self._samples[1][0] <= now_s - self._window_s:
            self._samples.popleft()

    def get(self, now_s: float, counts: Sequence[int]) -> Tuple[list, float]:
        """(per-second increase of each counter, seconds spanned); zeros before time passed."""
        self.record(now_s, counts)
        t0, base = self._samples[0]
        if now_s <= t0:
            return [0.0] * len(counts), 0.0
        span = now_s - t0
        return [(c - b) / span for c, b in zip(counts, base)], span


def per_second(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def feed_counts(s: dict) -> tuple:
    return s["delivered"], s["tokens_delivered"], s["bytes_received"]


def target_counts(s: dict) -> tuple:
    return s["delivered_batches"], s["delivered_tokens"]


def set_feed_rates(now_s: float, window: RateWindow, s: dict) -> None:
    s["elapsed_s"] = now_s
    s["batches_per_s"] = per_second(s["delivered"], now_s)
    s["tokens_per_s"] = per_second(s["tokens_delivered"], now_s)
    s["bytes_per_s"] = per_second(s["bytes_received"], now_s)
    (b, t, by), span = window.get(now_s, feed_counts(s))
    s.update(window_s=span, window_batches_per_s=b, window_tokens_per_s=t,
             window_bytes_per_s=by)


def set_target_rates(now_s: float, joined_s: float, window: RateWindow, s: dict) -> None:
    s["batches_per_s"] = per_second(s["delivered_batches"], now_s - joined_s)
    s["tokens_per_s"] = per_second(s["delivered_tokens"], now_s - joined_s)
    (b, t), span = window.get(now_s, target_counts(s))
    s.update(window_s=span, window_batches_per_s=b, window_tokens_per_s=t)
