"""PyTorch adapter: the target's hidden states for every batch an existing DataLoader yields.

    import draftfeed
    from draftfeed.torch import HiddenStateDataset

    feed = draftfeed.Feed(targets=["10.0.0.5:50051"], layers=[1, 2, 3, -1], prefetch=8)
    for batch in HiddenStateDataset(loader, feed, device="cuda:0"):
        hidden = batch["hidden"]            # bf16 [T, K, H] on cuda:0
        ...                                 # the loader's own fields are all still there

The loader yields packed token batches, one of:
  - a `draftfeed.packing.PackedBatch` (from `PackingCollator` / `pack_sequences`);
  - a dict with `input_ids` or `token_ids` ([T], or [1, T] as transformers'
    DataCollatorWithFlattening makes) and `seq_lens`, `cu_seqlens` or `position_ids`
    (restarting at 0 per sequence) for the boundaries;
  - a `(token_ids, seq_lens)` pair.
Values may be torch tensors (on any device), numpy arrays or lists. Padded [B, L] batches are not
packed batches: pack them first (draftfeed.packing).

Each item comes out as a dict: a loader dict keeps its own keys and values untouched (shallow
copy); a PackedBatch becomes {token_ids, seq_lens, position_ids, cu_seqlens, index, **extras} and
a pair {token_ids, seq_lens}, as CPU torch tensors (numpy memory shared, not copied). Added to
every dict: `hidden` (bf16 torch tensor [T, K, H], or [T, K*H] with layers_view="t(kh)", on
`device`) and `batch_id` (the feed's id). Items with no tokens are skipped (a target refuses them).
A feed with encoding="fp8_e4m3" gives the same bf16 `hidden` (dequantized on the receiving GPU for
NCCL); with fp8_raw=True too, `hidden` is instead the e4m3 codes ([T, K, H]
torch.float8_e4m3fn where torch has it, else uint8; [T, K*H] with "t(kh)") and `hidden_scales`
their float32 scales [T, K]: value = code * scale (draftfeed.dequantize_fp8 does it).
A feed asking for target outputs (Feed(draft_vocab=..., top_k=..., argmax=True)) adds them too, on
`device`: `draft_probs` (float32 [T, Vd]), `argmax` (int32 [T]), `top_k_ids` / `top_k_logprobs`
([T, k]).

torch.distributed: every rank makes its own Feed in its own process (a Feed is not shared across
processes), after init_process_group. Either give every rank all targets (each feed balances
its batches over them, so ranks spread themselves) or a share of them, e.g.
`targets[rank::world_size]` when there are at least as many targets as ranks. The rank's
DataLoader and sampler decide its data, exactly as without draftfeed (DistributedSampler, or
`token_budget_batches(...)[rank::world_size]`); the feed only computes what it is given.

DataLoader workers (num_workers > 0) are fine for the loader underneath: the Feed stays in the
training process. Do not put a HiddenStateDataset itself into a DataLoader with workers.

Nothing is lost silently: a batch the target refuses raises (on_error="raise", the default: the
epoch ends there) or is skipped, counted and logged (on_error="skip", at most `max_skipped` per
epoch); `stats()` has the epoch's numbers and `feed.stats()` the feed's. A PackedBatch's
`indices` (dataset indices, `draftfeed.packing.with_indices`) come out as `indices`.
`batches_done` is the loader batches finished so far this epoch, in loader order, for
`DistributedTokenBudgetSampler.state_dict(consumed=...)`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple, Union

import numpy as np

try:
    import torch
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "draftfeed.torch needs PyTorch, which this Python cannot import "
        f"({_e}). Install torch, or use draftfeed.Feed directly: Result.hidden and "
        "Result.hidden_bits are numpy arrays.") from _e

from . import DraftfeedError  # noqa: F401  (re-exported: what the dataset raises)
from .packing import PackedBatch, PackingCollator, PackingStats

__all__ = ["HiddenStateDataset"]

_LAYER_VIEWS = ("tkh", "t(kh)")
_log = logging.getLogger("draftfeed")


def _np_int32(value: Any, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise ValueError(f"HiddenStateDataset: {name} must be 1-D (packed), got shape {arr.shape}; "
                         f"pack padded batches first (draftfeed.packing)")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"HiddenStateDataset: {name} must hold integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _lens_from_mapping(item: Mapping, num_tokens: int) -> np.ndarray:
    if "seq_lens" in item:
        return _np_int32(item["seq_lens"], "seq_lens")
    if "cu_seqlens" in item:
        cu = _np_int32(item["cu_seqlens"], "cu_seqlens")
        if cu.size < 1 or cu[0] != 0 or cu[-1] != num_tokens:
            raise ValueError(f"HiddenStateDataset: cu_seqlens must run from 0 to the token count "
                             f"{num_tokens}, got {cu.tolist()[:4]}...{cu.tolist()[-2:]}")
        return np.diff(cu).astype(np.int32)
    if "position_ids" in item:
        pos = _np_int32(item["position_ids"], "position_ids")
        if pos.shape[0] != num_tokens:
            raise ValueError(f"HiddenStateDataset: position_ids has {pos.shape[0]} entries for "
                             f"{num_tokens} tokens")
        starts = np.flatnonzero(pos == 0)
        if num_tokens and (starts.size == 0 or starts[0] != 0):
            raise ValueError("HiddenStateDataset: position_ids must start every sequence at 0")
        return np.diff(np.append(starts, num_tokens)).astype(np.int32)
    raise KeyError(f"HiddenStateDataset: a batch dict needs 'seq_lens', 'cu_seqlens' or "
                   f"'position_ids' for the sequence boundaries, got keys {sorted(item)}")


def _normalize(item: Any) -> Tuple[np.ndarray, np.ndarray, Dict[str, Any]]:
    """A loader item -> (token_ids int32 [T], seq_lens int32 [n], output fields)."""
    if isinstance(item, PackedBatch):
        fields = {
            "token_ids": torch.from_numpy(item.token_ids),
            "seq_lens": torch.from_numpy(item.seq_lens),
            "position_ids": torch.from_numpy(item.position_ids),
            "cu_seqlens": torch.from_numpy(item.cu_seqlens),
            "index": list(item.index),
            "indices": None if item.indices is None else list(item.indices),
        }
        for key, value in item.extras.items():
            try:
                fields.setdefault(key, torch.as_tensor(value))
            except TypeError:  # a dtype torch lacks (e.g. uint16 in older torch): keep numpy
                fields.setdefault(key, value)
        return (_np_int32(item.token_ids, "token_ids"), _np_int32(item.seq_lens, "seq_lens"),
                fields)
    if isinstance(item, Mapping):
        key = next((k for k in ("input_ids", "token_ids") if k in item), None)
        if key is None:
            raise KeyError(f"HiddenStateDataset: a batch dict needs 'input_ids' or 'token_ids', "
                           f"got keys {sorted(item)}")
        tokens = _np_int32(item[key], key)
        return tokens, _lens_from_mapping(item, tokens.shape[0]), dict(item)
    if isinstance(item, (tuple, list)) and len(item) == 2:
        token_ids, seq_lens = item
        tokens, lens = _np_int32(token_ids, "token_ids"), _np_int32(seq_lens, "seq_lens")
        return tokens, lens, {"token_ids": torch.as_tensor(token_ids),
                              "seq_lens": torch.as_tensor(seq_lens)}
    raise TypeError(f"HiddenStateDataset: cannot read a packed batch from a "
                    f"{type(item).__name__}; the loader should yield a PackedBatch, a dict with "
                    f"input_ids/token_ids and seq_lens/cu_seqlens/position_ids, or a "
                    f"(token_ids, seq_lens) pair")


class HiddenStateDataset(torch.utils.data.IterableDataset):
    """Wraps a DataLoader (or any re-iterable of packed batches) and a `draftfeed.Feed`; yields
    the loader's batches with the target's hidden states added. See the module docstring.

    Args:
      loader: yields packed batches (PackedBatch, dict, or (token_ids, seq_lens)).
      feed: an open draftfeed.Feed; the dataset keeps its prefetch window full (Feed.map) and
        must be the feed's only user while iterating.
      device: where `hidden` goes (None: stays on the CPU, no copy). For a CUDA device the
        CPU tensor is first copied into pinned memory, then copied with `non_blocking`, so the
        host-to-device copy does not stall the Python thread.
      layers_view: "tkh" gives [T, K, H]; "t(kh)" gives [T, K*H] (the concatenation DFlash's fc
        layer takes; a view, no copy).
      pin_memory: None (default) pins when `device` is CUDA; True also pins the CPU tensor when
        `device` is None and CUDA is available (for the caller's own async copy); False never.
      non_blocking: passed to the host-to-device copy.
      on_error: "raise" (default) or "skip": what a batch the target refuses does (Feed.map's
        policy; skipped batches are logged and counted in `stats()` and `feed.stats()`).
      max_skipped: with on_error="skip", more skipped batches than this in one epoch raise.
      max_sequence_tokens: "auto" (default): when the loader's collate_fn is a PackingCollator
        without max_sequence_tokens, it gets the target's (feed.target_info()) where that is
        above its token budget, so long sequences reach the trainer whole instead of truncated
        (a target running long batches in chunks); an int sets that value the same way; None
        leaves the collator as it is.

    Iterating again (next epoch) iterates the loader again. Leaving a loop early (break, an
    exception) cancels the batches still in flight (targets skip the ones they have not
    started), so the feed is ready for reuse.
    Results come in the loader's order (a feed's default); each `hidden` is paired with the
    batch whose tokens it was computed from, and a mismatch raises instead of training on the
    wrong states.
    """

    def __init__(self, loader: Iterable, feed, device=None, layers_view: str = "tkh",
                 pin_memory: Optional[bool] = None, non_blocking: bool = True,
                 on_error: str = "raise", max_skipped: int = 100,
                 max_sequence_tokens: Union[str, int, None] = "auto"):
        super().__init__()
        if layers_view not in _LAYER_VIEWS:
            raise ValueError(f"layers_view must be one of {_LAYER_VIEWS}, got {layers_view!r}")
        from .accounting import check_on_error

        check_on_error(on_error, max_skipped)
        self.on_error, self.max_skipped = on_error, int(max_skipped)
        self.batches_done = 0
        self._epoch = _EpochStats()
        self._long_sequences(loader, feed, max_sequence_tokens)
        self.loader = loader
        self.feed = feed
        self.device = None if device is None else torch.device(device)
        self.layers_view = layers_view
        self.non_blocking = bool(non_blocking)
        on_cuda = self.device is not None and self.device.type == "cuda"
        if on_cuda and not torch.cuda.is_available():
            raise RuntimeError(f"HiddenStateDataset: device {self.device} asked for, but this "
                               f"torch ({torch.__version__}) sees no CUDA device")
        if pin_memory is None:
            self._pin = on_cuda
        else:
            self._pin = bool(pin_memory) and torch.cuda.is_available()

    @staticmethod
    def _long_sequences(loader, feed, max_sequence_tokens) -> None:
        """Gives the loader's PackingCollator the target's max_sequence_tokens (see Args)."""
        collate = getattr(loader, "collate_fn", None)
        if max_sequence_tokens is None or not isinstance(collate, PackingCollator):
            return
        if collate.max_sequence_tokens is not None or collate.token_budget is None:
            return  # the caller chose
        if max_sequence_tokens == "auto":
            info = feed.target_info() if hasattr(feed, "target_info") else feed.target
            limit = int(info.get("max_sequence_tokens") or 0)
        else:
            limit = int(max_sequence_tokens)
        if limit > collate.token_budget:
            collate.max_sequence_tokens = limit
            _log.info("draftfeed: HiddenStateDataset: sequences up to %d tokens go whole (the "
                      "target's max_sequence_tokens; the collator's budget is %d)", limit,
                      collate.token_budget)

    def stats(self) -> Dict[str, int]:
        """This epoch's numbers: batches yielded and skipped (with their tokens), batches_done,
        and what packing did to the batches submitted (PackingStats' keys)."""
        return {**self._epoch.as_dict(), "batches_done": self.batches_done}

    def __len__(self) -> int:
        return len(self.loader)  # TypeError when the loader has no length, as len() should

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self._pin and not t.is_cuda and not t.is_pinned():
            t = t.pin_memory()
        if self.device is not None and self.device.type != "cpu":
            t = t.to(self.device, non_blocking=self.non_blocking)
        return t

    def _hidden(self, result, fields: Dict[str, Any]) -> torch.Tensor:
        if result.encoding == "fp8_e4m3" and getattr(self.feed, "fp8_raw", False):
            # The codes and scales as sent, moved like bf16 states are.
            codes, scales = result.fp8()
            fields["hidden_scales"] = self._to_device(scales)
            t = self._to_device(codes)
        else:
            # bf16 [T, K, H] sharing the result's memory: on the CPU (gRPC), or
            # already on the receiving GPU (transport="nccl"; an fp8_e4m3
            # result is dequantized there).
            t = self._to_device(result.torch())
        if self.layers_view == "t(kh)":
            t = t.reshape(t.shape[0], -1)
        return t

    def _target_outputs(self, result, fields: Dict[str, Any]) -> None:
        """What the feed asked of the targets' lm_head, on `device`: `draft_probs` float32
        [T, Vd] (its encoded bytes move, then widen there), `argmax` int32 [T], `top_k_ids` and
        `top_k_logprobs` [T, k]."""
        asked = result._r.outputs
        device = self.device if self.device is not None and self.device.type != "cpu" else None
        if asked["probs"] >= 0:
            fields["draft_probs"] = result.draft_probs_torch(device, self.non_blocking)
        if asked["argmax"] >= 0:
            fields["argmax"] = result.argmax_torch(device, self.non_blocking)
        if asked["top_k_ids"] >= 0:
            fields["top_k_ids"], fields["top_k_logprobs"] = result.top_k_torch(
                device, self.non_blocking)

    def _drain(self) -> None:
        """Cancels what is still in flight so the next iteration starts clean (map's own
        exit cancels its batches; this catches any the feed had besides)."""
        try:
            if int(self.feed.stats().get("outstanding", 0)) > 0:
                self.feed.cancel()
        except Exception:  # a closed feed has nothing in flight
            return

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError(
                "HiddenStateDataset runs in the training process: iterate it directly, or use "
                "DataLoader(..., batch_size=None, num_workers=0); put the workers on the "
                "loader it wraps instead")
        self._epoch = _EpochStats()
        done = _Prefix()
        self.batches_done = 0
        mine = set()  # id() of the submissions in flight, to tell a result of another loop

        def submissions():
            for seq, item in enumerate(self.loader):
                tokens, lens, fields = _normalize(item)
                if tokens.shape[0] == 0:
                    self.batches_done = done.finish(seq)  # nothing to compute: done
                    continue
                sub = _Submission(seq, tokens, lens, fields, item)
                self._epoch.packing.add(sub.packing_stats)
                mine.add(id(sub))
                yield sub

        def skipped(error, sub):
            if isinstance(sub, _Submission):
                mine.discard(id(sub))
                self._epoch.skipped_batches += 1
                self._epoch.skipped_tokens += int(sub.token_ids.shape[0])
                self.batches_done = done.finish(sub.seq)

        results = self.feed.map(submissions(), on_error=self.on_error,
                                max_skipped=self.max_skipped, on_skip=skipped)
        try:
            for result in results:
                sub = result.batch
                if not isinstance(sub, _Submission) or id(sub) not in mine:
                    raise RuntimeError(
                        f"HiddenStateDataset: result batch {result.batch_id} "
                        f"({result.num_tokens} tokens) is none of the {len(mine)} batches this "
                        f"dataset has in flight; is another loop using the same Feed at the "
                        f"same time?")
                mine.discard(id(sub))
                fields = sub.fields
                fields["hidden"] = self._hidden(result, fields)
                self._target_outputs(result, fields)
                fields["batch_id"] = result.batch_id
                self._epoch.batches += 1
                self.batches_done = done.finish(sub.seq)
                yield fields
        finally:
            results.close()
            self._drain()


class _Submission:
    """One loader batch on its way through Feed.map: unpacks as (token_ids, seq_lens) for the
    feed, and carries the dataset's output fields, its position in the loader (`seq`) and the
    packing counts and indices of a PackedBatch for Feed.map's accounting."""

    __slots__ = ("seq", "token_ids", "seq_lens", "fields", "packing_stats", "packer_warns",
                 "indices")

    def __init__(self, seq: int, tokens: np.ndarray, lens: np.ndarray, fields: Dict[str, Any],
                 item: Any):
        self.seq, self.token_ids, self.seq_lens, self.fields = seq, tokens, lens, fields
        packed = isinstance(item, PackedBatch)
        self.packing_stats = item.packing_stats if packed else PackingStats()
        self.packer_warns = item.packer_warns if packed else False
        self.indices = item.indices if packed else None

    def __iter__(self):
        return iter((self.token_ids, self.seq_lens))


class _Prefix:
    """Loader positions finished (yielded, skipped or empty), as the length of the finished
    prefix: exact for an unordered feed too, where they finish out of order."""

    def __init__(self):
        self.length = 0
        self._ahead: set = set()

    def finish(self, seq: int) -> int:
        self._ahead.add(seq)
        while self.length in self._ahead:
            self._ahead.discard(self.length)
            self.length += 1
        return self.length


class _EpochStats:
    def __init__(self):
        self.batches = 0
        self.skipped_batches = 0
        self.skipped_tokens = 0
        self.packing = PackingStats()

    def as_dict(self) -> Dict[str, int]:
        return {"batches": self.batches, "skipped_batches": self.skipped_batches,
                "skipped_tokens": self.skipped_tokens, **self.packing.as_dict()}
