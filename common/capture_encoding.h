// How a capture's bytes encode its [T, K, H] hidden states. Every stage from
// the engine's result to the Python Result carries the encoding and the bytes
// per token instead of assuming bf16, so a new wire encoding (FP8 with per-token
// scales, say) is a new enumerator here, its kernels and its decoder.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace draftfeed {

// The numbers are the wire's (draftfeed.v1.Encoding), so the service and the
// client convert with a cast after EncodingFromWire has checked the value.
enum class CaptureEncoding : uint8_t {
  kBf16 = 1,  // exact: 2 bytes per value, little endian
  // Per token: K*H e4m3 codes ([K, H], layer-major), then K little-endian
  // fp32 scales, one per layer; a value is code * scale (common/fp8_capture.h).
  kFp8E4m3 = 2,
};

inline constexpr std::string_view EncodingName(CaptureEncoding e) {
  switch (e) {
    case CaptureEncoding::kBf16:
      return "bf16";
    case CaptureEncoding::kFp8E4m3:
      return "fp8_e4m3";
  }
  return "unknown";
}

// Bytes one token of a capture of `layers` layers of `hidden` values takes.
// Whole tokens are the unit every transport moves (chunks hold whole tokens),
// so an encoding with per-token side data (scales) counts it here.
inline constexpr int64_t CaptureBytesPerToken(CaptureEncoding e, int64_t layers, int64_t hidden) {
  switch (e) {
    case CaptureEncoding::kBf16:
      return layers * hidden * 2;
    case CaptureEncoding::kFp8E4m3:
      return layers * hidden + 4 * layers;
  }
  return 0;
}

// The encodings this build serves, by wire number; nullopt for one it does
// not (0, ENCODING_UNSPECIFIED, means bf16 on the wire and is mapped by the
// caller before it asks).
inline constexpr std::optional<CaptureEncoding> EncodingFromWire(int wire) {
  if (wire == static_cast<int>(CaptureEncoding::kBf16)) return CaptureEncoding::kBf16;
  if (wire == static_cast<int>(CaptureEncoding::kFp8E4m3)) return CaptureEncoding::kFp8E4m3;
  return std::nullopt;
}

}  // namespace draftfeed
