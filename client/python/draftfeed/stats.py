"""Feed statistics: the flat form for loggers, the progress bar.

The numbers, rates since start and over the recent window included, are the C++ client's
(`FeedStats`); `Feed.stats()` adds the Python names and these forms.
"""

from __future__ import annotations

import time
from typing import Callable, Optional


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

    def expect(self, more: Optional[int]) -> None:
        """`more` batches still to come: the bar's total is what it has counted plus those, so
        it shows a fraction and a time left; None (not known): no total."""
        self.bar.total = None if more is None else self.bar.n + more
        self.bar.refresh()

    def update(self, queue: int, tokens_per_s: Callable[[], float]) -> None:
        """One batch more; `tokens_per_s` is asked only when the postfix is redrawn."""
        self.bar.update(1)
        now = time.monotonic()
        if now - self._last_postfix >= 0.5:  # the postfix redraws the bar: not every batch
            self._last_postfix = now
            self.bar.set_postfix_str(f"{tokens_per_s():,.0f} tok/s, queue {queue}",
                                     refresh=False)

    def close(self) -> None:
        self.bar.close()
