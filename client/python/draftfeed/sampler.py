"""A token-budget batch sampler for several ranks that resumes mid-epoch (numpy only; torch
optional).

    sampler = DistributedTokenBudgetSampler(lengths, token_budget=8192, seed=0)
    loader = DataLoader(with_indices(dataset), batch_sampler=sampler,
                        collate_fn=PackingCollator(8192))
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step, batch in enumerate(loader): ...
            checkpoint["sampler"] = sampler.state_dict(consumed=step + 1)

Every rank packs the same epoch: the dataset's indices in one order (a permutation seeded by
`seed + epoch` when `shuffle`, else 0..N-1), grouped into token-budget batches by
`draftfeed.packing.token_budget_batches`. Rank r takes batches r, r + world, r + 2 world, ...,
so ranks get disjoint batches and the same number of them, as DDP needs (its ranks step
together). When the batch count is not a multiple of the world size, torch's
DistributedSampler's choice is kept: `drop_last=False` (default) pads by repeating batches from
the start of the epoch's list (those few batches are then trained on twice), `drop_last=True`
leaves the last batches out of the epoch (they come back in other epochs' orders when shuffled).

Resume: `state_dict(consumed=k)` records the epoch and that this rank has finished k batches of
it; a fresh sampler given it by `load_state_dict` yields the rest of that epoch (batch k on),
then whole epochs again. Pass `consumed`, the batches the training loop finished: a DataLoader
with workers, and `HiddenStateDataset`'s prefetch window, draw batches from the sampler ahead
of training, so the count of batches the sampler has handed out (the default) runs ahead.
`HiddenStateDataset.batches_done` is that count for a loader over this sampler.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from .packing import PackingStats, token_budget_batches

__all__ = ["DistributedTokenBudgetSampler"]


def _world() -> tuple:
    """(num_replicas, rank) of an initialised torch.distributed, else of the launcher's
    environment (torchrun's WORLD_SIZE / RANK), else one process."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(), dist.get_rank()
    except ImportError:
        pass
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"]), int(os.environ.get("RANK", "0"))
    return 1, 0


class DistributedTokenBudgetSampler:
    """Token-budget batches of dataset indices, one share per rank; see the module docstring.

    Args:
      lengths: the token count of every item of the dataset.
      token_budget, max_batch_size, max_sequence_tokens, truncate, drop_longer: as for
        `token_budget_batches` (give the collator the same).
      num_replicas, rank: default: torch.distributed's when initialised, else WORLD_SIZE /
        RANK from the environment, else 1 and 0.
      shuffle: a new order every epoch, seeded by `seed + epoch` (the same on every rank).
      drop_last: leave out the last batches instead of repeating the first ones.
    """

    def __init__(self, lengths: Sequence[int], token_budget: int,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 max_batch_size: Optional[int] = None, max_sequence_tokens: Optional[int] = None,
                 truncate: Optional[bool] = None, drop_longer: bool = False):
        if num_replicas is None or rank is None:
            world, me = _world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = me if rank is None else rank
        if int(num_replicas) < 1 or not 0 <= int(rank) < int(num_replicas):
            raise ValueError(f"DistributedTokenBudgetSampler: rank {rank} of num_replicas "
                             f"{num_replicas}; need num_replicas >= 1 and 0 <= rank < it")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1:
            raise ValueError(f"lengths must be 1-D, got shape {self.lengths.shape}")
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self._pack = dict(token_budget=int(token_budget), max_batch_size=max_batch_size,
                          max_sequence_tokens=max_sequence_tokens, truncate=truncate,
                          drop_longer=drop_longer)
        token_budget_batches([], **self._pack)  # checks the options now, not at the first epoch
        self.epoch = 0
        self._start = 0       # where the next iteration starts: a resumed epoch's finished batches
        self._iter_start = 0  # where the latest iteration started
        self._handed_out = 0  # batches the latest iteration has yielded
        self._cache: Optional[tuple] = None
        self.stats = PackingStats()  # of the latest epoch packed

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch the next iteration yields (its order when shuffling)."""
        epoch = int(epoch)
        if epoch != self.epoch:
            # A resumed position belongs to the epoch it was saved in.
            self._start = self._iter_start = self._handed_out = 0
        self.epoch = epoch

    def _all_batches(self) -> List[List[int]]:
        """The epoch's batches, every rank's, before padding or dropping."""
        if self._cache is None or self._cache[0] != self.epoch:
            n = len(self.lengths)
            if self.shuffle:
                order = np.random.default_rng(self.seed + self.epoch).permutation(n)
            else:
                order = np.arange(n)
            stats = PackingStats()
            batches = token_budget_batches(self.lengths, indices=order, stats=stats, **self._pack)
            self._cache = (self.epoch, batches)
            self.stats = stats
        return self._cache[1]

    def rank_batches(self) -> List[List[int]]:
        """This rank's batches of the current epoch, in order, from its start."""
        batches = self._all_batches()
        world = self.num_replicas
        if self.drop_last:
            total = len(batches) // world * world
            batches = batches[:total]
        elif batches and len(batches) % world:
            pad = world - len(batches) % world
            # Repeat from the start as DistributedSampler does (over and over for a list
            # shorter than the world).
            batches = batches + (batches * (pad // len(batches) + 1))[:pad]
        return batches[self.rank::world]

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (what is left of a resumed one)."""
        return max(0, len(self.rank_batches()) - self._start)

    def __iter__(self) -> Iterator[List[int]]:
        mine = self.rank_batches()
        start, self._start = self._start, 0  # later passes are whole epochs
        self._iter_start, self._handed_out = start, 0
        for batch in mine[start:]:
            self._handed_out += 1
            yield list(batch)

    def state_dict(self, consumed: Optional[int] = None) -> Dict[str, Any]:
        """Where this rank is: its epoch and the batches of it finished. `consumed`: the batches
        the training loop finished in the latest iteration (a resumed one counts from where it
        resumed, as `enumerate(loader)` does); default: those the iteration handed out."""
        done = self._iter_start + (self._handed_out if consumed is None else int(consumed))
        if not 0 <= done <= len(self.rank_batches()):
            raise ValueError(f"state_dict: consumed={done} is not within this rank's "
                             f"{len(self.rank_batches())} batches of epoch {self.epoch}")
        return {"epoch": self.epoch, "consumed": done, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                "num_replicas": self.num_replicas, "rank": self.rank,
                "num_items": int(len(self.lengths)), "total_tokens": int(self.lengths.sum()),
                "packing": dict(self._pack)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes: the next iteration yields the saved epoch from its first unfinished batch.
        A state from another data set, world size, seed or packing is refused by name, since
        resuming it would repeat or skip items."""
        mine = {"seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "num_replicas": self.num_replicas, "rank": self.rank,
                "num_items": int(len(self.lengths)), "total_tokens": int(self.lengths.sum()),
                "packing": dict(self._pack)}
        differ = [f"{k}: saved {state.get(k)!r}, here {v!r}" for k, v in mine.items()
                  if state.get(k) != v]
        if differ:
            raise ValueError("DistributedTokenBudgetSampler.load_state_dict: the state is of "
                             "another sampler (" + "; ".join(differ) + ")")
        self.epoch = int(state["epoch"])
        self._start = self._iter_start = int(state["consumed"])
        self._handed_out = 0
