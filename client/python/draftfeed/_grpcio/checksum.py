"""The BatchDone payload checksum (kernels/checksum_terms.h) in numpy.

The payload's n bytes are little-endian 64-bit words w_i (the last zero-padded); word i is
lane i % 8 of stripe i // 8 and adds

    x_i = w_i ^ (LaneKey(i % 8) + (i // 8) * kStripeStep)
    term_i = lo32(x_i) * hi32(x_i) + w_i            (mod 2^64)

to its lane's sum; the eight sums are folded with the byte count (finish()). numpy's uint64
array arithmetic wraps mod 2^64, which is the definition's arithmetic; scalars are computed as
Python ints masked to 64 bits (numpy scalar arithmetic would warn on overflow).

Because a term depends only on the word and its position, any range of whole stripes can be
hashed on its own, in any order and on any thread (numpy releases the GIL in its loops), and the
lane sums added: chunks are hashed as they land, while their bytes are still in cache.
"""

from __future__ import annotations

import threading
from typing import List, Tuple

import numpy as np

LANES = 8
STRIPE_BYTES = 8 * LANES
STRIPE_STEP = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def _mix(w: int) -> int:
    w ^= w >> 31
    w = (w * 0xBF58476D1CE4E5B9) & _M64
    w ^= w >> 29
    return w


LANE_KEYS = [_mix(((lane + 1) * STRIPE_STEP) & _M64) for lane in range(LANES)]

# Stripes hashed per numpy pass: 256 KiB of words, so the three arrays a pass touches stay in
# L2 (1 MiB passes ran at 0.7x the speed of 256 KiB ones).
BLOCK_STRIPES = 4096
# Each word's key at stripe 0 of a block; a block at stripe s adds s * kStripeStep to all.
_KEYS = ((np.arange(BLOCK_STRIPES, dtype=np.uint64) * np.uint64(STRIPE_STEP))[:, None]
         + np.array(LANE_KEYS, dtype=np.uint64)[None, :]).reshape(-1)
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_scratch = threading.local()


def _scratch_arrays():
    s = getattr(_scratch, "arrays", None)
    if s is None:
        n = BLOCK_STRIPES * LANES
        s = _scratch.arrays = (np.empty(n, np.uint64), np.empty(n, np.uint64))
    return s


def _block_sums(words: np.ndarray, stripe: int) -> np.ndarray:
    """Lane sums (uint64 [8]) of `words` (uint64, whole stripes, at most BLOCK_STRIPES), whose
    first word is lane 0 of stripe `stripe`."""
    n = words.size
    x, hi = (a[:n] for a in _scratch_arrays())
    np.add(_KEYS[:n], np.uint64((stripe * STRIPE_STEP) & _M64), out=x)
    np.bitwise_xor(x, words, out=x)
    np.right_shift(x, _SHIFT32, out=hi)
    np.bitwise_and(x, _LOW32, out=x)
    np.multiply(x, hi, out=x)
    np.add(x, words, out=x)
    # 64 columns then a fold to 8: a reduction over 8-wide rows runs 3x slower in numpy.
    if n % 64 == 0:
        return x.reshape(-1, 64).sum(axis=0, dtype=np.uint64).reshape(8, 8).sum(axis=0,
                                                                                 dtype=np.uint64)
    return x.reshape(-1, LANES).sum(axis=0, dtype=np.uint64)


def stripe_sums(buf: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Lane sums of the whole stripes in bytes [start, stop) of `buf` (uint8, the payload from
    its first byte); start and stop are multiples of STRIPE_BYTES."""
    lanes = np.zeros(LANES, np.uint64)
    step = BLOCK_STRIPES * STRIPE_BYTES
    for a in range(start, stop, step):
        b = min(a + step, stop)
        lanes += _block_sums(buf[a:b].view(np.uint64), a // STRIPE_BYTES)
    return lanes


def copy_and_hash(dst: np.ndarray, offset: int, src: np.ndarray) -> Tuple[np.ndarray, int, int]:
    """Copies `src` (uint8) into `dst` (uint8, the payload) at byte `offset`, block by block,
    hashing each block's whole stripes right after copying it. Returns (lane sums, first
    stripe, end stripe) of the stripes hashed: those wholly inside the copied range."""
    n = src.size
    first = -(-offset // STRIPE_BYTES)
    end = (offset + n) // STRIPE_BYTES
    lanes = np.zeros(LANES, np.uint64)
    if end <= first:
        dst[offset:offset + n] = src
        return lanes, first, first
    head = first * STRIPE_BYTES - offset  # bytes before the first whole stripe
    if head:
        dst[offset:offset + head] = src[:head]
    step = BLOCK_STRIPES * STRIPE_BYTES
    for a in range(first * STRIPE_BYTES, end * STRIPE_BYTES, step):
        b = min(a + step, end * STRIPE_BYTES)
        block = dst[a:b]
        np.copyto(block, src[a - offset:b - offset])
        lanes += _block_sums(block.view(np.uint64), a // STRIPE_BYTES)
    tail = end * STRIPE_BYTES
    if tail < offset + n:
        dst[tail:offset + n] = src[tail - offset:]
    return lanes, first, end


def _tail_sums(buf: np.ndarray, start: int, n: int) -> np.ndarray:
    """Lane sums of bytes [start, n) of `buf`, start a multiple of STRIPE_BYTES, fewer than
    STRIPE_BYTES of them: only words that hold payload bytes count (the last zero-padded)."""
    lanes = np.zeros(LANES, np.uint64)
    rest = bytes(buf[start:n]) + b"\0" * (-(n - start) % 8)
    stripe = start // STRIPE_BYTES
    for lane, w in enumerate(np.frombuffer(rest, "<u8").tolist()):
        x = w ^ ((LANE_KEYS[lane] + stripe * STRIPE_STEP) & _M64)
        lanes[lane] = np.uint64((((x & 0xFFFFFFFF) * (x >> 32)) + w) & _M64)
    return lanes


def finish(lanes, n: int) -> int:
    """FinishPayloadChecksum: the eight lane sums folded with the byte count."""
    h = _mix((n * 0xFF51AFD7ED558CCD + 0x2545F4914F6CDD1D) & _M64)
    for lane in range(LANES):
        h = (_mix(h ^ int(lanes[lane])) + lane) & _M64
    return h


class BatchHash:
    """A batch's checksum as its chunks land, in any order: the lane sums of the stripe ranges
    hashed so far. finish() hashes what no landing covered (stripes across chunk boundaries,
    the last partial stripe) from the assembled payload. Not thread-safe: the feed calls it
    under its lock."""

    __slots__ = ("lanes", "ranges")

    def __init__(self):
        self.lanes = np.zeros(LANES, np.uint64)
        self.ranges: List[Tuple[int, int]] = []

    def add(self, lanes: np.ndarray, first: int, end: int) -> None:
        if end > first:
            self.lanes += lanes
            self.ranges.append((first, end))

    def finish(self, buf: np.ndarray, n: int) -> int:
        whole = n // STRIPE_BYTES
        lanes = self.lanes.copy()
        at = 0
        for first, end in sorted(self.ranges):
            if first < at or end > whole:
                raise ValueError(f"BatchHash: stripes [{first}, {end}) hashed twice or past the "
                                 f"payload's {whole}")
            if first > at:
                lanes += stripe_sums(buf, at * STRIPE_BYTES, first * STRIPE_BYTES)
            at = end
        if at < whole:
            lanes += stripe_sums(buf, at * STRIPE_BYTES, whole * STRIPE_BYTES)
        if whole * STRIPE_BYTES < n:
            lanes += _tail_sums(buf, whole * STRIPE_BYTES, n)
        return finish(lanes, n)


def payload_checksum(data) -> int:
    """v1::PayloadChecksum of a bytes-like object or numpy array (its bytes in memory order)."""
    buf = np.frombuffer(memoryview(data).cast("B"), np.uint8) if not isinstance(
        data, np.ndarray) else np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return BatchHash().finish(buf, buf.size)
