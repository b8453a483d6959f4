"""draftfeed.vocab's files: safetensors read and written with numpy alone, torch's .pt/.bin
files (torch imported only then), and finding a drafter checkpoint's d2t / t2d tensors in its
weight files. Pure numpy, like draftfeed.vocab, which builds DraftVocab on these."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import sys
import tempfile
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

# The _-prefixed array helpers are shared with draftfeed.vocab and draftfeed.vocab_counting.
__all__ = ["read_safetensors", "write_safetensors", "safetensors_header", "find_vocab_tensors"]

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------------------------
# torch, only when it is already loaded: a torch tensor cannot exist otherwise, so checking
# sys.modules never imports it

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


# --------------------------------------------------------------------------------------------
# numpy plumbing

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
