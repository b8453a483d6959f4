"""The pure-Python client's result buffer pool (draftfeed/_grpcio/buffers.py) when the cyclic GC
frees a buffer in the middle of the pool's own critical section.

A result's buffer goes back to the pool from its owner's __del__, and a buffer held by a reference
cycle (an exception's traceback whose frames hold a result: Feed.map re-raising a batch's error
makes one) is freed by the cyclic GC, which runs in whichever thread allocates next. When that is
the thread holding the pool's lock (the feed's reader allocates inside acquire(), under the feed's
lock too), a release that waited for the lock deadlocked the thread, and with it the whole feed:
a CI run hung in test_feed_property, the target idle, every thread waiting.

The pool's lock is swapped here for one that runs a full collection right after it is taken (so
the GC lands inside the critical section every time, not by chance) and that refuses, by raising,
a blocking acquire by the thread already holding it (the deadlock, caught instead of hung)."""

import gc
import threading
import time

import numpy as np
import pytest

pytest.importorskip("grpc")
import draftfeed  # noqa: E402
from draftfeed._grpcio.buffers import BufferPool  # noqa: E402


class CollectingLock:
    """threading.Lock, plus: a full GC right after the next `collect` acquisitions, and a count
    (then an error) for a blocking acquire by its holder, which on a real Lock never returns."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner = None
        self.collect = 0
        self.reentered = 0

    def acquire(self, blocking=True, timeout=-1):
        if blocking and self._owner == threading.get_ident():
            self.reentered += 1
            raise RuntimeError("blocking acquire of a lock this thread holds: a deadlock")
        if not self._lock.acquire(blocking, timeout):
            return False
        self._owner = threading.get_ident()
        if self.collect:
            self.collect -= 1
            gc.collect()  # as an allocation under the lock can: finalizers run here
        return True

    def release(self):
        self._owner = None
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


class Cycle:
    """Keeps `what` alive until the cyclic GC frees it (only it can: the object refers to
    itself)."""

    def __init__(self, what):
        self.me = self
        self.what = what


def pool_with_collecting_lock():
    pool = BufferPool(1 << 20)
    lock = CollectingLock()
    pool._mu = lock
    return pool, lock


def address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@pytest.fixture(autouse=True)
def collections_only_where_provoked():
    """No automatic collection (it could free a test's cycle outside the pool's lock, where the
    bug does not show), and no cycle of an earlier test's left for the provoked ones."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if enabled:
        gc.enable()


def test_a_buffer_the_gc_frees_inside_acquire_comes_back():
    pool, lock = pool_with_collecting_lock()
    buf = pool.acquire(1000)
    where = address(buf)
    Cycle(buf)
    del buf
    lock.collect = 1  # the cycle dies inside the next acquire(), its lock held
    again = pool.acquire(1000)
    assert lock.reentered == 0  # the finalizer's release did not wait for the held lock
    assert pool.allocations == 1 and address(again) == where  # the slab came back, reused


def test_a_buffer_the_gc_frees_inside_a_release_comes_back():
    pool, lock = pool_with_collecting_lock()
    first, second = pool.acquire(1000), pool.acquire(5000)
    addresses = {address(first), address(second)}
    Cycle(second)
    del second
    lock.collect = 1  # the cycle dies inside the release of `first`, its lock held
    del first
    assert lock.reentered == 0
    # Both slabs are idle again: the next two acquires allocate nothing.
    assert {address(pool.acquire(1000)), address(pool.acquire(5000))} == addresses
    assert pool.allocations == 2


def test_a_feed_whose_results_die_in_cycles_inside_the_pools_lock(make_target):
    """The feed path of the CI hang: results kept alive by reference cycles, freed by collections
    that run inside the pool's lock, as when the reader claims a chunk (under the feed's lock
    too) and acquires its batch's buffer."""
    target = make_target()
    rng = np.random.default_rng(5)
    batches = [(rng.integers(0, 4096, size=n, dtype=np.int32), np.array([n], np.int32))
               for n in (3, 17, 9, 30, 1, 12, 25, 8)]
    with draftfeed.Feed(targets=[target.address], layers=[0, -1], prefetch=4,
                        transport="grpcio") as feed:
        pool = feed._feed._impl.pool
        lock = CollectingLock()
        pool._mu = lock
        lock.collect = 10 ** 9  # every acquisition collects
        got = []
        for r in feed.map(batches):
            got.append((r.batch_id, r.token_ids.copy(), r.hidden_bits.shape))
            Cycle(r)  # dies in a later collection, inside the pool's lock
        del r
        stats = feed.stats()
    lock.collect = 0
    assert lock.reentered == 0
    assert [g[0] for g in got] == list(range(1, len(batches) + 1))
    for (tokens, _), (_, ids, shape) in zip(batches, got):
        np.testing.assert_array_equal(ids, tokens)
        assert shape == (len(tokens), 2, 128)
    assert stats["delivered"] == len(batches) and stats["failed"] == 0
    gc.collect()  # the last results' cycles, outside the lock
    # Every buffer the pool allocated came back to it: none was lost in a finalizer.
    assert len(pool._idle) == pool.allocations == stats["buffer_allocations"]


def test_a_feed_dropped_on_a_thread_holding_its_lock_closes_without_deadlock(make_target):
    """The grpcio Feed's __del__ closes the feed. Its last reference can die inside a thread's
    `with cv:` (a collection runs wherever an allocation happens), and close() takes cv: run
    there, it waited on the lock its own thread held, and that thread and the feed hung. The
    close now runs on a thread of its own, once the lock is free."""
    target = make_target()
    feed = draftfeed.Feed(targets=[target.address], layers=[0, -1], transport="grpcio")
    batch = (np.arange(7, dtype=np.int32), np.array([7], np.int32))
    assert [r.batch_id for r in feed.map([batch])] == [1]
    inner = feed._feed
    impl = inner._impl
    feed._feed = None  # the public wrapper's reference gone: `inner` is the last one
    del feed
    dropped = threading.Event()

    def drop_holding_the_lock():
        nonlocal inner
        with impl.cv:
            inner = None  # Feed.__del__ runs here
        dropped.set()

    t = threading.Thread(target=drop_holding_the_lock, daemon=True)
    t.start()
    assert dropped.wait(10), "Feed.__del__ blocked on the lock its own thread holds"
    deadline = time.monotonic() + 30
    while impl.final_stats is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert impl.final_stats is not None and impl.final_stats["closed"]
    assert impl.final_stats["delivered"] == 1
