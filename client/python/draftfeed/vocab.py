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

The target serves at most 65,536 draft ids. The counting lives in draftfeed.vocab_counting and
the file formats in draftfeed.vocab_files (both re-exported here); none of the three imports the
rest of the package or the compiled module.
"""

from __future__ import annotations

import dataclasses
import pathlib
import warnings
from typing import Optional, Tuple

import numpy as np

from .vocab_counting import (TokenCounter, _frequency_order, _positive_int,  # noqa: F401
                             count_tokens)
from .vocab_files import (PathLike, _as_numpy, _atomic_write, _config_near,  # noqa: F401
                          _import_torch, _is_int_dtype, _is_torch, _torch_module,
                          find_vocab_tensors, read_safetensors, safetensors_header,
                          write_safetensors)

__all__ = ["TokenCounter", "count_tokens", "DraftVocab", "read_safetensors",
           "write_safetensors", "safetensors_header", "find_vocab_tensors"]



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
