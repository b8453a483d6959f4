// The fp8_e4m3 capture encoding on the host: the CPU engine's encoder, the
// client's decoders, and the reference the GPU encoder (kernels/capture_fp8)
// matches bit for bit.
//
// Layout, per token (whole tokens are the unit every transport moves): the K
// layers' H values as e4m3 codes, layer-major ([K, H], K*H bytes), then K
// little-endian fp32 scales (4K bytes): K*H + 4K bytes a token.
// A value is e4m3 * scale. The scale of a (token, layer) row is
// s = amax / 448 with amax = max |x| over the row, or 1 where that is not
// > 0 (an all-zero row, or an amax so small that amax / 448 underflows), and
// each code is FloatToE4m3(x / s) with IEEE fp32 division: the row's largest
// magnitude lands on 448 exactly and nothing saturates.
// NaN: amax is taken over the row's non-NaN magnitudes (fmaxf), a NaN value
// stays NaN (code 0x7f) and its row's other values encode as usual. An
// infinite value makes s infinite: the row's finite values encode as 0 and the
// infinite ones as NaN. The engines make neither from finite weights.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace draftfeed {

// The scale of a row whose largest magnitude is `amax` (see above).
inline float Fp8RowScale(float amax) {
  const float s = amax / 448.0f;
  return s > 0.0f ? s : 1.0f;
}

// Encodes `hidden` values into `codes` and returns the row's scale.
float EncodeFp8Row(const float* x, int64_t hidden, uint8_t* codes);
// The same from bf16 bit patterns (widened exactly first).
float EncodeFp8RowBf16(const uint16_t* x, int64_t hidden, uint8_t* codes);

// [T, K, H] states, token-major, into the layout above. `out` must be exactly
// T * (K*H + 4K) bytes; INVALID_ARGUMENT naming both sizes otherwise.
absl::Status EncodeFp8Capture(std::span<const float> states, int64_t tokens, int64_t layers,
                              int64_t hidden, std::span<std::byte> out);
absl::Status EncodeFp8CaptureBf16(std::span<const uint16_t> states, int64_t tokens, int64_t layers,
                                  int64_t hidden, std::span<std::byte> out);

// Dequantizes a capture to [T, K, H]: float(e4m3) * s as one fp32 multiply
// (the e4m3 value is exact in fp32), then, for bf16, rounded to nearest even:
// the same two operations torch does for `codes.float() * scales` then
// `.bfloat16()`, so the GPU decode of the Python client gives the same bits. INVALID_ARGUMENT
// naming the sizes when `in` or `out` does not fit the shape.
absl::Status DecodeFp8CaptureToBf16(std::span<const std::byte> in, int64_t tokens, int64_t layers,
                                    int64_t hidden, std::span<uint16_t> out);
absl::Status DecodeFp8CaptureToFloat(std::span<const std::byte> in, int64_t tokens, int64_t layers,
                                     int64_t hidden, std::span<float> out);

// The scale of row (t, k) of a capture (unaligned little-endian fp32).
float Fp8CaptureScale(const std::byte* capture, int64_t layers, int64_t hidden, int64_t t,
                      int64_t k);

}  // namespace draftfeed
