"""Draft vocabularies for EAGLE-3 drafters: count target tokens, pick the N most frequent, and
read and write the `d2t` / `t2d` buffers drafter checkpoints carry (numpy only; torch is used
when given torch tensors or asked for a .pt/.bin file, and imported only then).

An EAGLE-3 drafter predicts over a draft vocabulary: the N most frequent target token ids in
its training data (N = 32,000 typically), counted over the loss-masked tokens only. Draft id
d is the d-th smallest selected target id. Checkpoints hold two buffers that say which:

- `t2d`: bool [target_vocab], True where a target id is in the draft vocabulary;
- `d2t`: int64 [draft_vocab], offsets: `target_id = draft_id + d2t[draft_id]`.

SpecForge's and EAGLE's trainers save them as a standalone `{"d2t": ..., "t2d": ...}` torch
file (SpecForge's vocab-mapping cache, EAGLE's `cache.pt`) and as buffers among the drafter's
weights (`model.safetensors` from save_pretrained, or `pytorch_model.bin`); vLLM and SGLang
read `d2t` from the drafter checkpoint and skip `t2d`. `DraftVocab.load` reads any of these.

Usage::

    import draftfeed
    from draftfeed import vocab

    # 1. Count the target ids the drafter is trained on (loss_mask == 1), streaming.
    #    vocab_size is the target's embedding rows (config.vocab_size, 151,936 for Qwen3:
    #    more than the tokenizer's ids), which is what t2d's length must be.
    counts = vocab.count_tokens(dataset, vocab_size=151936, progress=True)
    #    dataset: any iterable of id sequences or dicts with "input_ids" / "loss_mask";
    #    or shard it: one TokenCounter per worker, then `sum(counters)` (or `a + b`).

    # 2. The 32,000 most frequent ids (ties to the lower id), ascending.
    v = vocab.DraftVocab.from_counts(counts, 32000)
    v.save("draft_vocab.safetensors")     # d2t (I64) and t2d (BOOL); or .pt for torch.save
    v = vocab.DraftVocab.load("draft_vocab.safetensors")   # or a drafter checkpoint dir

    # 3. Ask the target for its distribution over those ids.
    with draftfeed.Feed(targets=[...], layers=draftfeed.layers.eagle3(L),
                        draft_vocab=v.ids) as feed:
        ...
    #    and EAGLE-3's loss weights: positions whose target argmax is in the draft vocab
    mask = v.position_mask(argmax, loss_mask)     # t2d[argmax] * loss_mask

The target serves at most 65,536 draft ids. `from draftfeed import vocab` needs the package to
import; this module itself imports nothing of it (nor the compiled module), so the file also
works on its own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import struct
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

__all__ = ["TokenCounter", "count_tokens", "DraftVocab", "read_safetensors",
           "write_safetensors", "safetensors_header", "find_vocab_tensors"]

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------------------------
# numpy / torch plumbing (torch only when it is already loaded: a torch tensor cannot exist
# otherwise, so checking sys.modules never imports it)

def _torch_module():
    return sys.modules.get("torch")


def _is_torch(x) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def _import_torch(why: str):
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{why} needs torch, which is not importable here ({e})") from None
    return torch


def _as_numpy(x, what: str) -> np.ndarray:
    if _is_torch(x):
        return x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except ValueError as e:  # a ragged list
        raise ValueError(f"{what} is ragged or not array-like: {e}") from None


def _is_int_dtype(dtype) -> bool:
    return dtype.kind in "iu"


def _where(index: Tuple[int, ...]) -> str:
    return str(index[0]) if len(index) == 1 else "(" + ", ".join(map(str, index)) + ")"


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


# --------------------------------------------------------------------------------------------
# the draft vocabulary

@dataclasses.dataclass(frozen=True, eq=False)
class DraftVocab:
    """A draft vocabulary: `ids`, the selected target ids ascending (int32; draft id d is
    ids[d], what `Feed(draft_vocab=...)` takes) out of `target_vocab_size` target ids."""

    ids: np.ndarray
    target_vocab_size: int

    def __post_init__(self):
        tv = _positive_int(self.target_vocab_size, "target_vocab_size")
        ids = _as_numpy(self.ids, "ids")
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {ids.shape}")
        if ids.size == 0:
            raise ValueError("a draft vocabulary needs at least one id (size must be > 0)")
        if not _is_int_dtype(ids.dtype):
            raise ValueError(f"ids must be integers, got {ids.dtype}")
        if ids.size > tv:
            raise ValueError(f"{ids.size} draft ids is more than the target's vocabulary "
                             f"({tv})")
        if ids[0] < 0:
            raise ValueError(f"ids[0] is {int(ids[0])}: target ids start at 0")
        if ids[-1] >= tv:
            raise ValueError(f"ids[{ids.size - 1}] is {int(ids[-1])}, outside the target's "
                             f"vocabulary [0, {tv})")
        steps = np.diff(ids.astype(np.int64))
        if steps.size and steps.min() <= 0:
            d = int(np.argmax(steps <= 0)) + 1
            raise ValueError(f"ids must be strictly ascending: ids[{d}] = {int(ids[d])} "
                             f"follows ids[{d - 1}] = {int(ids[d - 1])}")
        ids = ids.astype(np.int32)
        ids.flags.writeable = False
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "target_vocab_size", tv)
        object.__setattr__(self, "_cache", {})

    # -- the buffers ---------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The draft vocabulary's size (d2t's length, t2d's count of True)."""
        return int(self.ids.size)

    def __len__(self) -> int:
        return self.size

    @property
    def d2t(self) -> np.ndarray:
        """int64 [size]: target_id = draft_id + d2t[draft_id]."""
        return self.ids.astype(np.int64) - np.arange(self.size, dtype=np.int64)

    @property
    def t2d(self) -> np.ndarray:
        """bool [target_vocab_size]: True where the target id is in the draft vocabulary."""
        return self._t2d().copy()

    def _t2d(self) -> np.ndarray:
        t = self._cache.get("t2d")
        if t is None:
            t = np.zeros(self.target_vocab_size, dtype=np.bool_)
            t[self.ids] = True
            t.flags.writeable = False
            self._cache["t2d"] = t
        return t

    def _inverse(self) -> np.ndarray:
        inv = self._cache.get("inverse")
        if inv is None:
            inv = np.full(self.target_vocab_size, -1, dtype=np.int64)
            inv[self.ids] = np.arange(self.size)
            inv.flags.writeable = False
            self._cache["inverse"] = inv
        return inv

    def _torch_table(self, name: str, device):
        key = (name, str(device))
        t = self._cache.get(key)
        if t is None:
            torch = _torch_module()
            table = {"t2d": self._t2d, "ids": lambda: self.ids.astype(np.int64),
                     "inverse": self._inverse}[name]()
            t = torch.from_numpy(np.array(table)).to(device)
            self._cache[key] = t
        return t

    def __eq__(self, other):
        if not isinstance(other, DraftVocab):
            return NotImplemented
        return (self.target_vocab_size == other.target_vocab_size
                and np.array_equal(self.ids, other.ids))

    def __hash__(self):
        return hash((self.target_vocab_size, self.ids.tobytes()))

    def __getstate__(self):  # the lookup tables (torch ones on a GPU too) stay behind
        return {"ids": self.ids, "target_vocab_size": self.target_vocab_size}

    def __setstate__(self, state):
        object.__setattr__(self, "ids", state["ids"])
        object.__setattr__(self, "target_vocab_size", state["target_vocab_size"])
        object.__setattr__(self, "_cache", {})

    def __repr__(self):
        return f"DraftVocab(size={self.size}, target_vocab_size={self.target_vocab_size})"

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def from_counts(cls, counts, size: int) -> "DraftVocab":
        """The `size` most frequent ids of `counts` ([target_vocab], or a TokenCounter), ties
        to the lower id. If fewer than `size` ids were ever seen, the lowest unseen ids fill
        it to exactly `size` (with a warning saying how many)."""
        if isinstance(counts, TokenCounter):
            counts = counts.counts
        c = _as_numpy(counts, "counts")
        if c.ndim != 1 or c.size == 0:
            raise ValueError(f"counts must be 1-D [target_vocab], got shape {c.shape}")
        if not (np.issubdtype(c.dtype, np.integer) or np.issubdtype(c.dtype, np.floating)) \
                or c.dtype == np.bool_:
            raise ValueError(f"counts must be numbers, got {c.dtype}")
        if np.issubdtype(c.dtype, np.floating) and not np.isfinite(c).all():
            raise ValueError(f"counts[{int(np.argmax(~np.isfinite(c)))}] is not finite")
        if c.min() < 0:
            raise ValueError(f"counts must be non-negative: counts[{int(np.argmin(c))}] is "
                             f"{c.min().item()}")
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise ValueError(f"size must be an int, got {size!r}")
        if size <= 0:
            raise ValueError(f"size must be positive, got {int(size)}")
        if size > c.size:
            raise ValueError(f"size {int(size)} is more than the target's vocabulary "
                             f"({c.size} counts)")
        size = int(size)
        seen = int(np.count_nonzero(c))
        chosen = np.sort(_frequency_order(c)[:size])
        if seen < size:
            warnings.warn(f"only {seen} distinct target ids were counted, fewer than the "
                          f"draft vocabulary's {size}: the {size - seen} lowest unseen ids "
                          f"fill it", stacklevel=2)
        return cls(chosen, c.size)

    @classmethod
    def from_d2t(cls, d2t, target_vocab_size: int) -> "DraftVocab":
        """From a checkpoint's offsets: ids[d] = d + d2t[d], which must be strictly
        ascending and inside [0, target_vocab_size)."""
        d = _as_numpy(d2t, "d2t")
        if d.ndim != 1:
            raise ValueError(f"d2t must be 1-D [draft_vocab], got shape {d.shape}")
        if d.size and not _is_int_dtype(d.dtype):
            raise ValueError(f"d2t must be integers, got {d.dtype}")
        ids = d.astype(np.int64) + np.arange(d.size, dtype=np.int64)
        try:
            return cls(ids, target_vocab_size)
        except ValueError as e:
            raise ValueError(f"d2t does not give a draft vocabulary (ids = arange + d2t): "
                             f"{e}") from None

    @classmethod
    def from_t2d(cls, t2d) -> "DraftVocab":
        """From a checkpoint's mask: the ids where t2d is True (bool, or 0/1 integers)."""
        t = _as_numpy(t2d, "t2d")
        if t.ndim != 1 or t.size == 0:
            raise ValueError(f"t2d must be 1-D [target_vocab], got shape {t.shape}")
        if t.dtype != np.bool_:
            if not _is_int_dtype(t.dtype):
                raise ValueError(f"t2d must be bool (or 0/1 integers), got {t.dtype}")
            bad = (t != 0) & (t != 1)
            if bad.any():
                k = int(np.argmax(bad))
                raise ValueError(f"t2d must hold 0/1: t2d[{k}] is {int(t[k])}")
            t = t != 0
        ids = np.flatnonzero(t)
        if ids.size == 0:
            raise ValueError("t2d selects no id: a draft vocabulary needs at least one")
        return cls(ids, t.size)

    # -- lookups -------------------------------------------------------------------------------

    def draft_to_target(self, draft_ids):
        """Target ids of draft ids (int, list, numpy or torch; torch stays on its device)."""
        return self._lookup(draft_ids, self.size, "draft id", "ids",
                            lambda a: self.ids.astype(np.int64)[a])

    def target_to_draft(self, target_ids):
        """Draft ids of target ids, -1 where a target id is not in the draft vocabulary."""
        return self._lookup(target_ids, self.target_vocab_size, "target id", "inverse",
                            lambda a: self._inverse()[a])

    def _lookup(self, x, bound: int, what: str, table: str, np_lookup):
        if _is_torch(x):
            if x.is_floating_point() or x.dtype == _torch_module().bool:
                raise ValueError(f"{what}s must be integers, got {x.dtype}")
            if x.numel():
                lo, hi = int(x.min()), int(x.max())
                if lo < 0 or hi >= bound:
                    v = lo if lo < 0 else hi
                    raise ValueError(f"{what} {v} is outside [0, {bound})")
            return self._torch_table(table, x.device)[x.long()]
        scalar = isinstance(x, (int, np.integer)) and not isinstance(x, bool)
        a = _as_numpy(x, f"{what}s")
        if a.size and not _is_int_dtype(a.dtype):
            raise ValueError(f"{what}s must be integers, got {a.dtype}")
        a = a.astype(np.int64)
        if a.size and (a.min() < 0 or a.max() >= bound):
            v = int(a.min()) if a.min() < 0 else int(a.max())
            raise ValueError(f"{what} {v} is outside [0, {bound})")
        out = np_lookup(a)
        return int(out) if scalar else out

    def position_mask(self, argmax, loss_mask=None):
        """EAGLE-3's position mask: t2d[argmax] * loss_mask, where argmax is the target's
        full-vocabulary argmax per position. numpy in, numpy out; torch in, torch out (on
        argmax's device). Without loss_mask: the bool t2d[argmax]. loss_mask has argmax's
        shape (or that plus a trailing 1, EAGLE's [B, T, 1]); the result takes its shape and
        dtype (bool masks give bool)."""
        if _is_torch(argmax):
            return self._position_mask_torch(argmax, loss_mask)
        a = _as_numpy(argmax, "argmax")
        if a.size and not _is_int_dtype(a.dtype):
            raise ValueError(f"argmax must be integers, got {a.dtype}")
        a = a.astype(np.int64)
        _check_range(a.min() if a.size else 0, a.max() if a.size else 0,
                     self.target_vocab_size)
        m = self._t2d()[a]
        if loss_mask is None:
            return m
        lm = _as_numpy(loss_mask, "loss_mask")
        m = _mask_like(m, lm.shape, a.shape)
        if lm.dtype == np.bool_:
            return m & lm
        return m.astype(lm.dtype) * lm

    def _position_mask_torch(self, argmax, loss_mask):
        torch = _torch_module()
        if argmax.is_floating_point() or argmax.dtype == torch.bool:
            raise ValueError(f"argmax must be integers, got {argmax.dtype}")
        if argmax.numel():
            _check_range(int(argmax.min()), int(argmax.max()), self.target_vocab_size)
        m = self._torch_table("t2d", argmax.device)[argmax.long()]
        if loss_mask is None:
            return m
        lm = loss_mask if _is_torch(loss_mask) else torch.as_tensor(np.asarray(loss_mask))
        lm = lm.to(argmax.device)
        m = _mask_like(m, tuple(lm.shape), tuple(argmax.shape))
        if lm.dtype == torch.bool:
            return m & lm
        return m.to(lm.dtype) * lm

    # -- files ---------------------------------------------------------------------------------

    def save(self, path: PathLike) -> pathlib.Path:
        """Writes d2t (int64) and t2d (bool): `.safetensors` with numpy alone (dtypes I64 and
        BOOL), `.pt` / `.bin` with torch.save of {"d2t": ..., "t2d": ...} (the standalone
        vocab-mapping file SpecForge and EAGLE write). Returns the path."""
        p = pathlib.Path(path)
        if p.is_dir():
            raise ValueError(f"{p} is a directory: save needs a file name "
                             f"(draft_vocab.safetensors, vocab_mapping.pt)")
        suffix = p.suffix.lower()
        tensors = {"d2t": self.d2t, "t2d": self.t2d}
        if suffix == ".safetensors":
            write_safetensors(p, tensors, metadata={
                "format": "pt", "draft_vocab_size": str(self.size),
                "target_vocab_size": str(self.target_vocab_size)})
        elif suffix in (".pt", ".bin", ".pth"):
            torch = _import_torch(f"saving {p.name}")
            _atomic_write(p, lambda f: torch.save(
                {k: torch.from_numpy(v) for k, v in tensors.items()}, f))
        else:
            raise ValueError(f"save writes .safetensors, .pt or .bin, not {p.name!r}")
        return p

    @classmethod
    def load(cls, path: PathLike, *, target_vocab_size: Optional[int] = None,
             weights_only: bool = True) -> "DraftVocab":
        """Reads a draft vocabulary from a file `save` wrote, a standalone {"d2t", "t2d"}
        torch file, or a drafter checkpoint (a directory with model.safetensors,
        pytorch_model.bin or their sharded index, or one such file) holding other weights
        too. The tensors are found by name: `d2t` / `t2d`, also prefixed (`draft_model.d2t`,
        `module.t2d`, nested dicts). With both present they must agree (ValueError naming
        the difference); with d2t alone the target's size comes from `target_vocab_size` or
        the directory's config.json (`vocab_size`). torch files are read with
        `weights_only` (pass False only for a file you trust)."""
        found, source = find_vocab_tensors(path, weights_only=weights_only)
        d2t, t2d = found.get("d2t"), found.get("t2d")
        config = _config_near(path)
        v_t2d = cls.from_t2d(t2d) if t2d is not None else None
        if d2t is None:
            v = v_t2d
        else:
            tv = target_vocab_size
            if tv is None and v_t2d is not None:
                tv = v_t2d.target_vocab_size
            if tv is None and isinstance(config.get("vocab_size"), int):
                tv = config["vocab_size"]
            if tv is None:
                raise ValueError(f"{source} holds d2t but no t2d: pass target_vocab_size "
                                 f"(the target's vocab_size)")
            v = cls.from_d2t(d2t, int(tv))
            if v_t2d is not None:
                _check_agree(v, v_t2d, source)
        if target_vocab_size is not None and v.target_vocab_size != target_vocab_size:
            raise ValueError(f"{source}: t2d has {v.target_vocab_size} entries, not "
                             f"target_vocab_size={target_vocab_size}")
        dv = config.get("draft_vocab_size")
        if isinstance(dv, int) and dv != v.size:
            raise ValueError(f"{source} holds {v.size} draft ids but its config.json says "
                             f"draft_vocab_size={dv}")
        return v


def _check_range(lo, hi, bound):
    if lo < 0 or hi >= bound:
        v = int(lo) if lo < 0 else int(hi)
        raise ValueError(f"argmax {v} is outside the target's vocabulary [0, {bound})")


def _mask_like(m, lm_shape: Tuple[int, ...], a_shape: Tuple[int, ...]):
    if tuple(lm_shape) == tuple(a_shape):
        return m
    if tuple(lm_shape) == tuple(a_shape) + (1,):
        return m[..., None]
    raise ValueError(f"loss_mask's shape {tuple(lm_shape)} is neither argmax's "
                     f"{tuple(a_shape)} nor that with a trailing 1")


def _check_agree(from_d2t: DraftVocab, from_t2d: DraftVocab, source) -> None:
    if from_d2t.target_vocab_size != from_t2d.target_vocab_size:
        raise ValueError(f"{source}: d2t and t2d disagree: d2t was read against "
                         f"{from_d2t.target_vocab_size} target ids, t2d has "
                         f"{from_t2d.target_vocab_size}")
    if from_d2t.size != from_t2d.size:
        raise ValueError(f"{source}: d2t and t2d disagree: d2t has {from_d2t.size} draft ids, "
                         f"t2d selects {from_t2d.size}")
    diff = np.flatnonzero(from_d2t.ids != from_t2d.ids)
    if diff.size:
        d = int(diff[0])
        raise ValueError(f"{source}: d2t and t2d disagree at draft id {d}: d2t gives target "
                         f"id {int(from_d2t.ids[d])}, t2d's {d}-th selected id is "
                         f"{int(from_t2d.ids[d])} ({diff.size} draft ids differ)")


# --------------------------------------------------------------------------------------------
# safetensors, with numpy: 8 bytes little-endian header length N, N bytes of JSON
# ({name: {"dtype", "shape", "data_offsets": [begin, end)}, "__metadata__": {str: str}}),
# padded with spaces, then the tensors' little-endian bytes, offsets relative to that buffer.

_ST_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "F16": np.dtype("<f2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F64": np.dtype("<f8"),
}
_ST_NAMES = {(d.kind, d.itemsize): k for k, d in _ST_DTYPES.items()}
# Sizes of the dtypes numpy has no type for (read as raw bits when asked: BF16 -> uint16).
_ST_OTHER = {"BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
             "F8_E8M0": np.dtype("u1"), "F4": None, "F6_E2M3": None, "F6_E3M2": None}
_ST_MAX_HEADER = 100 << 20


def write_safetensors(path: PathLike, tensors: Dict[str, np.ndarray],
                      metadata: Optional[Dict[str, str]] = None) -> None:
    """Writes numpy arrays as a safetensors file (atomically: a temporary file, renamed)."""
    header: Dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata maps strings to strings")
        header["__metadata__"] = dict(metadata)
    blobs, at = [], 0
    for name, arr in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"bad tensor name {name!r}")
        a = np.asarray(arr)
        dtype = _ST_NAMES.get((a.dtype.kind, a.dtype.itemsize))
        if dtype is None:
            raise ValueError(f"safetensors has no dtype for {a.dtype} ({name})")
        raw = np.ascontiguousarray(a, dtype=_ST_DTYPES[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned

    def write(f):
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)

    _atomic_write(pathlib.Path(path), write)


def safetensors_header(path: PathLike) -> Tuple[Dict[str, Any], int]:
    """The parsed JSON header of a safetensors file and the byte offset its data starts at.
    Checks the header (the length, the JSON object, every entry's dtype, shape and offsets
    against the file's size) and raises ValueError naming the first problem."""
    p = pathlib.Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{p} is not a safetensors file: {size} bytes, shorter than the "
                             f"8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > _ST_MAX_HEADER or 8 + n > size:
            raise ValueError(f"{p} is not a safetensors file: its header length {n} does not "
                             f"fit its {size} bytes")
        text = f.read(n)
    if not text.startswith(b"{"):
        raise ValueError(f"{p} is not a safetensors file: the header does not start with '{{'")
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: the safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{p}: the safetensors header is not a JSON object")
    data_size = size - 8 - n
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(e, dict) and isinstance(e.get("dtype"), str)
                and isinstance(e.get("shape"), list)
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2):
            raise ValueError(f"{p}: safetensors entry {name!r} lacks dtype/shape/data_offsets")
        dt = e["dtype"]
        if dt not in _ST_DTYPES and dt not in _ST_OTHER:
            raise ValueError(f"{p}: tensor {name!r} has unknown dtype {dt!r}")
        if not all(isinstance(d, int) and d >= 0 for d in e["shape"]):
            raise ValueError(f"{p}: tensor {name!r} has a bad shape {e['shape']}")
        begin, end = e["data_offsets"]
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_size):
            raise ValueError(f"{p}: tensor {name!r}'s data_offsets {e['data_offsets']} are "
                             f"outside the {data_size} data bytes")
        item = (_ST_DTYPES.get(dt) or _ST_OTHER.get(dt))
        if item is not None:
            want = int(np.prod(e["shape"], dtype=np.int64)) * item.itemsize
            if end - begin != want:
                raise ValueError(f"{p}: tensor {name!r} ({dt} {e['shape']}) needs {want} "
                                 f"bytes, its data_offsets give {end - begin}")
    return header, 8 + n


def read_safetensors(path: PathLike, names: Optional[Iterable[str]] = None
                     ) -> Dict[str, np.ndarray]:
    """Reads tensors of a safetensors file as numpy arrays: all, or only `names` (only their
    bytes are read, so two buffers come out of a large checkpoint cheaply). BF16 and FP8
    tensors come back as their raw bits (uint16 / uint8)."""
    p = pathlib.Path(path)
    header, start = safetensors_header(p)
    wanted = [k for k in header if k != "__metadata__"] if names is None else list(names)
    out = {}
    with open(p, "rb") as f:
        for name in wanted:
            if name not in header or name == "__metadata__":
                raise ValueError(f"{p} holds no tensor {name!r}")
            e = header[name]
            dtype = _ST_DTYPES.get(e["dtype"]) or _ST_OTHER.get(e["dtype"])
            if dtype is None:
                raise ValueError(f"{p}: cannot read {name!r}'s dtype {e['dtype']} with numpy")
            begin, end = e["data_offsets"]
            f.seek(start + begin)
            raw = f.read(end - begin)
            if dtype == np.bool_:
                u = np.frombuffer(raw, dtype=np.uint8)
                if u.size and u.max() > 1:
                    raise ValueError(f"{p}: BOOL tensor {name!r} holds byte {int(u.max())} "
                                     f"(only 0 and 1 are booleans)")
            a = np.frombuffer(raw, dtype=dtype).reshape(e["shape"])
            out[name] = a.astype(dtype.newbyteorder("="), copy=True)
    return out


def _atomic_write(p: pathlib.Path, write: Callable[[Any], None]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# --------------------------------------------------------------------------------------------
# finding d2t / t2d in checkpoints

# The files a drafter checkpoint directory holds its weights in (save_pretrained's names,
# sharded or not), then the standalone mapping files trainers write.
_CHECKPOINT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                     "pytorch_model.bin.index.json")


def _matching(names: Iterable[str], buffer: str) -> List[str]:
    return [n for n in names if n == buffer or n.endswith("." + buffer)]


def _pick(names: List[str], buffer: str, source) -> Optional[str]:
    if not names:
        return None
    if buffer in names:
        return buffer
    if len(names) > 1:
        raise ValueError(f"{source} holds several {buffer} tensors: {sorted(names)}; "
                         f"save the one you mean on its own")
    return names[0]


def _is_safetensors(p: pathlib.Path) -> bool:
    if p.suffix.lower() == ".safetensors":
        return True
    with open(p, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and head[:2] != b"PK"


def _flatten(obj, prefix: str = "") -> Dict[str, Any]:
    flat = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            name = f"{prefix}{k}"
            if isinstance(v, Mapping):
                flat.update(_flatten(v, name + "."))
            else:
                flat[name] = v
    return flat


def _from_file(p: pathlib.Path, weights_only: bool) -> Dict[str, np.ndarray]:
    """d2t / t2d (either may be missing) out of one safetensors or torch file."""
    if _is_safetensors(p):
        header, _ = safetensors_header(p)
        picked = {b: _pick(_matching(header, b), b, p) for b in ("d2t", "t2d")}
        want = {b: n for b, n in picked.items() if n is not None}
        arrays = read_safetensors(p, want.values())
        return {b: arrays[n] for b, n in want.items()}
    torch = _import_torch(f"reading {p.name}")
    kw = {"map_location": "cpu"}
    try:
        obj = torch.load(p, weights_only=weights_only, **kw)
    except TypeError:  # a torch without weights_only
        obj = torch.load(p, **kw)
    except Exception as e:
        if not weights_only:
            raise
        raise ValueError(f"{p} did not load with weights_only=True ({type(e).__name__}: {e}); "
                         f"pass weights_only=False if you trust it") from None
    flat = _flatten(obj)
    out = {}
    for b in ("d2t", "t2d"):
        n = _pick(_matching(flat, b), b, p)
        if n is not None:
            v = flat[n]
            out[b] = v.detach().cpu().numpy() if _is_torch(v) else np.asarray(v)
    return out


def _from_index(index: pathlib.Path, weights_only: bool) -> Dict[str, np.ndarray]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a checkpoint index (no weight_map): {e}") from None
    out = {}
    for b in ("d2t", "t2d"):
        n = _pick(_matching(weight_map, b), b, index)
        if n is not None:
            shard = index.parent / weight_map[n]
            got = _from_file(shard, weights_only)
            if b not in got:
                raise ValueError(f"{index} puts {n} in {shard.name}, which does not hold it")
            out[b] = got[b]
    return out


def find_vocab_tensors(path: PathLike, *, weights_only: bool = True
                       ) -> Tuple[Dict[str, np.ndarray], pathlib.Path]:
    """The d2t / t2d arrays in a file or checkpoint directory (a dict with one or both keys)
    and the file they came from; ValueError when there are none."""
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such file or directory: {p}")
    if p.is_dir():
        candidates = [p / n for n in _CHECKPOINT_FILES if (p / n).is_file()]
        candidates += sorted(q for q in p.iterdir() if q.is_file() and q not in candidates
                             and q.suffix.lower() in (".safetensors", ".pt", ".pth", ".bin"))
        for c in candidates:
            got = (_from_index(c, weights_only) if c.name.endswith(".index.json")
                   else _from_file(c, weights_only))
            if got:
                return got, c
        looked = ", ".join(c.name for c in candidates) or "no weight files"
        raise ValueError(f"{p} holds no d2t / t2d tensors (looked in: {looked})")
    got = (_from_index(p, weights_only) if p.name.endswith(".index.json")
           else _from_file(p, weights_only))
    if not got:
        raise ValueError(f"{p} holds no d2t / t2d tensors")
    return got, p


def _config_near(path: PathLike) -> Dict[str, Any]:
    """The config.json beside a drafter checkpoint (a directory, or one of its weight files;
    not a standalone mapping file that happens to sit in some directory)."""
    p = pathlib.Path(path)
    if not p.is_dir() and p.name not in _CHECKPOINT_FILES and not p.name.startswith("model-"):
        return {}
    cfg = (p if p.is_dir() else p.parent) / "config.json"
    if not cfg.is_file():
        return {}
    try:
        c = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return c if isinstance(c, dict) else {}
