"""What the Python data path counts so that no batch, sequence or token is lost silently.

Three things `Feed.stats()` adds to the native feed's numbers, each also logged (logger
"draftfeed") or warned when it happens:

- batches skipped on error (`Feed.map(on_error="skip")`, HiddenStateDataset's): counted,
  logged with their reason, and capped by `max_skipped` per pass;
- packing's truncations and left-out sequences, from the `PackedBatch.packing_stats` of the
  batches `map` submitted, warned once at the end of a pass;
- target failures: the native feed's per-target `failures` (streams lost to a crash, a hang
  past batch_timeout_s, or a shutdown) and `refused` targets, logged once per event.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional

from .packing import PackingStats, warn_truncated

log = logging.getLogger("draftfeed")

ON_ERROR = ("raise", "skip")

# The pass-level codes that are not one batch's fault: UNAVAILABLE (no target reachable for
# unavailable_timeout_s: every batch would fail the same way), CANCELLED, FAILED_PRECONDITION
# (a closed feed). Skipping them would skip everything.
_NOT_SKIPPABLE = {1: "CANCELLED", 9: "FAILED_PRECONDITION", 14: "UNAVAILABLE"}


def check_on_error(on_error: str, max_skipped: int) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if int(max_skipped) < 0:
        raise ValueError(f"max_skipped must be >= 0, got {max_skipped}")


def new_counters() -> Dict[str, int]:
    """The Python-side counters, by their `stats()` keys."""
    c = {"skipped_batches": 0, "skipped_tokens": 0}
    c.update({k: 0 for k in PackingStats().as_dict() if k not in ("sequences", "tokens")})
    return c


def describe(item: Any) -> str:
    """A batch as a log line names it: its tokens and sequences, and its dataset indices."""
    try:
        token_ids, seq_lens = item
        text = f"{len(token_ids)} tokens in {len(seq_lens)} sequences"
    except (TypeError, ValueError):
        return "a batch"
    indices = getattr(item, "indices", None)
    if indices:
        shown = ", ".join(str(i) for i in indices[:8]) + (", ..." if len(indices) > 8 else "")
        text += f", dataset indices [{shown}]"
    return text


def batch_tokens(item: Any) -> int:
    try:
        token_ids, _ = item
        return int(len(token_ids))
    except (TypeError, ValueError):
        return 0


class Pass:
    """One `map` pass: its skips (on_error) and its batches' packing counts."""

    def __init__(self, counters: Dict[str, int], on_error: str, max_skipped: int,
                 on_skip: Optional[Callable] = None, where: str = "Feed.map"):
        check_on_error(on_error, max_skipped)
        self.counters = counters
        self.on_error = on_error
        self.max_skipped = int(max_skipped)
        self.on_skip = on_skip
        self.where = where
        self.skipped = 0
        self.packing = PackingStats()    # of every batch submitted in this pass
        self.to_warn = PackingStats()    # of those whose packer does not warn itself

    def submitted(self, item: Any) -> None:
        stats = getattr(item, "packing_stats", None)
        if not isinstance(stats, PackingStats):
            return
        self.packing.add(stats)
        if not getattr(item, "packer_warns", False):
            self.to_warn.add(stats)
        for k in ("long_sequences", "truncated_sequences", "truncated_tokens",
                  "dropped_sequences", "dropped_tokens", "empty_sequences"):
            self.counters[k] += getattr(stats, k)

    def failed(self, error, item: Any) -> None:
        """A batch came back as `error`: re-raises it (on_error="raise", a pass-level error, or
        the max_skipped-th skip exceeded), else counts and logs the skip."""
        if self.on_error != "skip" or error.code in _NOT_SKIPPABLE or not error.consumed_batch:
            raise error
        self.skipped += 1
        if self.skipped > self.max_skipped:
            from . import DraftfeedError  # here: draftfeed imports this module

            raise DraftfeedError(
                error.code, f"{self.where}: {self.skipped} batches failed in this pass, over "
                            f"max_skipped={self.max_skipped} (on_error='skip'); the last: "
                            f"{error.message}") from error
        self.counters["skipped_batches"] += 1
        self.counters["skipped_tokens"] += batch_tokens(item) if item is not None else 0
        if error.batch_id is None:
            batch = "a batch (which one: unknown on an unordered feed)"
        else:
            what = "queued by submit()" if item is None else describe(item)
            batch = f"batch {error.batch_id} ({what})"
        log.warning("draftfeed: %s skipped %s on error: %s; %d skipped in this pass "
                    "(max_skipped=%d), stats()['skipped_batches'] counts them",
                    self.where, batch, error, self.skipped, self.max_skipped)
        if self.on_skip is not None:
            self.on_skip(error, item)

    def finish(self) -> None:
        """The pass ended with its input: warns once if its batches were truncated, and logs
        what packing left out."""
        warn_truncated(self.where, self.to_warn, None, stacklevel=4)
        if self.packing.dropped_sequences:
            log.info("draftfeed: %s: packing left out %d sequences (%d tokens) this pass "
                     "(drop_longer)", self.where, self.packing.dropped_sequences,
                     self.packing.dropped_tokens)


class TargetWatch:
    """Logs a warning once per target failure the native feed reports, and sums them."""

    def __init__(self):
        self._failures: Dict[str, int] = {}
        self._refused: set = set()
        self.warnings = 0

    def observe(self, stats: dict) -> None:
        for t in stats.get("targets", ()):
            address, failures = t["address"], int(t.get("failures", 0))
            before = self._failures.get(address, 0)
            if failures > before:
                self.warnings += 1
                log.warning("draftfeed: target %s lost %d stream%s (died, hung past "
                            "batch_timeout_s or shut down; %d in all): %s. Its unfinished "
                            "batches are re-sent to other targets (%d re-sent in all); it is "
                            "retried with backoff", address, failures - before,
                            "s" if failures - before > 1 else "", failures,
                            t.get("last_error") or "no error text", int(stats.get("resent", 0)))
            self._failures[address] = max(before, failures)
            if t.get("state") == "refused" and address not in self._refused:
                self._refused.add(address)
                self.warnings += 1
                log.warning("draftfeed: target %s is refused and dropped from this feed: %s",
                            address, t.get("last_error") or "no error text")

    def add_to(self, stats: dict) -> None:
        targets = stats.get("targets", ())
        stats["target_failures"] = sum(int(t.get("failures", 0)) for t in targets)
        stats["targets_refused"] = sum(1 for t in targets if t.get("state") == "refused")
        stats["failover_warnings"] = self.warnings
