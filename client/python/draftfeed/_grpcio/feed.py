"""The pure-Python feed over grpcio: the compiled module's Feed (client/src/feed.cc and
dispatch.cc) with the same semantics — credits per stream, batches sent to the target that
would finish them soonest, a lost, hung or draining target's batches re-sent elsewhere and
late duplicates dropped by batch id (exactly once), checksums verified, rates in stats().

Every public call returns (code, message, value) like the compiled module's, so draftfeed.Feed
drives either. One lock (`cv`'s) guards the feed's state; payload bytes move without it.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time

import numpy as np

from . import options as _options
from . import proto
from .buffers import BufferPool
from .channel import (INVALID_ARGUMENT, UNAUTHENTICATED, UNAVAILABLE, Credentials, StatusError,
                      dns_name_of, expand_target, query_info)
from .conn import ConnMixin
from .rates import RateWindow, feed_counts, set_feed_rates, set_target_rates, target_counts
from .result import FP8, dequantize_to_bf16, outputs_layout
from .table import Pending, TableMixin

FAILED_PRECONDITION = 9


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _batch_request(batch_id: int, fields: bytes) -> bytes:
    """StreamRequest{batch: {batch_id, <fields>}}: protobuf reads concatenated fields as one
    message, so the token ids are serialized once, at submit, outside the lock."""
    inner = b"\x08" + _varint(batch_id) + fields
    return b"\x12" + _varint(len(inner)) + inner


class Target:
    """One (address, connection) the feed streams from."""

    def __init__(self, impl, address: str, label: str, dns_name: str):
        o = impl.o
        self.address = address
        self.channel = impl.creds.channel(address, dns_name)
        self.stream = self.channel.stream_stream(proto.STREAM_METHOD)  # raw bytes both ways
        self.info = {}
        self.state = "connecting"
        self.conn = None
        self.credits = 1
        self.encoding = "bf16"
        self.bytes_per_token = 0
        self.hidden_bytes_per_token = 0
        self.attempts = 0
        self.backoff_s = o.reconnect_backoff_min_s
        self.next_attempt = 0.0
        self.refusal = None
        self.rate_tps = 0.0
        self.joined_s = impl._since_open()
        self.window = RateWindow(o.stats_window_s, self.joined_s, (0, 0))
        self.stats = {"address": label, "state": "connecting", "outstanding_batches": 0,
                      "outstanding_tokens": 0, "delivered_batches": 0, "delivered_tokens": 0,
                      "failures": 0, "last_error": "", "transport": "", "transport_note": ""}
        self.connector = threading.Thread(target=impl._connect_loop, args=(self,),
                                          name="df-connect", daemon=True)


class Impl(ConnMixin, TableMixin):
    def __init__(self, o: _options.Options):
        self.o = o
        self.cv = threading.Condition(threading.Lock())
        self.opened_at = time.monotonic()
        self.creds = Credentials(o.tls, o.token)
        self.requested_encoding = _options.ENCODINGS[o.encoding]
        self.outputs_layout = outputs_layout(o.argmax, o.top_k, int(o.draft_vocab.size),
                                             o.probs_encoding)
        self.pool = BufferPool(2 * o.prefetch_bytes)
        threads = _options.copy_threads(o)
        self.executor = (concurrent.futures.ThreadPoolExecutor(threads, "df-copy")
                         if threads else None)
        self.fingerprint = o.expected_fingerprint
        self.fingerprint_source = "FeedOptions.expected_fingerprint" if self.fingerprint else ""
        self.hidden_size = 0
        self.targets = []
        self.dns_targets = []
        self.next_dns_refresh = 0.0
        self.pending = {}  # batch id -> Pending, in submission order
        self.unassigned = set()
        self.dead_conns = []
        self.next_id = 1
        self.outstanding_bytes = 0
        self.stats = {k: 0 for k in ("submitted", "delivered", "failed", "resent",
                                     "duplicates_dropped", "cancelled", "tokens_delivered",
                                     "bytes_received", "outstanding")}
        self.window = RateWindow(o.stats_window_s, 0.0, (0, 0, 0))
        self.final_stats = None
        self.fatal = None  # (code, message): no target for unavailable_timeout_s
        self.no_target_since = None
        self.closing = False
        self.supervisor = None

    def _since_open(self) -> float:
        return time.monotonic() - self.opened_at

    def _bytes_per_token(self) -> int:
        """What a token weighs before a stream says (prefetch_bytes)."""
        k, h = len(self.o.layers), self.hidden_size
        hidden = k * h * 2 if self.o.encoding == "bf16" else k * h + 4 * k
        return hidden + self.outputs_layout["bytes"]

    # -- targets ------------------------------------------------------------------------------

    def _add_target_locked(self, address: str, dns_name: str) -> None:
        if any(t.address == address for t in self.targets):
            return
        for i in range(self.o.connections_per_target):
            label = address if i == 0 else f"{address} #{i + 1}"
            t = Target(self, address, label, dns_name)
            self.targets.append(t)
            t.connector.start()

    def _add_targets(self, target: str) -> None:
        addresses = expand_target(target)
        with self.cv:
            if target.startswith("dns:///"):
                self.dns_targets.append(target)
            for a in addresses:
                self._add_target_locked(a, dns_name_of(target))
            self.cv.notify_all()

    def _any_live(self) -> bool:
        return any(t.state == "live" for t in self.targets)

    def _target_errors(self) -> str:
        return "; ".join(f"{t.address}: {t.stats['last_error'] or 'no answer'}"
                         for t in self.targets)

    def open(self) -> None:
        o = self.o
        addresses = [(a, dns_name_of(t)) for t in o.targets for a in expand_target(t)]
        if not self.fingerprint:
            # The first target that answers fixes the model every other must match.
            errors, all_unauthenticated = [], True
            for a, dns_name in addresses:
                channel = self.creds.channel(a, dns_name)
                try:
                    info = query_info(channel, a, o.connect_timeout_s, self.creds)
                except StatusError as e:
                    errors.append(e.message)
                    all_unauthenticated &= e.code == UNAUTHENTICATED
                    continue
                finally:
                    channel.close()
                self.fingerprint = info["fingerprint"]
                self.fingerprint_source = f"{a} ({info['model_id']})"
                self.hidden_size = info["hidden_size"]
                break
            if not self.fingerprint:
                raise StatusError(UNAUTHENTICATED if all_unauthenticated else UNAVAILABLE,
                                  "no target could be reached: " + "; ".join(errors))
        for t in o.targets:
            self._add_targets(t)
        with self.cv:
            self.cv.wait_for(lambda: all(t.state != "connecting" for t in self.targets))
            refused = [t.refusal for t in self.targets if t.state == "refused"]
            if refused and len(refused) == len(self.targets):
                raise StatusError(refused[0][0], "; ".join(m for _, m in refused))
            if not self._any_live():
                raise StatusError(UNAVAILABLE,
                                  f"no target could be reached: {self._target_errors()}")
            if not self.hidden_size:
                for t in self.targets:
                    if t.state == "live":
                        self.hidden_size = t.info["hidden_size"]
        self.supervisor = threading.Thread(target=self._supervise_loop, name="df-supervise",
                                           daemon=True)
        self.supervisor.start()

    # -- dispatch and supervision ---------------------------------------------------------------

    def _dispatch(self) -> None:
        """Sends unassigned batches, oldest first, each to the live target that would finish
        it soonest ((its outstanding tokens + this batch) / its measured rate); when that one
        has no free credit the batch waits for it rather than going to a slower target."""
        while self.unassigned:
            bid = min(self.unassigned)
            p = self.pending[bid]
            tokens = p.token_ids.size
            rates = [t.rate_tps for t in self.targets if t.state == "live" and t.rate_tps > 0]
            default_rate = sum(rates) / len(rates) if rates else 1.0
            best, best_eta = None, 0.0
            for t in self.targets:
                if t.state != "live":
                    continue
                rate = t.rate_tps if t.rate_tps > 0 else default_rate
                eta = (t.stats["outstanding_tokens"] + tokens) / rate
                if best is None or eta < best_eta:
                    best, best_eta = t, eta
            if best is None or best.stats["outstanding_batches"] >= best.credits:
                return
            self.unassigned.discard(bid)
            p.target = best
            p.conn = best.conn
            p.buffer = None  # the stream's chunks bring a fresh one
            p.tokens_received = 0
            p.last_progress = time.monotonic()
            best.stats["outstanding_batches"] += 1
            best.stats["outstanding_tokens"] += tokens
            p.conn.wq.push(_batch_request(bid, p.request))

    def _record_windows(self) -> None:
        now = self._since_open()
        self.window.record(now, feed_counts(self.stats))
        for t in self.targets:
            t.window.record(now, target_counts(t.stats))

    def _supervise_loop(self) -> None:
        o = self.o
        with self.cv:
            while not self.closing:
                now = time.monotonic()
                self._dispatch()
                self._record_windows()
                for bid, p in self.pending.items():  # hung targets
                    if p.complete or p.conn is None:
                        continue
                    if now - max(p.last_progress, p.conn.last_progress) > o.batch_timeout_s:
                        t = p.target
                        t.stats["last_error"] = (f"no progress on batch {bid} for "
                                                 f"{o.batch_timeout_s:g}s; treating it as hung")
                        if t.state == "live":
                            t.state = "down"
                        p.conn.cancel()  # the reader re-sends its batches
                        p.last_progress = now
                if self._any_live() or not self.pending:
                    self.no_target_since = None
                elif self.no_target_since is None:
                    self.no_target_since = now
                elif self.fatal is None and now - self.no_target_since > o.unavailable_timeout_s:
                    self.fatal = (UNAVAILABLE, f"no target reachable for "
                                               f"{o.unavailable_timeout_s:g}s: "
                                               f"{self._target_errors()}")
                    for bid, p in self.pending.items():
                        if not p.complete:
                            self._fail(bid, p, self.fatal)
                    self.cv.notify_all()
                if self.dns_targets and now >= self.next_dns_refresh:
                    self.next_dns_refresh = now + o.dns_refresh_s
                    names = list(self.dns_targets)
                    self.cv.release()
                    found = []
                    try:
                        for n in names:
                            try:
                                found += [(a, dns_name_of(n)) for a in expand_target(n)]
                            except StatusError:
                                pass
                    finally:
                        self.cv.acquire()
                    for a, name in found:
                        self._add_target_locked(a, name)
                dead, self.dead_conns = self.dead_conns, []
                if dead:
                    self.cv.release()
                    try:
                        for c in dead:
                            c.reader.join()
                    finally:
                        self.cv.acquire()
                self.cv.wait(0.02)

    # -- the public calls -----------------------------------------------------------------------

    def submit(self, token_ids: np.ndarray, seq_lens: np.ndarray) -> int:
        token_ids = np.array(token_ids, dtype=np.int32).reshape(-1)  # a copy the caller
        seq_lens = np.array(seq_lens, dtype=np.int32).reshape(-1)    # cannot change
        batch = proto.Batch()
        batch.token_ids.extend(token_ids.tolist())
        batch.seq_lens.extend(seq_lens.tolist())
        fields = batch.SerializeToString()
        with self.cv:
            nbytes = token_ids.size * self._bytes_per_token()
            s = self.stats
            self.cv.wait_for(lambda: self.closing or self.fatal is not None or (
                s["outstanding"] < self.o.prefetch and (
                    s["outstanding"] == 0
                    or self.outstanding_bytes + nbytes <= self.o.prefetch_bytes)))
            if self.closing:
                raise StatusError(FAILED_PRECONDITION, "feed is closed")
            if self.fatal is not None:
                raise StatusError(*self.fatal)
            bid = self.next_id
            self.next_id += 1
            self.pending[bid] = Pending(token_ids, seq_lens, fields)
            self.unassigned.add(bid)
            self.outstanding_bytes += nbytes
            s["submitted"] += 1
            s["outstanding"] += 1
            self._dispatch()
            return bid

    def next(self):
        with self.cv:
            if not self.pending:
                raise StatusError(FAILED_PRECONDITION,
                                  "Next() with no batch outstanding: Submit first")
            found = []

            def ready():
                if self.closing or not self.pending:
                    return True
                for bid, p in self.pending.items():
                    if p.complete:
                        found[:] = [bid]
                        return True
                    if self.o.ordered:
                        return False
                return False

            self.cv.wait_for(ready)
            if not found:
                raise StatusError(FAILED_PRECONDITION, "feed is closed")
            bid = found[0]
            p = self.pending.pop(bid)
            self.stats["outstanding"] -= 1
            self.outstanding_bytes -= p.token_ids.size * self._bytes_per_token()
            self.cv.notify_all()
            if p.error is not None:
                raise StatusError(*p.error)
            self.stats["delivered"] += 1
            self.stats["tokens_delivered"] += p.token_ids.size
            self.window.record(self._since_open(), feed_counts(self.stats))
        r = p.result
        if r.encoding == FP8 and not self.o.fp8_raw:
            dequantize_to_bf16(r, self.pool.acquire)
        return r

    def cancel_locked(self, batch_ids) -> int:
        ids = list(batch_ids) if batch_ids else list(self.pending)
        n = 0
        for bid in ids:
            p = self.pending.get(bid)
            if p is None:
                continue
            if p.conn is not None and not p.complete:
                # Only cancelling its stream stops the target computing it.
                c = p.conn
                if not c.cancelled_by_client:
                    c.cancelled_by_client = True
                    c.cancel()
            self._unassign(p)
            self.unassigned.discard(bid)
            self.outstanding_bytes -= p.token_ids.size * self._bytes_per_token()
            del self.pending[bid]
            self.stats["outstanding"] -= 1
            self.stats["cancelled"] += 1
            n += 1
        self.cv.notify_all()
        return n

    def close(self) -> None:
        with self.cv:
            if self.closing:
                return
            self.closing = True
            self.cancel_locked([])  # nobody can take what is outstanding: do not compute it
            conns = [t.conn for t in self.targets if t.conn is not None]
            self.cv.notify_all()
        if self.supervisor is not None:
            self.supervisor.join()
        for c in conns:  # half-close: targets finish what they hold, then end the stream
            c.wq.close(drop_queued=False)
        with self.cv:
            self.cv.wait_for(lambda: all(c.finished for c in conns),
                             timeout=self.o.batch_timeout_s)
            for c in conns:
                if not c.finished:
                    c.cancel()
        for t in self.targets:
            t.connector.join()
        with self.cv:
            dead, self.dead_conns = self.dead_conns, []
        for c in conns + dead:
            if c.reader is not None:
                c.reader.join()
        if self.executor is not None:
            self.executor.shutdown(wait=True)
        for t in self.targets:
            t.channel.close()
        with self.cv:
            self.final_stats = self.stats_locked()
            self.final_stats["closed"] = True

    def stats_locked(self) -> dict:
        s = dict(self.stats)
        now = self._since_open()
        set_feed_rates(now, self.window, s)
        s["outstanding_bytes"] = self.outstanding_bytes
        s["waiting_dispatch"] = len(self.unassigned)
        s["buffer_allocations"] = self.pool.allocations
        s["live_targets"] = 0
        s["closed"] = False
        s["targets"] = []
        for t in self.targets:
            ts = dict(t.stats)
            set_target_rates(now, t.joined_s, t.window, ts)
            ts["state"] = t.state
            s["live_targets"] += t.state == "live"
            s["targets"].append(ts)
        return s


def _result(fn, *args):
    try:
        return 0, "", fn(*args)
    except StatusError as e:
        return e.code, e.message, None


class Feed:
    """The compiled module's Feed interface (draftfeed/__init__.py drives it)."""

    def __init__(self, impl: Impl):
        self._impl = impl

    @staticmethod
    def open(targets, layers, opts: dict):
        o = _options.parse(targets, layers, opts)  # ValueError for unknown keys, bad names
        try:
            _options.check(o)
            impl = Impl(o)
        except StatusError as e:
            return e.code, e.message, None
        try:
            impl.open()
        except StatusError as e:
            impl.close()
            return e.code, e.message, None
        return 0, "", Feed(impl)

    def add_target(self, address: str):
        def add():
            with self._impl.cv:
                if self._impl.closing:
                    raise StatusError(FAILED_PRECONDITION, "feed is closed")
            self._impl._add_targets(address)

        return _result(add)

    def submit(self, token_ids, seq_lens):
        return _result(self._impl.submit, token_ids, seq_lens)

    def next(self):
        return _result(self._impl.next)

    def cancel(self, batch_ids) -> int:
        with self._impl.cv:
            return self._impl.cancel_locked([int(b) for b in batch_ids])

    def close(self):
        self._impl.close()
        return 0, "", None

    def stats(self) -> dict:
        impl = self._impl
        with impl.cv:
            if impl.final_stats is not None:
                return {**impl.final_stats, "targets": [dict(t) for t in
                                                         impl.final_stats["targets"]]}
            return impl.stats_locked()

    def target(self) -> dict:
        for t in self._impl.targets:
            if t.info.get("fingerprint"):
                return dict(t.info)
        return dict(self._impl.targets[0].info)

    def __del__(self):
        # At interpreter exit the feed's (daemon) threads may be frozen: joining them would
        # hang, and the process ending closes the connections anyway.
        if sys.is_finalizing() or self._impl.final_stats is not None:
            return
        # The last reference dies wherever the cyclic GC happens to run: on one of the feed's
        # own threads (which close() joins), or on any thread while it holds the feed's lock
        # (an allocation inside `with cv:` can collect), where close() would wait on that
        # lock forever. So the close runs on a thread of its own, and this returns at once.
        threading.Thread(target=_close_quietly, args=(self._impl,), name="draftfeed-close",
                         daemon=True).start()


def _close_quietly(impl) -> None:
    try:
        impl.close()
    except Exception:  # noqa: BLE001 - nobody is left to hear it: the feed was dropped
        pass


__all__ = ["Feed", "INVALID_ARGUMENT"]
