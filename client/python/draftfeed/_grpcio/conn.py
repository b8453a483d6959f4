"""A feed's streams over grpcio (client/src/connection.cc): one per (target address,
connection). Connecting with backoff, opening (model check, what Opened says), the reader and
its landings, and what a stream's end does to the batches it held.

Threads: per target a connector; per live stream a reader (it iterates the call, decodes each
chunk's envelope and claims its tokens) whose chunks are copied and hashed into their batches
either inline or, with read handoff, on the feed's copy threads, so the next message is
already being read while the last is copied; grpcio itself consumes the request iterator.
"""

from __future__ import annotations

import collections
import threading
import time

import grpc
import numpy as np

from . import envelope, proto
from .channel import (FAILED_PRECONDITION, INVALID_ARGUMENT, StatusError, query_info,
                      rpc_status)
from .checksum import copy_and_hash

INTERNAL, CANCELLED = 13, 1
# Messages a stream reads ahead of its landings (chunks are chunk_bytes each, 4 MiB by
# default): bounded, so a slow trainer still pushes back on the target.
READ_AHEAD_MESSAGES = 4


class WriteQueue:
    """A stream's outgoing messages; grpcio's request thread iterates it. Its end is the
    stream's half-close (WritesDone)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._q = collections.deque()
        self._closed = False

    def push(self, msg: bytes) -> None:
        with self._cv:
            if not self._closed:
                self._q.append(msg)
                self._cv.notify()

    def close(self, drop_queued: bool) -> None:
        with self._cv:
            self._closed = True
            if drop_queued:
                self._q.clear()
            self._cv.notify_all()

    def __iter__(self):
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    return
                msg = self._q.popleft()
            yield msg


class Conn:
    """One StreamHiddenStates call."""

    def __init__(self, target):
        self.target = target
        self.wq = WriteQueue()
        self.call = None
        self.reader = None
        self.finished = False             # guarded by the feed's lock
        self.cancelled_by_client = False  # Feed.cancel ended it: no failure, reconnect now
        # The last chunk, BatchDone or BatchError of any of its batches (guarded by the feed's
        # lock): a batch queued behind others being served (a long sequence's forwards take
        # minutes) is waiting, not hung.
        self.last_progress = 0.0
        self._landing_cv = threading.Condition()
        self._landings = 0

    def cancel(self) -> None:
        if self.call is not None:
            self.call.cancel()

    def begin_landing(self) -> None:
        with self._landing_cv:
            while self._landings >= READ_AHEAD_MESSAGES:
                self._landing_cv.wait()
            self._landings += 1

    def end_landing(self) -> None:
        with self._landing_cv:
            self._landings -= 1
            self._landing_cv.notify_all()

    def wait_landings(self) -> None:
        with self._landing_cv:
            while self._landings:
                self._landing_cv.wait()


class Claim:
    """Where a claimed chunk's bytes go: the batch's buffer, kept alive meanwhile."""

    __slots__ = ("buf", "offset", "epoch", "hash")

    def __init__(self, buf, offset, epoch, hash_it):
        self.buf, self.offset, self.epoch, self.hash = buf, offset, epoch, hash_it


class ConnMixin:
    """The connection half of the feed (feed.Impl)."""

    def _connect_loop(self, t) -> None:
        with self.cv:
            while True:
                if self.closing:
                    return
                if t.state in ("live", "refused"):
                    self.cv.wait()
                    continue
                now = time.monotonic()
                if now < t.next_attempt:
                    self.cv.wait(t.next_attempt - now)
                    continue
                first = t.attempts == 0
                t.attempts += 1
                self.cv.release()
                try:
                    err = None
                    self._connect_once(t, first)
                except StatusError as e:
                    err = e
                finally:
                    self.cv.acquire()
                if err is None or self.closing:
                    continue
                t.stats["last_error"] = err.message
                if err.code in (FAILED_PRECONDITION, INVALID_ARGUMENT):
                    t.state = "refused"  # another model or a layer it lacks: never use it
                    t.refusal = (err.code, err.message)
                else:
                    t.state = "down"
                    t.next_attempt = time.monotonic() + t.backoff_s
                    t.backoff_s = min(t.backoff_s * 2, self.o.reconnect_backoff_max_s)
                self.cv.notify_all()

    def _open_request(self, fingerprint: str) -> bytes:
        o = self.o
        req = proto.StreamRequest()
        op = req.open
        op.layers.extend(o.layers)
        op.encoding = self.requested_encoding
        op.transport = proto.TRANSPORT_GRPC
        op.expected_fingerprint = fingerprint
        op.max_inflight_batches = o.credits_per_target
        op.client_name = o.client_name
        if o.has_outputs():
            asked = op.target_outputs
            asked.argmax = o.argmax
            asked.top_k = o.top_k
            asked.draft_vocab.extend(o.draft_vocab.tolist())
            asked.draft_probs_encoding = proto.ENCODING_BF16 if o.probs_encoding == "bf16" \
                else proto.ENCODING_FP8_E4M3
        return req.SerializeToString()

    def _connect_once(self, t, first: bool) -> None:
        o = self.o
        # Every attempt fails as soon as the connection does; the timeout bounds a hang.
        info = query_info(t.channel, t.address,
                          o.connect_timeout_s if first else min(o.connect_timeout_s, 5.0),
                          self.creds)
        with self.cv:
            if not self.fingerprint:
                self.fingerprint = info["fingerprint"]
                self.fingerprint_source = f"{t.address} ({info['model_id']})"
                self.hidden_size = info["hidden_size"]
            if info["fingerprint"] != self.fingerprint:
                src = f", served by {self.fingerprint_source}" if self.fingerprint_source else ""
                raise StatusError(FAILED_PRECONDITION,
                                  f"target {t.address} serves {info['model_id']} (fingerprint "
                                  f"{info['fingerprint']}) but the feed expects fingerprint "
                                  f"{self.fingerprint}{src}; refusing it")
        conn = Conn(t)
        context = f"target {t.address}: open stream"
        conn.wq.push(self._open_request(info["fingerprint"]))
        conn.call = t.stream(iter(conn.wq), metadata=self.creds.metadata)

        def abandon(code, message):
            conn.wq.close(drop_queued=True)
            conn.call.cancel()
            raise StatusError(code, message)

        # Opened comes once the target has set the stream up; one that never answers is
        # abandoned after connect_timeout_s rather than holding the connector forever.
        timer = threading.Timer(o.connect_timeout_s, conn.call.cancel)
        timer.daemon = True
        timer.start()
        try:
            first_msg = next(conn.call)
        except grpc.RpcError as e:
            code, message = rpc_status(e)
            if code == CANCELLED and not self.closing:
                message = f"no Opened within {o.connect_timeout_s:g}s"
            conn.wq.close(drop_queued=True)
            raise StatusError(*self.creds.explain(code, f"{context}: {message}")) from None
        except StopIteration:
            abandon(INTERNAL, f"target {t.address}: expected Opened")
        finally:
            timer.cancel()
        resp = proto.StreamResponse()
        try:
            resp.ParseFromString(first_msg)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError differs by runtime
            abandon(INTERNAL, f"target {t.address}: expected Opened")
        if resp.WhichOneof("msg") != "opened":
            abandon(INTERNAL, f"target {t.address}: expected Opened")
        opened = resp.opened
        wire = opened.encoding or proto.ENCODING_BF16
        if wire not in (proto.ENCODING_BF16, proto.ENCODING_FP8_E4M3):
            name = proto.ENCODING_NAMES.get(wire, str(wire))
            abandon(FAILED_PRECONDITION, f"target {t.address} sends its capture as {name}, "
                                         f"which this client cannot read")
        if len(opened.layers) != len(o.layers):
            abandon(FAILED_PRECONDITION, f"target {t.address} opened {len(opened.layers)} "
                                         f"layers of the {len(o.layers)} asked")
        if opened.target_outputs_bytes != self.outputs_layout["bytes"]:
            upgrade = (": it does not serve target outputs (argmax, top_k, draft_vocab); "
                       "upgrade it" if self.outputs_layout["bytes"] and
                       not opened.target_outputs_bytes else "")
            abandon(FAILED_PRECONDITION,
                    f"target {t.address} (version {opened.info.server_version}) answers with "
                    f"{opened.target_outputs_bytes} bytes of target outputs per token where "
                    f"{self.outputs_layout['bytes']} were asked{upgrade}")
        if opened.transport not in (proto.TRANSPORT_GRPC, proto.TRANSPORT_UNSPECIFIED):
            name = proto.TRANSPORT_NAMES.get(opened.transport, str(opened.transport))
            abandon(INTERNAL, f"target {t.address} chose {name}, which this feed did not offer")
        k, h = len(opened.layers), opened.info.hidden_size
        hidden_bytes = k * h * 2 if wire == proto.ENCODING_BF16 else k * h + 4 * k
        with self.cv:
            if self.closing:
                abandon(CANCELLED, "feed closing")
            t.info = info
            t.credits = max(1, opened.max_inflight_batches)
            t.encoding = "bf16" if wire == proto.ENCODING_BF16 else "fp8_e4m3"
            t.hidden_bytes_per_token = hidden_bytes
            t.bytes_per_token = hidden_bytes + self.outputs_layout["bytes"]
            t.conn = conn
            t.state = "live"
            t.backoff_s = o.reconnect_backoff_min_s
            t.stats["last_error"] = ""
            t.stats["transport"] = "grpc"
            t.stats["transport_note"] = opened.transport_note
            conn.reader = threading.Thread(target=self._read_loop, args=(conn,),
                                           name="df-read", daemon=True)
            conn.reader.start()
            self.cv.notify_all()

    def _read_loop(self, conn: Conn) -> None:
        status = (0, "")
        try:
            for raw in conn.call:
                if not self._process(conn, raw):
                    conn.cancel()  # a target that sends garbage is treated as lost
                    break
        except grpc.RpcError as e:
            status = rpc_status(e)
        except Exception as e:  # noqa: BLE001 - a client bug must not hang the feed
            status = (INTERNAL, f"client error reading the stream: {e!r}")
            conn.cancel()
        conn.wait_landings()  # the last chunks land before their batches are judged
        conn.wq.close(drop_queued=True)
        with self.cv:
            self._on_conn_end(conn.target, conn, status)
            conn.finished = True
            self.dead_conns.append(conn)
            self.cv.notify_all()

    def _process(self, conn: Conn, raw: bytes) -> bool:
        """One message; False when the stream must end (the target sent garbage)."""
        env = envelope.decode(raw)
        if env is not None:
            return self._on_chunk(conn, env.batch_id, env.token_offset, env.token_count, raw,
                                  env.envelope_bytes, env.payload_bytes)
        resp = proto.StreamResponse()
        try:
            resp.ParseFromString(raw)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError differs by runtime
            with self.cv:
                conn.target.stats["last_error"] = (f"target {conn.target.address} sent a "
                                                   f"message that is not a StreamResponse")
            return False
        kind = resp.WhichOneof("msg")
        if kind == "chunk":
            c = resp.chunk
            return self._on_chunk(conn, c.batch_id, c.token_offset, c.token_count, c.data, 0,
                                  len(c.data))
        self._handle_response(conn, resp, kind)
        return True

    def _on_chunk(self, conn, batch_id, offset, count, msg, skip, n) -> bool:
        header = (batch_id, offset, count)
        claim = self._claim(conn, header, n)
        if claim is None:
            return True
        if self.executor is None:
            self._land(conn, header, claim, msg, skip, n)
            return True
        conn.begin_landing()
        try:
            self.executor.submit(self._land_async, conn, header, claim, msg, skip, n)
        except RuntimeError:  # the executor shut down: the feed is closing
            conn.end_landing()
        return True

    def _land_async(self, conn, header, claim, msg, skip, n) -> None:
        try:
            self._land(conn, header, claim, msg, skip, n)
        finally:
            conn.end_landing()

    def _land(self, conn, header, claim: Claim, msg, skip: int, n: int) -> None:
        """Copies a claimed chunk into its batch (hashing it when asked), outside the lock."""
        hashed = None
        ok = len(msg) - skip == n
        if ok:
            try:
                src = np.frombuffer(msg, np.uint8, count=n, offset=skip)
                if claim.hash:
                    hashed = copy_and_hash(claim.buf, claim.offset, src)
                else:
                    claim.buf[claim.offset:claim.offset + n] = src
            except Exception:  # noqa: BLE001 - a chunk that cannot land fails its batch,
                ok = False     # rather than leaving it waiting for bytes that never come
        self._landed(conn, header, n, claim, ok, hashed)

    def _on_conn_end(self, t, conn: Conn, status) -> None:
        if t.conn is conn:
            t.conn = None
            if t.state == "live":
                t.state = "down"
            t.next_attempt = time.monotonic() + t.backoff_s
            if conn.cancelled_by_client:
                t.next_attempt = time.monotonic()  # nothing went wrong: reconnect now
            elif not self.closing:
                t.stats["failures"] += 1
                if not t.stats["last_error"]:
                    t.stats["last_error"] = ("stream ended" if status[0] == 0
                                             else f"{status[0]}: {status[1]}")
        # Whatever this stream still owed goes back to the queue for another target.
        for bid, p in self.pending.items():
            if p.conn is conn and not p.complete:
                self._unassign(p)
                self.unassigned.add(bid)
                self.stats["resent"] += 1
