"""Packing token sequences into batches under a token budget (numpy only, no torch needed).

A packed batch is what a target takes and what DFlash / EAGLE-3 trainers train on: several
sequences concatenated into one token row, boundaries given by `seq_lens`, positions restarting
at 0 for every sequence (`position_ids`).

Three entry points, one rule ("next-fit in order"): walk the sequences in the order given, add
each to the current batch while the batch stays within `token_budget` tokens and
`max_batch_size` sequences, otherwise close the batch and start the next one. Order is kept
within and across batches; a batch is closed as soon as it is exactly full.

- `pack_sequences(sequences, token_budget)`: a generator over any iterable (also an endless
  stream) yielding `PackedBatch`es.
- `token_budget_batches(lengths, token_budget)` + `PackingCollator(token_budget)`: the same
  packing for a map-style dataset and a `torch.utils.data.DataLoader` (workers, shuffling,
  one slice per rank)::

      batches = token_budget_batches([len(s) for s in dataset], token_budget=8192)
      loader = DataLoader(dataset, batch_sampler=batches, collate_fn=PackingCollator(8192),
                          num_workers=4)
      for packed in loader: ...           # PackedBatch; feed it to draftfeed.torch

  A collate_fn alone cannot pack a DataLoader's fixed-size lists into a budget (it must return
  one batch per list), so the batch sampler does the grouping and the collator the
  concatenation.

Sequences longer than the budget (the target refuses batches over its `--max_batch_tokens`):
by default a sequence is **truncated** to its first `token_budget` tokens (the prefix keeps
its causal context; the tail is not trained on) and fills a batch alone. With
`drop_longer=True` it is skipped instead and its index appears in no batch. Split long
documents upstream if every token matters. Empty sequences hold nothing to compute and are
always skipped (a target refuses zero-length sequences).

A `PackedBatch` unpacks as `(token_ids, seq_lens)`, so `feed.map(pack_sequences(...))` and
`feed.submit(*packed)` work directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["PackedBatch", "pack_sequences", "pack", "token_budget_batches", "PackingCollator"]

_INT32 = np.iinfo(np.int32)


@dataclasses.dataclass(eq=False)
class PackedBatch:
    """Sequences packed into one row.

    token_ids: int32 [T], the sequences concatenated.
    seq_lens: int32 [n], one length per sequence, summing to T.
    position_ids: int32 [T], 0, 1, ... restarting at every sequence start.
    index: n ints, each sequence's index in the input (its position in the iterable given to
      `pack_sequences`, or in the list given to the collator).
    extras: per-token fields of dict items (e.g. `loss_mask`, `labels`: any other key whose
      value has one entry per token), packed and truncated like token_ids; a key is kept
      when every sequence in the batch has it.

    Unpacks as `(token_ids, seq_lens)`: `token_ids, seq_lens = batch`.
    """

    token_ids: np.ndarray
    seq_lens: np.ndarray
    position_ids: np.ndarray
    index: List[int]
    extras: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def cu_seqlens(self) -> np.ndarray:
        """int32 [n + 1]: 0 followed by the running sum of seq_lens (flash-attn's varlen form)."""
        return np.concatenate([[0], np.cumsum(self.seq_lens)]).astype(np.int32)

    def __iter__(self):
        return iter((self.token_ids, self.seq_lens))


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def _item(seq: Any, where: str) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
    """One sequence as (1-D integer token array, per-token extras). Accepts lists, numpy
    arrays, torch tensors, and dicts with `input_ids` / `token_ids` (other per-token keys of
    a dict become extras)."""
    extras: Dict[str, np.ndarray] = {}
    if isinstance(seq, Mapping):
        key = next((k for k in ("input_ids", "token_ids") if k in seq), None)
        if key is None:
            raise KeyError(f"{where}: a dict sequence needs 'input_ids' or 'token_ids', "
                           f"got keys {sorted(seq)}")
        others = {k: v for k, v in seq.items() if k != key}
        seq = seq[key]
    else:
        others = {}
    arr = _to_numpy(seq)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise ValueError(f"{where}: a sequence must be 1-D token ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"{where}: token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() > _INT32.max):
        raise ValueError(f"{where}: token ids must lie in [0, 2^31), got range "
                         f"[{arr.min()}, {arr.max()}]")
    for k, v in others.items():
        if isinstance(v, (str, bytes)):
            continue
        v = _to_numpy(v)
        if v.ndim == 2 and v.shape[0] == 1:
            v = v[0]
        if v.ndim >= 1 and v.shape[0] == arr.shape[0] and v.dtype != object:
            extras[k] = v
    return arr, extras


def _check_budget(token_budget: Optional[int], max_batch_size: Optional[int]) -> None:
    if token_budget is not None and int(token_budget) < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if max_batch_size is not None and int(max_batch_size) < 1:
        raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")


def _fit(n: int, token_budget: Optional[int], drop_longer: bool) -> int:
    """The length a sequence of n tokens is packed with; 0 means skipped."""
    if token_budget is not None and n > token_budget:
        return 0 if drop_longer else int(token_budget)
    return n


def _next_fit(sized: Iterable, token_budget: int, max_batch_size: Optional[int],
              drop_longer: bool) -> Iterator[list]:
    """The packing rule. `sized` yields (index, payload, length); yields lists of
    (index, payload, packed_length), each list one batch."""
    cur: list = []
    cur_tokens = 0
    for index, payload, n in sized:
        n = _fit(n, token_budget, drop_longer)
        if n == 0:
            continue
        if cur and cur_tokens + n > token_budget:
            yield cur
            cur, cur_tokens = [], 0
        cur.append((index, payload, n))
        cur_tokens += n
        if cur_tokens == token_budget or (max_batch_size is not None and len(cur) == max_batch_size):
            yield cur
            cur, cur_tokens = [], 0
    if cur:
        yield cur


def _build(parts: Sequence[tuple]) -> PackedBatch:
    """(index, (token array, extras), packed length) triples -> PackedBatch."""
    lens = np.fromiter((n for _, _, n in parts), dtype=np.int32, count=len(parts))
    if parts:
        tokens = np.concatenate([arr[:n] for _, (arr, _), n in parts]).astype(np.int32, copy=False)
    else:
        tokens = np.zeros(0, dtype=np.int32)
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    positions = (np.arange(tokens.shape[0], dtype=np.int64) - starts).astype(np.int32)
    extras = {}
    if parts:
        keys = [k for k in parts[0][1][1] if all(k in ex for _, (_, ex), _ in parts)]
        for k in keys:
            extras[k] = np.concatenate([ex[k][:n] for _, (_, ex), n in parts])
    return PackedBatch(token_ids=tokens, seq_lens=lens, position_ids=positions,
                       index=[int(i) for i, _, _ in parts], extras=extras)


def pack_sequences(sequences: Iterable, token_budget: int, max_batch_size: Optional[int] = None,
                   drop_longer: bool = False) -> Iterator[PackedBatch]:
    """Packs sequences, in order, into batches of at most `token_budget` tokens and at most
    `max_batch_size` sequences (None: no limit). Lazy: works on endless streams.

    Each sequence: a list / numpy array / torch tensor of token ids, or a dict with
    `input_ids` or `token_ids` (its other per-token keys, e.g. `loss_mask`, are packed into
    `PackedBatch.extras`). A sequence longer than `token_budget` is truncated to its first
    `token_budget` tokens and forms a batch of its own, or is skipped when `drop_longer`;
    empty sequences are skipped. `PackedBatch.index` gives each packed sequence's position in
    `sequences`.
    """
    _check_budget(token_budget, max_batch_size)
    token_budget = int(token_budget)

    def sized():
        for i, seq in enumerate(sequences):
            item = _item(seq, f"sequence {i}")
            yield i, item, int(item[0].shape[0])

    for parts in _next_fit(sized(), token_budget, max_batch_size, drop_longer):
        yield _build(parts)


def pack(sequences: Sequence, token_budget: Optional[int] = None,
         drop_longer: bool = False) -> PackedBatch:
    """Packs all of `sequences` into ONE batch (the collator's work).

    With `token_budget`, a sequence longer than it is truncated (or dropped with
    `drop_longer`), and a ValueError says so if the batch still exceeds the budget: group the
    sequences with `token_budget_batches` first. Empty sequences are skipped; if nothing is
    left the batch is empty (T = 0), which `draftfeed.torch.HiddenStateDataset` skips.
    """
    _check_budget(token_budget, None)
    parts = []
    for i, seq in enumerate(sequences):
        item = _item(seq, f"sequence {i}")
        n = _fit(int(item[0].shape[0]), token_budget, drop_longer)
        if n:
            parts.append((i, item, n))
    total = sum(n for _, _, n in parts)
    if token_budget is not None and total > token_budget:
        raise ValueError(
            f"{len(parts)} sequences hold {total} tokens, over the token budget of {token_budget}; "
            f"group them with draftfeed.packing.token_budget_batches (as the DataLoader's "
            f"batch_sampler) or use pack_sequences")
    return _build(parts)


def token_budget_batches(lengths: Sequence[int], token_budget: int,
                         max_batch_size: Optional[int] = None, drop_longer: bool = False,
                         indices: Optional[Iterable[int]] = None) -> List[List[int]]:
    """Groups dataset indices into batches by the same rule as `pack_sequences`.

    lengths: the token count of every item of the dataset (`lengths[i]` for item i).
    indices: the items to pack, in this order (default: all, 0..len-1). Pass a permutation to
      shuffle (`np.random.default_rng(epoch).permutation(len(lengths))`) or the indices of a
      `DistributedSampler`; or slice the result per rank (`batches[rank::world_size]`).

    Returns a list of index lists, usable as a DataLoader's `batch_sampler` together with
    `PackingCollator(token_budget, drop_longer=...)` (same budget, same drop_longer).
    Items over the budget count as truncated to it (or are left out with `drop_longer`);
    empty items are left out.
    """
    _check_budget(token_budget, max_batch_size)
    order = range(len(lengths)) if indices is None else indices
    sized = ((int(i), None, int(lengths[int(i)])) for i in order)
    return [[i for i, _, _ in parts]
            for parts in _next_fit(sized, int(token_budget), max_batch_size, drop_longer)]


class PackingCollator:
    """A DataLoader `collate_fn` that packs the list of sequences it gets into one `PackedBatch`.

        loader = DataLoader(dataset, collate_fn=PackingCollator(8192),
                            batch_sampler=token_budget_batches(lengths, 8192))

    Items may be token-id lists, numpy arrays, torch tensors, or dicts with `input_ids` /
    `token_ids` (other per-token keys such as `loss_mask` go to `PackedBatch.extras`). With `token_budget`, over-long items are truncated (or dropped with
    `drop_longer`) and a batch over the budget raises ValueError (see `pack`). Without a budget
    it concatenates whatever it gets (e.g. `DataLoader(ds, batch_size=16, collate_fn=...)`
    when every item is known to be short). `PackedBatch.index` is the position in the list the
    DataLoader passed. Picklable, so `num_workers > 0` works.
    """

    def __init__(self, token_budget: Optional[int] = None, drop_longer: bool = False):
        _check_budget(token_budget, None)
        self.token_budget = None if token_budget is None else int(token_budget)
        self.drop_longer = bool(drop_longer)

    def __call__(self, items: Sequence) -> PackedBatch:
        return pack(items, self.token_budget, self.drop_longer)

    def __repr__(self):
        return f"PackingCollator(token_budget={self.token_budget}, drop_longer={self.drop_longer})"
