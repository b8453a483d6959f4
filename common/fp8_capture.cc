#include "common/fp8_capture.h"

#include <array>
#include <bit>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fp8_e4m3.h"
#include "common/status_macros.h"

namespace draftfeed {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the capture's scales are little-endian fp32, copied as they are");

int64_t TokenBytes(int64_t layers, int64_t hidden) { return layers * hidden + 4 * layers; }

absl::Status CheckShape(const char* what, int64_t tokens, int64_t layers, int64_t hidden,
                        size_t values, size_t bytes) {
  if (tokens < 0 || layers < 0 || hidden < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": negative shape [", tokens, ", ", layers, ", ", hidden, "]"));
  }
  const size_t need_values = static_cast<size_t>(tokens * layers * hidden);
  const size_t need_bytes = static_cast<size_t>(tokens * TokenBytes(layers, hidden));
  if (values != need_values || bytes != need_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": [", tokens, ", ", layers, ", ", hidden, "] takes ", need_values,
                     " values and ", need_bytes, " fp8_e4m3 bytes (", TokenBytes(layers, hidden),
                     " a token); got ", values, " values and ", bytes, " bytes"));
  }
  return absl::OkStatus();
}

// Round to nearest even, as server/model's FloatToBf16 (common/ links nothing
// of the model's); a NaN stays a quiet NaN.
inline uint16_t ToBf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x0040);
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

inline float Bf16Bits(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

template <typename Value>
float EncodeRow(int64_t hidden, uint8_t* codes, Value x) {
  // The max over non-NaN magnitudes: a comparison with NaN is false, as in
  // the GPU's fmaxf.
  float amax = 0.0f;
  for (int64_t i = 0; i < hidden; ++i) {
    const float a = std::fabs(x(i));
    amax = a > amax ? a : amax;
  }
  const float s = Fp8RowScale(amax);
  for (int64_t i = 0; i < hidden; ++i) codes[i] = FloatToE4m3(x(i) / s);
  return s;
}

// Calls row(t, k, codes) -> scale for every row and lays the results out.
template <typename RowFn>
void EncodeRows(int64_t tokens, int64_t layers, int64_t hidden, std::byte* out, RowFn row) {
  const int64_t token_bytes = TokenBytes(layers, hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    std::byte* token = out + t * token_bytes;
    for (int64_t k = 0; k < layers; ++k) {
      const float s = row(t, k, reinterpret_cast<uint8_t*>(token + k * hidden));
      std::memcpy(token + layers * hidden + 4 * k, &s, 4);
    }
  }
}

// Below this width a row's 256-entry table costs more than it saves.
constexpr int64_t kTableMinHidden = 256;

}  // namespace

float EncodeFp8Row(const float* x, int64_t hidden, uint8_t* codes) {
  return EncodeRow(hidden, codes, [x](int64_t i) { return x[i]; });
}

float EncodeFp8RowBf16(const uint16_t* x, int64_t hidden, uint8_t* codes) {
  return EncodeRow(hidden, codes, [x](int64_t i) { return Bf16Bits(x[i]); });
}

absl::Status EncodeFp8Capture(std::span<const float> states, int64_t tokens, int64_t layers,
                              int64_t hidden, std::span<std::byte> out) {
  DF_RETURN_IF_ERROR(
      CheckShape("EncodeFp8Capture", tokens, layers, hidden, states.size(), out.size()));
  EncodeRows(tokens, layers, hidden, out.data(), [&](int64_t t, int64_t k, uint8_t* codes) {
    return EncodeFp8Row(states.data() + (t * layers + k) * hidden, hidden, codes);
  });
  return absl::OkStatus();
}

absl::Status EncodeFp8CaptureBf16(std::span<const uint16_t> states, int64_t tokens, int64_t layers,
                                  int64_t hidden, std::span<std::byte> out) {
  DF_RETURN_IF_ERROR(
      CheckShape("EncodeFp8CaptureBf16", tokens, layers, hidden, states.size(), out.size()));
  EncodeRows(tokens, layers, hidden, out.data(), [&](int64_t t, int64_t k, uint8_t* codes) {
    return EncodeFp8RowBf16(states.data() + (t * layers + k) * hidden, hidden, codes);
  });
  return absl::OkStatus();
}

float Fp8CaptureScale(const std::byte* capture, int64_t layers, int64_t hidden, int64_t t,
                      int64_t k) {
  float s;
  std::memcpy(&s, capture + t * TokenBytes(layers, hidden) + layers * hidden + 4 * k, 4);
  return s;
}

absl::Status DecodeFp8CaptureToBf16(std::span<const std::byte> in, int64_t tokens, int64_t layers,
                                    int64_t hidden, std::span<uint16_t> out) {
  DF_RETURN_IF_ERROR(
      CheckShape("DecodeFp8CaptureToBf16", tokens, layers, hidden, out.size(), in.size()));
  const int64_t token_bytes = TokenBytes(layers, hidden);
  std::array<uint16_t, 256> table;
  for (int64_t t = 0; t < tokens; ++t) {
    const auto* codes = reinterpret_cast<const uint8_t*>(in.data() + t * token_bytes);
    for (int64_t k = 0; k < layers; ++k) {
      const float s = Fp8CaptureScale(in.data(), layers, hidden, t, k);
      const uint8_t* row = codes + k * hidden;
      uint16_t* dst = out.data() + (t * layers + k) * hidden;
      if (hidden >= kTableMinHidden) {
        // The row's 256 possible results once, then a byte-to-uint16 lookup:
        // the same bits as the direct form below, several times faster.
        for (int c = 0; c < 256; ++c) {
          table[static_cast<size_t>(c)] = ToBf16(E4m3ToFloatFast(static_cast<uint8_t>(c)) * s);
        }
        for (int64_t i = 0; i < hidden; ++i) dst[i] = table[row[i]];
      } else {
        for (int64_t i = 0; i < hidden; ++i) dst[i] = ToBf16(E4m3ToFloatFast(row[i]) * s);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeFp8CaptureToFloat(std::span<const std::byte> in, int64_t tokens, int64_t layers,
                                     int64_t hidden, std::span<float> out) {
  DF_RETURN_IF_ERROR(
      CheckShape("DecodeFp8CaptureToFloat", tokens, layers, hidden, out.size(), in.size()));
  const int64_t token_bytes = TokenBytes(layers, hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    const auto* codes = reinterpret_cast<const uint8_t*>(in.data() + t * token_bytes);
    for (int64_t k = 0; k < layers; ++k) {
      const float s = Fp8CaptureScale(in.data(), layers, hidden, t, k);
      const uint8_t* row = codes + k * hidden;
      float* dst = out.data() + (t * layers + k) * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] = E4m3ToFloatFast(row[i]) * s;
    }
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
