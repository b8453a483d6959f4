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

Sequences longer than the budget (a target refuses batches over its `--max_batch_tokens`, or,
where it runs long batches in chunks, over its `max_sequence_tokens`):
- With `max_sequence_tokens` (> token_budget; `feed.target_info()["max_sequence_tokens"]`, which
  `Feed.pack_sequences` and `draftfeed.torch.HiddenStateDataset` pass on their own) a sequence of
  up to that many tokens is kept **whole** in a batch of its own, and one longer than that is a
  ValueError naming both numbers, unless `truncate=True` (its first max_sequence_tokens tokens)
  or `drop_longer=True` (left out).
- Without it (as before) such a sequence is **truncated** to its first `token_budget` tokens (the
  prefix keeps its causal context; the tail is not trained on) and fills a batch alone;
  `truncate=False` makes that a ValueError instead and `drop_longer=True` leaves it out.
Nothing is cut or left out silently: every batch carries its counts (`PackedBatch.packing_stats`:
truncated sequences and the tokens cut off them, sequences left out), `pack_sequences(...).stats`
and `PackingCollator.stats` sum them, `Feed.map` / `HiddenStateDataset` add them to
`feed.stats()`, and a pass that truncated warns once at its end (`TruncationWarning`) with the
numbers. Empty sequences hold nothing to compute and are always skipped (a target refuses
zero-length sequences); they are counted too.

Indices: `PackedBatch.index` is each sequence's position in the input given to the packer (for
the collator: in the DataLoader's list, which says nothing about the dataset).
`PackedBatch.indices` is its index in the dataset: the stream position for `pack_sequences` (or
the `indices=` given), and for the collator the index of `Indexed` items, which
`with_indices(dataset)` returns (None when the collator is not told).

A `PackedBatch` unpacks as `(token_ids, seq_lens)`, so `feed.map(pack_sequences(...))` and
`feed.submit(*packed)` work directly.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

__all__ = ["PackedBatch", "PackingStats", "TruncationWarning", "Indexed", "with_indices",
           "pack_sequences", "pack", "token_budget_batches", "PackingCollator"]

_INT32 = np.iinfo(np.int32)


class TruncationWarning(UserWarning):
    """A packing pass cut tokens off sequences longer than what it may pack whole."""


@dataclasses.dataclass
class PackingStats:
    """What packing did to its input: nothing is cut or left out without being counted here.

    sequences / tokens: packed (whole or truncated) and the tokens they hold as packed.
    long_sequences: longer than the token budget, packed whole in a batch of their own
      (max_sequence_tokens).
    truncated_sequences / truncated_tokens: cut to the limit, and the tokens cut off.
    dropped_sequences / dropped_tokens: left out (drop_longer), and the tokens they held.
    empty_sequences: left out for holding no token.
    """

    sequences: int = 0
    tokens: int = 0
    long_sequences: int = 0
    truncated_sequences: int = 0
    truncated_tokens: int = 0
    dropped_sequences: int = 0
    dropped_tokens: int = 0
    empty_sequences: int = 0

    def add(self, other: "PackingStats") -> "PackingStats":
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)


class Indexed(NamedTuple):
    """A dataset item with its dataset index, for `PackedBatch.indices` (`with_indices`)."""

    index: int
    item: Any


class with_indices:  # noqa: N801 - reads as a function: with_indices(dataset)
    """A map-style dataset whose items come as `Indexed(i, dataset[i])`, so that
    `PackingCollator` knows each sequence's dataset index (`PackedBatch.indices`)::

        loader = DataLoader(with_indices(dataset), batch_sampler=sampler,
                            collate_fn=PackingCollator(8192))
    """

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i) -> Indexed:
        return Indexed(int(i), self.dataset[i])


@dataclasses.dataclass(eq=False)
class PackedBatch:
    """Sequences packed into one row.

    token_ids: int32 [T], the sequences concatenated.
    seq_lens: int32 [n], one length per sequence, summing to T.
    position_ids: int32 [T], 0, 1, ... restarting at every sequence start.
    index: n ints, each sequence's position in the input (the iterable given to
      `pack_sequences`, or the list given to the collator).
    extras: per-token fields of dict items (e.g. `loss_mask`, `labels`: any other key whose
      value has one entry per token), packed and truncated like token_ids; a key is kept
      when every sequence in the batch has it.
    indices: n ints, each sequence's index in the dataset (see the module docstring), or None
      where the packer was not told (a collator given plain items).
    packing_stats: what packing did for this batch: its sequences, those packed whole over the
      budget or truncated, and those left out since the previous batch (a collator: in its list).
    packer_warns: the pass that made it warns about its truncations itself (`pack_sequences`),
      so `Feed.map` only counts them.

    Unpacks as `(token_ids, seq_lens)`: `token_ids, seq_lens = batch`.
    """

    token_ids: np.ndarray
    seq_lens: np.ndarray
    position_ids: np.ndarray
    index: List[int]
    extras: Dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    indices: Optional[List[int]] = None
    packing_stats: PackingStats = dataclasses.field(default_factory=PackingStats)
    packer_warns: bool = dataclasses.field(default=False, repr=False)

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


def _optional_count(value: Optional[int], name: str) -> Optional[int]:
    if value is not None and int(value) < 1:
        raise ValueError(f"{name} must be >= 1 or None, got {value}")
    return None if value is None else int(value)


class _Limits:
    """The rule for one sequence's length: packed as it is, whole over the budget, truncated,
    left out, or a ValueError. `limit` is the longest sequence packed whole."""

    def __init__(self, token_budget: Optional[int], max_batch_size: Optional[int] = None,
                 max_sequence_tokens: Optional[int] = None, truncate: Optional[bool] = None,
                 drop_longer: bool = False):
        if token_budget is not None and int(token_budget) < 1:
            raise ValueError(f"token_budget must be >= 1, got {token_budget}")
        self.budget = None if token_budget is None else int(token_budget)
        self.max_batch_size = _optional_count(max_batch_size, "max_batch_size")
        self.max_sequence_tokens = _optional_count(max_sequence_tokens, "max_sequence_tokens")
        self.limit = self.budget
        if self.budget is not None and self.max_sequence_tokens is not None:
            self.limit = max(self.budget, self.max_sequence_tokens)
        # Truncation is the default only where no max_sequence_tokens says long sequences may
        # go whole (the behaviour before it existed); otherwise it must be asked for.
        self.truncate = (self.max_sequence_tokens is None) if truncate is None else bool(truncate)
        self.drop_longer = bool(drop_longer)

    def fit(self, n: int, where: str, stats: PackingStats) -> int:
        """The length a sequence of n tokens is packed with (0: left out), counted in `stats`."""
        if n == 0:
            stats.empty_sequences += 1
            return 0
        if self.limit is not None and n > self.limit:
            if self.drop_longer:
                stats.dropped_sequences += 1
                stats.dropped_tokens += n
                return 0
            if not self.truncate:
                raise ValueError(self._too_long(n, where))
            stats.truncated_sequences += 1
            stats.truncated_tokens += n - self.limit
            n = self.limit
        elif self.budget is not None and n > self.budget:
            stats.long_sequences += 1
        stats.sequences += 1
        stats.tokens += n
        return n

    def _too_long(self, n: int, where: str) -> str:
        if self.max_sequence_tokens is None or self.max_sequence_tokens <= self.budget:
            given = ("max_sequence_tokens is not given" if self.max_sequence_tokens is None else
                     f"max_sequence_tokens={self.max_sequence_tokens} is not above it")
            over = f"over the token budget of {self.budget} ({given})"
        else:
            over = (f"over max_sequence_tokens={self.max_sequence_tokens} (the token budget is "
                    f"{self.budget})")
        return (f"{where} holds {n} tokens, {over}: pass truncate=True to keep its first "
                f"{self.limit} tokens, drop_longer=True to leave it out, or split it upstream")

def warn_truncated(where: str, stats: PackingStats, limit: Optional[int],
                   stacklevel: int = 3) -> None:
    """The once-a-pass warning: how many sequences were cut, how many tokens, and what to do."""
    if not stats.truncated_sequences:
        return
    cut = (f"to {limit} tokens this pass, cutting off {stats.truncated_tokens} of the "
           f"{stats.truncated_tokens + stats.truncated_sequences * limit} tokens they held"
           if limit else f"this pass, cutting off {stats.truncated_tokens} tokens")
    warnings.warn(
        f"draftfeed: {where}: packing truncated {stats.truncated_sequences} of "
        f"{stats.sequences} sequences {cut} (not trained on). To keep long sequences whole, pass "
        f"max_sequence_tokens=feed.target_info()['max_sequence_tokens'] to the packer (a target "
        f"runs a batch over its max_batch_tokens in chunks), split long documents upstream, or "
        f"leave them out with drop_longer=True", TruncationWarning, stacklevel=stacklevel)


def _next_fit(sized: Iterable, limits: _Limits, stats: PackingStats) -> Iterator[tuple]:
    """The packing rule. `sized` yields (index, payload, length, where); yields (parts, counts)
    per batch: parts lists (index, payload, packed_length); counts is that batch's PackingStats
    (sequences left out before it included). Counts go to `stats` as well."""
    budget, max_batch_size = limits.budget, limits.max_batch_size
    cur: list = []
    cur_tokens = 0
    counts = PackingStats()

    def close():
        nonlocal cur, cur_tokens, counts
        out = (cur, counts)
        cur, cur_tokens, counts = [], 0, PackingStats()
        return out

    for index, payload, n, where in sized:
        one = PackingStats()
        n = limits.fit(n, where, one)
        stats.add(one)
        if n > budget:  # whole or truncated over the budget: a batch of its own
            if cur:
                yield close()
            counts.add(one)
            cur.append((index, payload, n))
            yield close()
            continue
        if n and cur and cur_tokens + n > budget:
            yield close()
        counts.add(one)
        if n == 0:
            continue
        cur.append((index, payload, n))
        cur_tokens += n
        if cur_tokens == budget or (max_batch_size is not None and len(cur) == max_batch_size):
            yield close()
    if cur:
        yield close()


def _build(parts: Sequence[tuple], counts: PackingStats,
           indices: Optional[List[int]]) -> PackedBatch:
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
                       index=[int(i) for i, _, _ in parts], extras=extras, indices=indices,
                       packing_stats=counts)


def _unwrap(seq: Any) -> Tuple[Optional[int], Any]:
    """(dataset index, item) of an `Indexed` item; (None, item) of any other."""
    if isinstance(seq, Indexed):
        return int(seq.index), seq.item
    return None, seq


class PackingPass:
    """One pass of `pack_sequences`: an iterator of PackedBatch; `stats` counts what it packed,
    truncated and left out so far. When the input ends, a pass that truncated warns once."""

    def __init__(self, sequences: Iterable, limits: _Limits, indices: Optional[Iterable[int]],
                 warn: bool):
        self.stats = PackingStats()
        self._limits = limits
        self._warn = bool(warn)
        self._gen = self._run(sequences, indices)

    def _run(self, sequences, indices):
        order = iter(indices) if indices is not None else None

        def sized():
            for i, seq in enumerate(sequences):
                known, seq = _unwrap(seq)
                if order is not None:
                    known = int(next(order))
                item = _item(seq, f"sequence {i}")
                yield (i, known if known is not None else i), item, int(item[0].shape[0]), \
                    f"sequence {i}"

        for parts, counts in _next_fit(sized(), self._limits, self.stats):
            b = _build([(i, item, n) for (i, _), item, n in parts], counts,
                       [k for (_, k), _, _ in parts])
            b.packer_warns = self._warn
            yield b
        if self._warn:
            warn_truncated("pack_sequences", self.stats, self._limits.limit, stacklevel=4)

    def __iter__(self):
        return self

    def __next__(self) -> PackedBatch:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()


def pack_sequences(sequences: Iterable, token_budget: int, max_batch_size: Optional[int] = None,
                   drop_longer: bool = False, max_sequence_tokens: Optional[int] = None,
                   truncate: Optional[bool] = None, indices: Optional[Iterable[int]] = None,
                   warn: bool = True) -> PackingPass:
    """Packs sequences, in order, into batches of at most `token_budget` tokens and at most
    `max_batch_size` sequences (None: no limit). Lazy: works on endless streams.

    Each sequence: a list / numpy array / torch tensor of token ids, a dict with `input_ids` or
    `token_ids` (its other per-token keys, e.g. `loss_mask`, are packed into
    `PackedBatch.extras`), or an `Indexed(dataset_index, item)`. Longer than `token_budget`:
    see the module docstring (`max_sequence_tokens`, `truncate`, `drop_longer`); empty
    sequences are skipped. `PackedBatch.index` gives each packed sequence's position in
    `sequences`, `PackedBatch.indices` its dataset index (`indices`, zipped with `sequences`,
    or Indexed items; else the position). The pass's counts are in `.stats`; with `warn`, a pass
    that truncated warns once (TruncationWarning) when `sequences` ends.
    """
    limits = _Limits(token_budget, max_batch_size, max_sequence_tokens, truncate, drop_longer)
    return PackingPass(sequences, limits, indices, warn)


def _pack(sequences: Sequence, limits: _Limits) -> PackedBatch:
    parts, counts, known = [], PackingStats(), []
    for i, seq in enumerate(sequences):
        k, seq = _unwrap(seq)
        item = _item(seq, f"sequence {i}")
        where = f"sequence {i}" + (f" (dataset index {k})" if k is not None else "")
        n = limits.fit(int(item[0].shape[0]), where, counts)
        if n:
            parts.append((i, item, n))
            known.append(k)
    total = sum(n for _, _, n in parts)
    budget = limits.budget
    if budget is not None and total > budget and not (len(parts) == 1 and total <= limits.limit):
        raise ValueError(
            f"{len(parts)} sequences hold {total} tokens, over the token budget of {budget}; "
            f"group them with draftfeed.packing.token_budget_batches (as the DataLoader's "
            f"batch_sampler) or use pack_sequences")
    indices = known if known and all(k is not None for k in known) else None
    return _build(parts, counts, indices if parts else [])


def pack(sequences: Sequence, token_budget: Optional[int] = None, drop_longer: bool = False,
         max_sequence_tokens: Optional[int] = None, truncate: Optional[bool] = None) -> PackedBatch:
    """Packs all of `sequences` into ONE batch (the collator's work).

    With `token_budget`, a sequence longer than it is handled as the module docstring says
    (whole up to `max_sequence_tokens`, then only alone in the batch; truncated, dropped, or a
    ValueError), and a ValueError says so if the batch still exceeds the budget: group the
    sequences with `token_budget_batches` first. Empty sequences are skipped; if nothing is
    left the batch is empty (T = 0), which `draftfeed.torch.HiddenStateDataset` skips.
    """
    return _pack(sequences, _Limits(token_budget, None, max_sequence_tokens, truncate, drop_longer))


def token_budget_batches(lengths: Sequence[int], token_budget: int,
                         max_batch_size: Optional[int] = None, drop_longer: bool = False,
                         indices: Optional[Iterable[int]] = None,
                         max_sequence_tokens: Optional[int] = None, truncate: Optional[bool] = None,
                         stats: Optional[PackingStats] = None) -> List[List[int]]:
    """Groups dataset indices into batches by the same rule as `pack_sequences`.

    lengths: the token count of every item of the dataset (`lengths[i]` for item i).
    indices: the items to pack, in this order (default: all, 0..len-1). Pass a permutation to
      shuffle (`np.random.default_rng(epoch).permutation(len(lengths))`); for one share per
      rank with equal counts, a seeded shuffle per epoch and resuming mid-epoch, use
      `draftfeed.sampler.DistributedTokenBudgetSampler`.

    Returns a list of index lists, usable as a DataLoader's `batch_sampler` together with
    `PackingCollator(token_budget, ...)` (same budget, max_sequence_tokens, truncate and
    drop_longer). An item over the budget is a batch of its own (whole or truncated, as the
    collator will pack it); one that cannot be packed raises here, before any training, or is
    left out with `drop_longer`; empty items are left out. `stats`, when given, gets the counts.
    """
    limits = _Limits(token_budget, max_batch_size, max_sequence_tokens, truncate, drop_longer)
    order = range(len(lengths)) if indices is None else indices
    sized = ((int(i), None, int(lengths[int(i)]), f"dataset item {int(i)}") for i in order)
    counted = PackingStats() if stats is None else stats
    return [[i for i, _, _ in parts] for parts, _ in _next_fit(sized, limits, counted)]


class PackingCollator:
    """A DataLoader `collate_fn` that packs the list of sequences it gets into one `PackedBatch`.

        loader = DataLoader(with_indices(dataset), collate_fn=PackingCollator(8192),
                            batch_sampler=token_budget_batches(lengths, 8192))

    Items may be token-id lists, numpy arrays, torch tensors, dicts with `input_ids` /
    `token_ids` (other per-token keys such as `loss_mask` go to `PackedBatch.extras`), or
    `Indexed` items (from `with_indices`), whose dataset indices become `PackedBatch.indices`.
    With `token_budget`, over-long items are handled as the module docstring says
    (`max_sequence_tokens`, `truncate`, `drop_longer`) and a batch over the budget raises
    ValueError (see `pack`). Without a budget it concatenates whatever it gets (e.g.
    `DataLoader(ds, batch_size=16, collate_fn=...)` when every item is known to be short).
    `PackedBatch.index` is the position in the list the DataLoader passed. `stats` sums what it
    packed in this process (a DataLoader worker counts in its own copy; every batch carries its
    own counts to the training process). Picklable, so `num_workers > 0` works.
    """

    def __init__(self, token_budget: Optional[int] = None, drop_longer: bool = False,
                 max_sequence_tokens: Optional[int] = None, truncate: Optional[bool] = None):
        _Limits(token_budget, None, max_sequence_tokens, truncate, drop_longer)  # checks them
        self.token_budget = None if token_budget is None else int(token_budget)
        self.drop_longer = bool(drop_longer)
        self.max_sequence_tokens = max_sequence_tokens
        self.truncate = truncate
        self.stats = PackingStats()

    def __call__(self, items: Sequence) -> PackedBatch:
        b = _pack(items, _Limits(self.token_budget, None, self.max_sequence_tokens, self.truncate,
                                 self.drop_longer))
        self.stats.add(b.packing_stats)
        return b

    def __repr__(self):
        return (f"PackingCollator(token_budget={self.token_budget}, drop_longer={self.drop_longer}"
                f", max_sequence_tokens={self.max_sequence_tokens}, truncate={self.truncate})")
