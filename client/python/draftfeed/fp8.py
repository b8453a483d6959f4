"""FP8 (OCP e4m3) decoding: every code's value, an fp8_e4m3 result's codes and scales viewed
apart, and their dequantization to bf16 with torch ops (the same bits as the C++ client's)."""

from __future__ import annotations

import numpy as np


def _e4m3_values() -> np.ndarray:
    # Every OCP e4m3 code's value, exact in float32: 2^-9 * m below the normals,
    # 2^(e-7) * (1 + m/8) above; 0x7f and 0xff are NaN.
    code = np.arange(256)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp, man = (code >> 3) & 0xF, code & 0x7
    mag = np.where(exp == 0, man * 2.0 ** -9, 2.0 ** (exp - 7) * (1 + man / 8))
    mag = np.where((exp == 0xF) & (man == 0x7), np.nan, mag)
    return (sign * mag).astype(np.float32)


E4M3_VALUES = _e4m3_values()

# Tokens of an fp8 result dequantized per step on torch: bounds the fp32 (and,
# without torch.float8_e4m3fn, int64 index) temporaries at 2^24 values.
_DEQUANT_VALUES_PER_STEP = 1 << 24


def _fp8_torch(raw, num_layers: int, hidden_size: int):
    """(codes [T, K, H], scales [T, K] float32) viewed out of an fp8_e4m3 result's raw
    bytes, a uint8 torch tensor [T, K*H + 4K]; codes are torch.float8_e4m3fn where torch has
    it, else uint8."""
    import torch

    kh = num_layers * hidden_size
    codes = raw[:, :kh].unflatten(1, (num_layers, hidden_size))
    if hasattr(torch, "float8_e4m3fn"):
        codes = codes.view(torch.float8_e4m3fn)
    scale_bytes = raw[:, kh:kh + 4 * num_layers]  # target outputs, if any, follow
    if kh % 4 or raw.shape[1] % 4:  # a float32 view needs 4-byte aligned rows
        scale_bytes = scale_bytes.contiguous()
    return codes, scale_bytes.view(torch.float32)


def dequantize_fp8(codes, scales):
    """bf16 [T, K, H] from fp8_e4m3 codes [T, K, H] (torch.float8_e4m3fn or uint8) and
    scales [T, K], on their device: bf16(float32(code) * scale), the same bits as the C++
    client's dequantization on the way in."""
    import torch

    t = codes.shape[0]
    out = torch.empty(codes.shape, dtype=torch.bfloat16, device=codes.device)
    step = max(1, _DEQUANT_VALUES_PER_STEP // max(1, codes[0].numel() if t else 1))
    table = None
    for a in range(0, t, step):
        c = codes[a:a + step]
        if c.dtype == torch.uint8:
            if table is None:
                table = torch.from_numpy(E4M3_VALUES).to(codes.device)
            v = table[c.long()]
        else:
            v = c.float()
        out[a:a + step] = (v * scales[a:a + step].unsqueeze(-1)).to(torch.bfloat16)
    return out
