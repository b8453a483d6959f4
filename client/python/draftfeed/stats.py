"""Feed statistics: rates over a recent window, the flat form for loggers, the progress bar.

`Feed.stats()` builds on these; they hold no reference to the native feed, so the numbers
stay readable after `close()`.
"""

from __future__ import annotations

import collections
import time
from typing import Optional


class RateWindow:
    """Rates of cumulative counters over the last `window_s` seconds.

    `record(now, counts)` takes the counters' running totals (a dict of name -> number). It
    keeps at most ~64 samples per window, so recording at every batch costs O(1) memory per
    window however fast batches arrive. `rates(now, counts)` is the per-second increase
    from the oldest sample still in the window (at most `window_s` old, plus one sample
    spacing) to `counts` at `now`, and the seconds it spans.
    """

    def __init__(self, window_s: float = 30.0, start: Optional[float] = None,
                 zero: Optional[dict] = None):
        if not window_s > 0:
            raise ValueError(f"window_s={window_s} must be > 0")
        self.window_s = float(window_s)
        self._spacing = self.window_s / 64
        self._samples = collections.deque()
        if start is not None:
            self._samples.append((start, dict(zero or {})))

    def record(self, now: float, counts: dict) -> None:
        if not self._samples or now - self._samples[-1][0] >= self._spacing:
            self._samples.append((now, dict(counts)))
        # Keep one sample at or before the window's start, as the rates' base.
        while len(self._samples) >= 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rates(self, now: float, counts: dict) -> tuple:
        """({name: increase per second}, seconds spanned); zeros before any time passed."""
        self.record(now, counts)
        base_t, base = self._samples[0]
        span = now - base_t
        if span <= 0:
            return {k: 0.0 for k in counts}, 0.0
        return {k: (counts[k] - base.get(k, 0)) / span for k in counts}, span


def flatten(stats: dict) -> dict:
    """One level of numeric keys for wandb/tensorboard: the scalars as they are, each
    target's numbers as "target.<address>.<key>" and its state as
    "target.<address>.live" (1 or 0); strings (errors, notes) are left out."""
    flat = {}
    for k, v in stats.items():
        if k == "targets":
            continue
        if isinstance(v, bool):
            flat[k] = int(v)
        elif isinstance(v, (int, float)):
            flat[k] = v
    for t in stats.get("targets", []):
        prefix = f"target.{t['address']}."
        for k, v in t.items():
            if isinstance(v, bool):
                flat[prefix + k] = int(v)
            elif isinstance(v, (int, float)):
                flat[prefix + k] = v
        flat[prefix + "live"] = int(t.get("state") == "live")
    return flat


class ProgressBar:
    """A tqdm bar over batches with tokens/s in its postfix; `None` from `make` when tqdm
    is not importable."""

    @staticmethod
    def make(desc: str = "draftfeed") -> Optional["ProgressBar"]:
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return ProgressBar(tqdm(desc=desc, unit="batch", dynamic_ncols=True))

    def __init__(self, bar):
        self.bar = bar
        self._last_postfix = 0.0

    def update(self, tokens_per_s: float, queue: int) -> None:
        self.bar.update(1)
        now = time.monotonic()
        if now - self._last_postfix >= 0.5:  # the postfix redraws the bar: not every batch
            self._last_postfix = now
            self.bar.set_postfix_str(f"{tokens_per_s:,.0f} tok/s, queue {queue}", refresh=False)

    def close(self) -> None:
        self.bar.close()
