"""The feed's batch table as streams fill it (client/src/batches.cc): chunks claimed and
landed, BatchDone and BatchError, and a finished batch's checks before it is handed out.
Every method here runs with the feed's lock held unless it says otherwise."""

from __future__ import annotations

import time

import numpy as np

from .checksum import BatchHash, payload_checksum
from .conn import Claim
from .result import GrpcioResult, target_output_offsets

DATA_LOSS, RESOURCE_EXHAUSTED, UNAVAILABLE = 15, 8, 14


class Pending:
    """A submitted batch until next() takes it."""

    __slots__ = ("token_ids", "seq_lens", "request", "buffer", "bytes", "landings", "epoch",
                 "early_done", "hash", "tokens_received", "target", "conn", "last_progress",
                 "complete", "error", "result")

    def __init__(self, token_ids: np.ndarray, seq_lens: np.ndarray, request: bytes):
        self.token_ids = token_ids
        self.seq_lens = seq_lens
        self.request = request  # the Batch's fields but its id, serialized once
        self.buffer = None
        self.bytes = 0
        self.landings = 0  # chunks claimed whose bytes have not landed yet
        self.epoch = 0     # bumped whenever the batch is unassigned
        self.early_done = None  # a BatchDone that beat its bytes
        self.hash = BatchHash()
        self.tokens_received = 0
        self.target = None
        self.conn = None
        self.last_progress = 0.0
        self.complete = False
        self.error = None  # (code, message)
        self.result = None


class TableMixin:
    """The batch-table half of the feed (feed.Impl)."""

    def _claim(self, conn, header, payload_bytes: int):
        """Claims a chunk's tokens for its batch (taking the lock); None: drop its bytes."""
        batch_id, offset, count = header
        with self.cv:
            p = self.pending.get(batch_id)
            if p is None or p.complete or p.conn is not conn:
                return None  # re-sent elsewhere, or already returned
            t = p.target
            T = p.token_ids.size
            p.last_progress = conn.last_progress = time.monotonic()
            if (offset < 0 or count < 0 or offset + count > T
                    or payload_bytes != count * t.bytes_per_token):
                self._fail_malformed(t, batch_id, p, header, payload_bytes)
                return None
            if p.buffer is None:
                # Uninitialised: every byte is written by a chunk before the batch completes.
                p.bytes = T * t.bytes_per_token
                p.buffer = self.pool.acquire(p.bytes)
            p.landings += 1
            return Claim(p.buffer, offset * t.bytes_per_token, p.epoch, self.o.verify_checksum)

    def _landed(self, conn, header, payload_bytes: int, claim, ok: bool, hashed) -> None:
        """A claimed chunk's bytes are in place (ok) or never came (taking the lock)."""
        batch_id, offset, count = header
        with self.cv:
            if ok:
                self.stats["bytes_received"] += payload_bytes
            p = self.pending.get(batch_id)
            if (p is None or p.complete or p.conn is not conn or p.epoch != claim.epoch):
                return  # re-assigned meanwhile: these bytes are not wanted
            p.landings -= 1
            p.last_progress = conn.last_progress = time.monotonic()
            if not ok:
                self._fail_malformed(p.target, batch_id, p, header, payload_bytes)
                return
            if hashed is not None:
                p.hash.add(*hashed)
            p.tokens_received += count
            if p.landings == 0 and p.early_done is not None:
                done, p.early_done = p.early_done, None
                self._finish_batch(p.target, batch_id, p, done)

    def _fail_malformed(self, t, batch_id, p, header, payload_bytes) -> None:
        _, offset, count = header
        self._fail(batch_id, p, (DATA_LOSS, f"target {t.address} sent a malformed chunk for "
                                            f"batch {batch_id}: tokens [{offset}, +{count}) of "
                                            f"{p.token_ids.size}, {payload_bytes} bytes"))
        self.cv.notify_all()

    def _handle_response(self, conn, resp, kind: str) -> None:
        """BatchDone or BatchError from `conn` (taking the lock)."""
        if kind not in ("done", "error"):
            return
        msg = resp.done if kind == "done" else resp.error
        batch_id = msg.batch_id
        with self.cv:
            p = self.pending.get(batch_id)
            if p is None or p.complete or p.conn is not conn:
                # Re-sent elsewhere (or already returned, or cancelled with its stream).
                if kind == "done" and not conn.cancelled_by_client:
                    self.stats["duplicates_dropped"] += 1
                return
            p.last_progress = conn.last_progress = time.monotonic()
            t = conn.target
            if kind == "error":
                if msg.code in (UNAVAILABLE, RESOURCE_EXHAUSTED):
                    # The target is draining or full: the batch is fine, send it elsewhere.
                    self._unassign(p)
                    self.unassigned.add(batch_id)
                    self.stats["resent"] += 1
                else:
                    self._fail(batch_id, p, (msg.code, f"target {t.address}: {msg.message}"))
                self.cv.notify_all()
                return
            if p.landings > 0:
                p.early_done = msg  # the bytes' landing finishes the batch
                return
            self._finish_batch(t, batch_id, p, msg)

    def _finish_batch(self, t, batch_id: int, p: Pending, done) -> None:
        """A batch's BatchDone with its payload in place: check it, make its result."""
        T = p.token_ids.size
        if p.tokens_received != T or done.tokens != T:
            self._fail(batch_id, p, (DATA_LOSS, f"batch {batch_id} from {t.address}: received "
                                                f"{p.tokens_received} of {T} tokens"))
        elif self.o.verify_checksum and self._checksum(p) != done.checksum:
            self._fail(batch_id, p, (DATA_LOSS, f"batch {batch_id} from {t.address}: checksum "
                                                f"mismatch"))
        else:
            s = t.stats
            s["delivered_batches"] += 1
            s["delivered_tokens"] += T
            t.window.record(self._since_open(), (s["delivered_batches"], s["delivered_tokens"]))
            forward_ms = done.timings.forward_ms
            if forward_ms > 0:
                inst = T / (forward_ms / 1000.0)
                t.rate_tps = 0.7 * t.rate_tps + 0.3 * inst if t.rate_tps > 0 else inst
            buf = p.buffer
            self._unassign(p)
            p.complete = True
            outputs = target_output_offsets(self.outputs_layout, t.hidden_bytes_per_token,
                                            self.o.top_k, int(self.o.draft_vocab.size),
                                            self.o.probs_encoding)
            tm = done.timings
            p.result = GrpcioResult(
                batch_id, p.token_ids, p.seq_lens, len(self.o.layers), self.hidden_size,
                t.encoding, t.bytes_per_token, buf, outputs, done.checksum, t.address,
                {"queue_ms": tm.queue_ms, "forward_ms": tm.forward_ms, "send_ms": tm.send_ms,
                 "recv_ms": 0.0})
            p.buffer = None
        self.cv.notify_all()

    @staticmethod
    def _checksum(p: Pending) -> int:
        try:
            return p.hash.finish(p.buffer, p.bytes)
        except ValueError:  # chunks that overlapped: hash the payload whole
            return payload_checksum(p.buffer[:p.bytes])

    def _unassign(self, p: Pending) -> None:
        if p.target is not None:
            p.target.stats["outstanding_batches"] -= 1
            p.target.stats["outstanding_tokens"] -= p.token_ids.size
        p.target = None
        p.conn = None
        p.tokens_received = 0
        p.epoch += 1  # bytes still landing from the old assignment are dropped
        p.landings = 0
        p.early_done = None
        p.hash = BatchHash()

    def _fail(self, batch_id: int, p: Pending, error) -> None:
        self._unassign(p)
        self.unassigned.discard(batch_id)
        p.complete = True
        p.error = error
        p.buffer = None
        self.stats["failed"] += 1
