"""Feed.map's loop: the prefetch window kept full, each result handed out with the item it came
from, and one batch's error handled by the pass's policy (accounting.Pass) without touching the
other batches in flight."""

from __future__ import annotations

import time
from typing import Iterable, Iterator


def run(feed, batches: Iterable, acct) -> Iterator:
    from . import DraftfeedError  # the package is initialised by the time a map runs

    if feed._bar is not None:
        # What this pass returns: the batches given and any still outstanding before it; a
        # generator (or another input without a length) gives no total.
        sized = hasattr(batches, "__len__")
        feed._bar.expect(feed._outstanding + len(batches) if sized else None)
    it = iter(batches)
    exhausted = False
    mine = set()  # ids this map submitted and has not yielded
    keep = False  # a batch error ends the pass: what is in flight stays for next()
    try:
        while True:
            while not exhausted and feed._outstanding < feed.prefetch:
                try:
                    item = next(it)
                except StopIteration:
                    exhausted = True
                    break
                token_ids, seq_lens = item
                batch_id = feed.submit(token_ids, seq_lens)
                feed._ids[batch_id] = item  # Result.batch, and the skipped batch's log line
                mine.add(batch_id)
                acct.submitted(item)
            if feed._outstanding == 0:
                acct.finish()
                return
            try:
                r = feed.next()
            except DraftfeedError as e:
                mine.discard(e.batch_id)
                # Raised (on_error="raise", a pass-level error, max_skipped passed): the
                # batches in flight are other batches' and stay outstanding for next().
                keep = True
                acct.failed(e, e.batch)
                keep = False
                continue
            mine.discard(r.batch_id)
            yield r
            if feed.progress_every_s > 0:
                now = time.monotonic()
                if now - feed._last_progress >= feed.progress_every_s:
                    feed._last_progress = now
                    print(feed.progress_line(), flush=True)
    finally:
        if mine and feed._feed is not None and not keep:
            feed.cancel(sorted(mine))
