"""draftfeed.vocab's counting: how often each target id occurs in a dataset (TokenCounter,
count_tokens), the input a draft vocabulary is chosen from. Pure numpy."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable, Iterable, List, Optional, Tuple, Union

import numpy as np

from .vocab_files import _as_numpy, _is_int_dtype, _is_torch, _where

if TYPE_CHECKING:
    from .vocab import DraftVocab

__all__ = ["TokenCounter", "count_tokens"]


# --------------------------------------------------------------------------------------------
# counting

class TokenCounter:
    """Streaming counts of target token ids: one int64 array of `vocab_size` counters, however
    many sequences go through `update`.

    `update(token_ids, loss_mask=None)` takes a 1-D sequence or a 2-D batch (padded rows, the
    mask saying which positions count), as a list, numpy array or torch tensor; a list of rows
    of different lengths works too. With a mask only its nonzero (1 / True) positions are
    counted, and only those are checked, so padding may hold any value (e.g. -100).
    Counters over shards of a dataset merge with `a + b`, `a.merge(b)`, `a += b` or
    `sum(counters)`.
    """

    def __init__(self, vocab_size: int, counts=None):
        vocab_size = _positive_int(vocab_size, "vocab_size")
        self.vocab_size = vocab_size
        if counts is None:
            self._counts = np.zeros(vocab_size, dtype=np.int64)
        else:
            c = _as_numpy(counts, "counts")
            if c.shape != (vocab_size,) or not _is_int_dtype(c.dtype):
                raise ValueError(f"counts must be integers of shape ({vocab_size},), "
                                 f"got {c.dtype} {c.shape}")
            if c.size and c.min() < 0:
                raise ValueError(f"counts must be non-negative: counts[{int(np.argmin(c))}] "
                                 f"is {int(c.min())}")
            self._counts = c.astype(np.int64, copy=True)
        self.sequences = 0  # how many sequences (rows) went through update

    @property
    def counts(self) -> np.ndarray:
        """The int64 [vocab_size] counts (a read-only view; `.copy()` for your own)."""
        view = self._counts.view()
        view.flags.writeable = False
        return view

    @property
    def tokens(self) -> int:
        """How many tokens were counted (the masked-in ones)."""
        return int(self._counts.sum())

    def update(self, token_ids, loss_mask=None) -> "TokenCounter":
        """Counts the ids of one sequence ([T]) or a batch ([B, T]) where `loss_mask` (same
        shape; 0/1 or bool) is nonzero; every position without a mask. Everything is checked
        before anything is counted: a refused update counts nothing. Returns self."""
        if isinstance(token_ids, (list, tuple)) and token_ids and _is_row_list(token_ids):
            ids = _try_regular(token_ids)
            if ids is None:  # rows of different lengths: each on its own
                masks = _rows_of_mask(loss_mask, len(token_ids))
                picked = [self._select(_as_numpy(row, f"token_ids[{r}]"),
                                       None if masks is None else masks[r], prefix=(r,))
                          for r, row in enumerate(token_ids)]
                for chosen in picked:
                    self._count(chosen)
                self.sequences += len(token_ids)
                return self
        else:
            ids = _as_numpy(token_ids, "token_ids")
        mask = None if loss_mask is None else _as_numpy(loss_mask, "loss_mask")
        self._count(self._select(ids, mask, prefix=()))
        self.sequences += 1 if ids.ndim == 1 else ids.shape[0]
        return self

    def _select(self, ids: np.ndarray, mask: Optional[np.ndarray], prefix: Tuple[int, ...]
                ) -> np.ndarray:
        """The ids to count, flat, after checking shapes, dtypes, the mask and the range."""
        row = f" at row {prefix[0]}" if prefix else ""
        if ids.ndim not in (1, 2) or (prefix and ids.ndim != 1):
            raise ValueError(f"token_ids must be 1-D [T] or 2-D [B, T], got shape "
                             f"{ids.shape}{row}")
        if mask is not None and mask.shape != ids.shape:
            raise ValueError(f"loss_mask's shape {mask.shape} is not token_ids' "
                             f"{ids.shape}{row}")
        if ids.size == 0:
            return ids.reshape(0).astype(np.int64)
        if ids.dtype.kind not in "iu":
            raise ValueError(f"token_ids must be integers, got {ids.dtype}{row}")
        shape = ids.shape
        if mask is not None:
            if mask.dtype != np.bool_:
                bad = (mask != 0) & (mask != 1)
                if bad.any():
                    at = tuple(int(i) for i in np.argwhere(bad)[0])
                    raise ValueError(f"loss_mask must hold 0/1 (or bool): position "
                                     f"{_where(prefix + at)} is {mask[at].item()!r}")
                mask = mask != 0
            ids = ids[mask]  # the counted ids, in row-major order
        else:
            ids = ids.reshape(-1)
        if ids.size == 0:
            return ids
        if ids.size <= _SMALL:  # Python's min/max beat numpy's on a few ids
            listed = ids.tolist()
            lo, hi = min(listed), max(listed)
        else:
            lo, hi = ids.min(), ids.max()
        if lo < 0 or hi >= self.vocab_size:
            k = int(np.argmax((ids < 0) | (ids >= self.vocab_size)))  # the first bad one
            at = (np.argwhere(mask)[k] if mask is not None else np.unravel_index(k, shape))
            raise ValueError(f"token id {int(ids[k])} at position "
                             f"{_where(prefix + tuple(int(i) for i in at))} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        return ids

    def _count(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        if ids.size <= _SMALL:  # a short sequence: no vocab-sized temporary, no sort
            counts = self._counts
            for t in ids.tolist():
                counts[t] += 1
        elif ids.size * 16 >= self.vocab_size:
            self._counts += np.bincount(ids, minlength=self.vocab_size)
        else:
            u, c = np.unique(ids, return_counts=True)
            self._counts[u] += c

    def merge(self, other: "TokenCounter") -> "TokenCounter":
        """A new counter holding both counts (shards of one dataset)."""
        if not isinstance(other, TokenCounter):
            raise TypeError(f"cannot merge a TokenCounter with {type(other).__name__}")
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge counters of vocab_size {self.vocab_size} and "
                             f"{other.vocab_size}")
        out = TokenCounter(self.vocab_size, self._counts + other._counts)
        out.sequences = self.sequences + other.sequences
        return out

    def __add__(self, other):
        if not isinstance(other, TokenCounter):
            return NotImplemented
        return self.merge(other)

    def __radd__(self, other):
        if isinstance(other, int) and other == 0:  # sum(counters)
            out = TokenCounter(self.vocab_size, self._counts)
            out.sequences = self.sequences
            return out
        return NotImplemented

    def __iadd__(self, other):
        if not isinstance(other, TokenCounter):
            return NotImplemented
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"cannot merge counters of vocab_size {self.vocab_size} and "
                             f"{other.vocab_size}")
        self._counts += other._counts
        self.sequences += other.sequences
        return self

    def __eq__(self, other):
        if not isinstance(other, TokenCounter):
            return NotImplemented
        return self.vocab_size == other.vocab_size and np.array_equal(self._counts,
                                                                      other._counts)

    def most_common(self, n: int) -> List[Tuple[int, int]]:
        """The n most frequent (id, count) pairs, ties to the lower id."""
        order = _frequency_order(self._counts)[:max(0, int(n))]
        return [(int(i), int(self._counts[i])) for i in order]

    def draft_vocab(self, size: int) -> "DraftVocab":
        """`DraftVocab.from_counts(self.counts, size)`."""
        from .vocab import DraftVocab  # vocab builds on this module

        return DraftVocab.from_counts(self._counts, size)

    def __repr__(self):
        return (f"TokenCounter(vocab_size={self.vocab_size}, sequences={self.sequences}, "
                f"tokens={self.tokens}, distinct={int(np.count_nonzero(self._counts))})")


_SMALL = 64  # ids per update below which counting goes id by id


def _is_row_list(x) -> bool:
    first = x[0]
    return isinstance(first, (list, tuple, np.ndarray)) or _is_torch(first)


def _try_regular(rows) -> Optional[np.ndarray]:
    lengths = {len(r) for r in rows}
    if len(lengths) != 1:
        return None
    return np.stack([_as_numpy(r, "token_ids row") for r in rows])


def _rows_of_mask(loss_mask, n: int):
    if loss_mask is None:
        return None
    if isinstance(loss_mask, (list, tuple)):
        if len(loss_mask) != n:
            raise ValueError(f"loss_mask has {len(loss_mask)} rows, token_ids {n}")
        return [_as_numpy(m, f"loss_mask[{r}]") for r, m in enumerate(loss_mask)]
    m = _as_numpy(loss_mask, "loss_mask")
    if m.ndim != 2 or m.shape[0] != n:
        raise ValueError(f"loss_mask of shape {m.shape} does not match {n} rows of token_ids")
    return list(m)


def _positive_int(x, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{what} must be an int, got {x!r}")
    if x <= 0:
        raise ValueError(f"{what} must be positive, got {int(x)}")
    return int(x)


def count_tokens(dataset: Iterable, vocab_size: int, *, input_ids_key: str = "input_ids",
                 loss_mask_key: Optional[str] = "loss_mask",
                 progress: Union[bool, Callable[[int, int], None]] = False,
                 total: Optional[int] = None,
                 counter: Optional[TokenCounter] = None) -> np.ndarray:
    """Counts target ids over `dataset` and returns the int64 [vocab_size] counts.

    Items are id sequences ([T] or [B, T]: lists, numpy, torch) or mappings (a HF dataset's
    rows) with `input_ids_key` and, when present, `loss_mask_key` (EAGLE-3 counts only the
    tokens the loss is taken on; `loss_mask_key=None` counts every token). The dataset is
    read once, item by item, so an endless or huge stream needs no more memory than the
    counts. `progress=True` shows a tqdm bar (a line on stderr without tqdm); a callable is
    called as `progress(items, tokens_counted)` about twice a second and at the end.
    `counter` continues an existing TokenCounter (it is updated in place).
    """
    if counter is None:
        counter = TokenCounter(vocab_size)
    elif counter.vocab_size != vocab_size:
        raise ValueError(f"counter has vocab_size {counter.vocab_size}, not {vocab_size}")
    report = _progress(progress, total)
    items, last = 0, 0.0
    try:
        for item in dataset:
            if isinstance(item, Mapping):
                if input_ids_key not in item:
                    raise ValueError(f"dataset item {items} has no {input_ids_key!r} key "
                                     f"(it has {sorted(map(str, item))})")
                mask = item.get(loss_mask_key) if loss_mask_key is not None else None
                try:
                    counter.update(item[input_ids_key], mask)
                except ValueError as e:
                    raise ValueError(f"dataset item {items}: {e}") from None
            else:
                try:
                    counter.update(item)
                except ValueError as e:
                    raise ValueError(f"dataset item {items}: {e}") from None
            items += 1
            if report is not None:
                now = time.monotonic()
                if now - last >= 0.5:
                    last = now
                    report(items, counter.tokens)
        if report is not None:
            report(items, counter.tokens)
    finally:
        if report is not None and hasattr(report, "close"):
            report.close()
    return counter.counts.copy()


class _TqdmProgress:
    def __init__(self, bar):
        self.bar, self.n = bar, 0

    def __call__(self, items, tokens):
        self.bar.update(items - self.n)
        self.n = items
        self.bar.set_postfix_str(f"{tokens:,} tokens", refresh=False)

    def close(self):
        self.bar.close()


class _LineProgress:
    def __call__(self, items, tokens):
        sys.stderr.write(f"\rcounting tokens: {items:,} sequences, {tokens:,} tokens")
        sys.stderr.flush()

    def close(self):
        sys.stderr.write("\n")


def _progress(progress, total):
    if progress is False or progress is None:
        return None
    if callable(progress) and progress is not True:
        return progress
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineProgress()
    return _TqdmProgress(tqdm(desc="counting tokens", unit="seq", total=total,
                              dynamic_ncols=True))


def _frequency_order(counts: np.ndarray) -> np.ndarray:
    """Ids by count descending, ties by id ascending (a stable sort of -counts)."""
    return np.argsort(-counts, kind="stable")
