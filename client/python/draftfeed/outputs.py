"""Target outputs in a result's rows: the argmax, top-k and draft-vocabulary probabilities the
target computed from its lm_head, after each token's hidden states.

A row's layout (draftfeed.proto's TargetOutputs): int32 argmax, int32 top-k ids [k], float32
top-k log-probs [k], then the draft probabilities: bf16 [Vd], or a float32 scale and e4m3 codes
[Vd] (p = code * scale). The native result says where each starts (`outputs`); these helpers
view them out of the row bytes, as numpy for host results and torch for GPU ones.
"""

from __future__ import annotations

import numpy as np

_WIDTH = {"argmax": lambda o: 4, "top_k_ids": lambda o: 4 * o["top_k"],
          "top_k_logprobs": lambda o: 4 * o["top_k"], "probs_scale": lambda o: 4,
          "probs": lambda o: o["num_draft"] * (1 if o["probs_encoding"] == "fp8_e4m3" else 2)}

# How to ask for each output, for the error when it was not asked.
_ASK = {"argmax": "argmax=True", "top_k_ids": "top_k=k", "top_k_logprobs": "top_k=k",
        "probs": "draft_vocab=ids"}


def _offset(r, name: str, what: str) -> int:
    off = r.outputs[name]
    if off < 0:
        from . import DraftfeedError
        raise DraftfeedError(9, f"Result.{what}: this feed did not ask the targets for it "
                                f"(Feed(..., {_ASK[name]}))")
    return off


def _numpy_field(r, name: str, what: str, dtype) -> np.ndarray:
    """Output `name` of every token as numpy [T, n] of `dtype` (a copy: rows are not aligned)."""
    off = _offset(r, name, what)
    part = r.raw[:, off:off + _WIDTH[name](r.outputs)]
    return part.copy().view(dtype)


def _torch_rows(r):
    import torch

    return torch.utils.dlpack.from_dlpack(r.dlpack_capsule(raw=True))


def _torch_field(rows, r, name: str, what: str, dtype, device, non_blocking):
    """Output `name` as a torch tensor [T, n] of `dtype`; the bytes move to `device` first."""
    off = _offset(r, name, what)
    part = rows[:, off:off + _WIDTH[name](r.outputs)]
    if device is not None:
        part = part.to(device, non_blocking=non_blocking)
    return part.contiguous().view(dtype)


def argmax(r):
    """int32 [T]: numpy for host results, torch on the GPU for NCCL ones."""
    if r.device >= 0:
        import torch
        return _torch_field(_torch_rows(r), r, "argmax", "argmax", torch.int32, None, True)[:, 0]
    return _numpy_field(r, "argmax", "argmax", "<i4")[:, 0]


def top_k(r):
    """(ids int32 [T, k], logprobs float32 [T, k]), best first."""
    if r.device >= 0:
        import torch
        rows = _torch_rows(r)
        return (_torch_field(rows, r, "top_k_ids", "top_k_ids", torch.int32, None, True),
                _torch_field(rows, r, "top_k_logprobs", "top_k_logprobs", torch.float32, None,
                             True))
    return (_numpy_field(r, "top_k_ids", "top_k_ids", "<i4"),
            _numpy_field(r, "top_k_logprobs", "top_k_logprobs", "<f4"))


def draft_probs_numpy(r, e4m3_values: np.ndarray) -> np.ndarray:
    """float32 [T, Vd] of a host result: bf16 widened exactly, e4m3 as code * scale."""
    if r.outputs["probs_encoding"] == "fp8_e4m3":
        codes = _numpy_field(r, "probs", "draft_probs", np.uint8)
        scale = np.ascontiguousarray(r.raw[:, r.outputs["probs_scale"]:][:, :4]).view("<f4")
        return e4m3_values[codes] * scale
    bits = _numpy_field(r, "probs", "draft_probs", "<u2")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def draft_probs_torch(r, e4m3_values: np.ndarray, device=None, non_blocking: bool = True,
                      dtype=None):
    """torch [T, Vd] (float32 unless `dtype`) on `device` (default: where the result is). The
    encoded bytes are what moves to the device; they widen there."""
    import torch

    rows = _torch_rows(r)
    dtype = dtype or torch.float32
    if r.outputs["probs_encoding"] == "fp8_e4m3":
        codes = _torch_field(rows, r, "probs", "draft_probs", torch.uint8, device, non_blocking)
        scale = _torch_field(rows, r, "probs_scale", "draft_probs", torch.float32, device,
                             non_blocking)
        table = torch.from_numpy(e4m3_values).to(codes.device)
        return (table[codes.long()] * scale).to(dtype)
    bits = _torch_field(rows, r, "probs", "draft_probs", torch.bfloat16, device, non_blocking)
    return bits.to(dtype)


def hidden_bytes(r) -> int:
    """Bytes of a row's hidden states (where its target outputs start)."""
    starts = [v for k, v in r.outputs.items() if k in _WIDTH and v >= 0]
    return min(starts) if starts else r.bytes_per_token
