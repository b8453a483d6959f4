"""A finished batch as the pure-Python client hands it to draftfeed.Result: the same fields
and views as the compiled module's result (client/python/module.cc's PyResult), over one numpy
buffer of [T, bytes_per_token] rows, and the fp8_e4m3 -> bf16 dequantization on the way in.
"""

from __future__ import annotations

import numpy as np

BF16, FP8 = "bf16", "fp8_e4m3"
# Tokens dequantized per numpy pass: bounds the float32 temporaries.
_DEQUANT_VALUES_PER_STEP = 1 << 22


def _readonly(a: np.ndarray) -> np.ndarray:
    a = a.view()
    a.flags.writeable = False
    return a


def target_output_offsets(layout: dict, hidden_bytes: int, top_k: int, num_draft: int,
                          probs_encoding: str) -> dict:
    """Where a row's target outputs start (-1: not asked), as Result.outputs reads them."""
    def at(off):
        return -1 if off < 0 else hidden_bytes + off

    return {"argmax": at(layout["argmax"]), "top_k_ids": at(layout["top_k_ids"]),
            "top_k_logprobs": at(layout["top_k_logprobs"]),
            "probs_scale": at(layout["probs_scale"]), "probs": at(layout["probs"]),
            "top_k": top_k, "num_draft": num_draft, "probs_encoding": probs_encoding}


def outputs_layout(argmax: bool, top_k: int, num_draft: int, probs_encoding: str) -> dict:
    """Byte offsets within a token's outputs (common/target_outputs.cc LayoutOf)."""
    lay = {"argmax": -1, "top_k_ids": -1, "top_k_logprobs": -1, "probs_scale": -1, "probs": -1}
    at = 0
    if argmax:
        lay["argmax"], at = at, at + 4
    if top_k > 0:
        lay["top_k_ids"], at = at, at + 4 * top_k
        lay["top_k_logprobs"], at = at, at + 4 * top_k
    if num_draft:
        if probs_encoding == FP8:
            lay["probs_scale"], at = at, at + 4
            lay["probs"], at = at, at + num_draft
        else:
            lay["probs"], at = at, at + 2 * num_draft
    lay["bytes"] = at
    return lay


def to_bf16_bits(f: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even; a NaN stays a quiet NaN
    (common/fp8_capture.cc ToBf16)."""
    bits = f.view(np.uint32)
    out = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return out


class GrpcioResult:
    """The native result's interface over `buf` (uint8, T * bytes_per_token bytes)."""

    __slots__ = ("batch_id", "num_tokens", "num_layers", "hidden_size", "checksum", "encoding",
                 "bytes_per_token", "target", "_timings", "_token_ids", "_seq_lens", "_buf",
                 "outputs")
    device = -1  # host memory: the gRPC transport

    def __init__(self, batch_id, token_ids, seq_lens, num_layers, hidden_size, encoding,
                 bytes_per_token, buf, outputs, checksum, target, timings):
        self.batch_id = batch_id
        self.num_tokens = int(token_ids.size)
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.checksum = checksum
        self.encoding = encoding
        self.bytes_per_token = bytes_per_token
        self.target = target
        self._timings = timings
        self._token_ids = _readonly(token_ids)
        self._seq_lens = _readonly(seq_lens)
        self._buf = buf
        self.outputs = outputs

    @property
    def timings(self) -> dict:
        return dict(self._timings)

    @property
    def token_ids(self):
        return self._token_ids

    @property
    def seq_lens(self):
        return self._seq_lens

    def _rows(self) -> np.ndarray:
        return self._buf.reshape(self.num_tokens, self.bytes_per_token)

    @property
    def raw(self):
        return _readonly(self._rows())

    @property
    def hidden_bits(self):
        t, k, h, row = self.num_tokens, self.num_layers, self.hidden_size, self.bytes_per_token
        if self.encoding == BF16:
            v = np.ndarray((t, k, h), np.uint16, buffer=self._buf, strides=(row, 2 * h, 2))
        elif self.encoding == FP8:
            v = np.ndarray((t, k, h), np.uint8, buffer=self._buf, strides=(row, h, 1))
        else:
            raise ValueError(f"draftfeed: encoding {self.encoding} has no numpy view in this "
                             f"client")
        v.flags.writeable = False
        return v

    @property
    def fp8_scales(self):
        if self.encoding != FP8:
            raise ValueError("fp8_scales: not an fp8_e4m3 result in host memory")
        k, h = self.num_layers, self.hidden_size
        v = np.ndarray((self.num_tokens, k), "<f4", buffer=self._buf, offset=k * h,
                       strides=(self.bytes_per_token, 4))
        v.flags.writeable = False
        return v

    def dlpack_capsule(self, raw: bool = False):
        # Always the rows as bytes [T, bytes_per_token]: draftfeed.Result views them apart
        # (numpy has no bf16 for DLPack to name). The array is writable because numpy before
        # 2.1 refuses to export a read-only one.
        return self._rows().__dlpack__()


def dequantize_to_bf16(r: GrpcioResult, acquire) -> None:
    """An fp8_e4m3 result turned into a bf16 one in place (a buffer from `acquire`): per value
    bf16(float32(code) * scale), the C++ client's bits; target outputs after the hidden states
    are copied over unchanged, at their new offsets."""
    from .. import E4M3_VALUES  # the package's table (imported by the time results exist)

    t, k, h = r.num_tokens, r.num_layers, r.hidden_size
    fp8_hidden = k * h + 4 * k
    tail = r.bytes_per_token - fp8_hidden
    row = k * h * 2 + tail
    out = acquire(t * row)
    rows_in = r._rows()
    rows_out = out.reshape(t, row)
    codes, scales = r.hidden_bits, r.fp8_scales
    step = max(1, _DEQUANT_VALUES_PER_STEP // max(1, k * h))
    for a in range(0, t, step):
        vals = E4M3_VALUES[codes[a:a + step]] * scales[a:a + step, :, None]
        rows_out[a:a + step, :k * h * 2] = to_bf16_bits(vals).reshape(
            vals.shape[0], -1).view(np.uint8)
    if tail:
        rows_out[:, k * h * 2:] = rows_in[:, fp8_hidden:]
    shift = k * h * 2 - fp8_hidden
    o = dict(r.outputs)
    for name in ("argmax", "top_k_ids", "top_k_logprobs", "probs_scale", "probs"):
        if o[name] >= 0:
            o[name] += shift
    r.outputs = o
    r._buf = out
    r.encoding = BF16
    r.bytes_per_token = row
