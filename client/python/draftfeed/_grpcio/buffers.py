"""Reusable result buffers (common/host_buffer_pool.h's policy, in numpy).

A fresh 200 MB numpy buffer per batch costs a page fault per 4 KiB on first touch; the pool
keeps released buffers and hands them out again, so steady streaming allocates nothing.

A buffer goes back when nothing uses it any more: the array handed out is made from an owner
object's __array_interface__, so every numpy view, DLPack export and torch tensor made from it
keeps the owner alive through its base chain, and the owner's __del__ returns the memory.

That __del__ runs wherever the last reference dies, and a buffer held by a reference cycle (an
exception's traceback whose frames hold a result, say) dies in the cyclic GC, which runs in
whichever thread allocates next: possibly inside this pool's own critical section, in the very
thread that holds its lock. So a release never waits for the lock (see BufferPool._release).
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import List

import numpy as np


def size_class(n: int) -> int:
    """The next quarter octave at or above n bytes (2^k x 1, 1.25, 1.5, 1.75): streamed batches
    differ by a few tokens, so exact sizes would allocate anew for most of them."""
    if n <= 4096:
        return 4096
    k = n.bit_length() - 1
    for q in (4, 5, 6, 7, 8):
        c = (q << k) >> 2
        if c >= n:
            return c
    return 1 << (k + 1)


class _Owner:
    """Exposes the first `n` bytes of a pooled slab as an array; returns the slab at death."""

    __slots__ = ("__array_interface__", "_slab", "_pool")

    def __init__(self, slab: np.ndarray, n: int, pool: "BufferPool"):
        self._slab = slab
        self._pool = pool
        self.__array_interface__ = {"data": (slab.ctypes.data, False), "shape": (n,),
                                    "typestr": "|u1", "version": 3}

    def __del__(self):
        pool = self._pool
        if pool is not None:  # None during interpreter shutdown
            pool._release(self._slab)


class BufferPool:
    """Idle buffers capped at `max_idle_bytes`, except the `keep` most recently released, which
    stay whatever their size (a stream whose batches outgrow the cap still reuses)."""

    def __init__(self, max_idle_bytes: int, keep: int = 2):
        self._mu = threading.Lock()
        self._idle: List[np.ndarray] = []  # by capacity, ascending
        self._order: List[int] = []        # ids of idle slabs, oldest release first
        self._idle_bytes = 0
        self._max_idle = max(0, int(max_idle_bytes))
        self._keep = keep
        # Slabs released while the lock was taken, filed by its next holder (_release).
        self._returned: "collections.deque[np.ndarray]" = collections.deque()
        self.allocations = 0

    def acquire(self, n: int) -> np.ndarray:
        """A writable uint8 array of n bytes, uninitialised."""
        with self._mu:
            self._file_returned_locked()
            sizes = [s.size for s in self._idle]
            i = bisect.bisect_left(sizes, n)
            slab = None
            if i < len(self._idle):
                slab = self._idle.pop(i)
                self._order.remove(id(slab))
                self._idle_bytes -= slab.size
            else:
                self.allocations += 1
        if slab is None:
            slab = np.empty(size_class(n), np.uint8)
        return np.asarray(_Owner(slab, n, self))

    def _release(self, slab: np.ndarray) -> None:
        # Called by _Owner.__del__, so possibly by the cyclic GC in the middle of acquire() or
        # of another release in this same thread, with _mu held: waiting for _mu there would
        # deadlock that thread for good (threading.Lock is not reentrant), and the feed's
        # reader calls acquire() under the feed's lock, so every feed thread then blocks behind
        # it and next() never returns (a CI run hung so, the target idle). Nor may a nested
        # release edit _idle while the interrupted holder is part-way through it (its sizes
        # list would no longer match). So the slab is only queued, which never blocks
        # (deque.append is atomic), and filed now if the lock is free, else by the lock's next
        # holder (the next acquire or release).
        self._returned.append(slab)
        if self._mu.acquire(blocking=False):
            try:
                self._file_returned_locked()
            finally:
                self._mu.release()

    def _file_returned_locked(self) -> None:
        """Files the queued released slabs among the idle ones, then applies the idle cap."""
        while self._returned:
            slab = self._returned.popleft()
            sizes = [s.size for s in self._idle]
            self._idle.insert(bisect.bisect_right(sizes, slab.size), slab)
            self._order.append(id(slab))
            self._idle_bytes += slab.size
        while self._idle_bytes > self._max_idle and len(self._idle) > self._keep:
            oldest = self._order.pop(0)
            j = next(k for k, s in enumerate(self._idle) if id(s) == oldest)
            self._idle_bytes -= self._idle.pop(j).size
