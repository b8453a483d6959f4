#include "server/model/tensor.h"

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_join.h"
#include "common/fp8_e4m3.h"

namespace draftfeed {

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF32:
      return "F32";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kInvalid:
      break;
  }
  return "INVALID";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
      return 4;
    case DType::kF8E4M3:
      return 1;
    case DType::kInvalid:
      break;
  }
  return 0;
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t BlockScales::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<int64_t> Fp8ScaleShape(const std::vector<int64_t>& weight_shape) {
  std::vector<int64_t> s = weight_shape;
  const size_t n = s.size();
  for (size_t i = n >= 2 ? n - 2 : 0; i < n; ++i) s[i] = (s[i] + kFp8BlockSize - 1) / kFp8BlockSize;
  return s;
}

std::string Tensor::ShapeString() const { return "[" + absl::StrJoin(shape, ", ") + "]"; }

uint16_t FloatToBf16(float f) {
  uint32_t bits = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x0040);  // keep it a quiet NaN
  const uint32_t rounding_bias = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

float Bf16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3FF;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return std::bit_cast<float>(bits);
}

uint16_t FloatToFp16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  if (std::isnan(f)) return sign | 0x7E00;
  const float a = std::fabs(f);
  if (a >= 65520.0f) return sign | 0x7C00;  // rounds to infinity
  if (a < 6.103515625e-05f) {               // subnormal range: scale by 2^24, round to even
    const float scaled = a * 16777216.0f;
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));
  }
  uint32_t abits = bits & 0x7FFFFFFF;
  const uint32_t rounding = 0xFFF + ((abits >> 13) & 1);
  abits += rounding;
  const uint32_t exp = (abits >> 23) - 127 + 15;
  const uint32_t mant = (abits >> 13) & 0x3FF;
  return sign | static_cast<uint16_t>((exp << 10) | mant);
}

namespace {

// Element i of a bf16 / f16 / f32 array, widened exactly.
float WidenAt(DType dtype, const std::byte* data, int64_t i) {
  if (dtype == DType::kF32) {
    float f;
    std::memcpy(&f, data + 4 * i, 4);
    return f;
  }
  uint16_t v;
  std::memcpy(&v, data + 2 * i, 2);
  return dtype == DType::kBF16 ? Bf16ToFloat(v) : Fp16ToFloat(v);
}

std::vector<float> DequantizeFp8(const Tensor& t) {
  const BlockScales& s = t.scale_inv;
  const bool scale_dtype_ok =
      s.dtype == DType::kBF16 || s.dtype == DType::kF16 || s.dtype == DType::kF32;
  if (t.shape.size() < 2 || !s.valid() || !scale_dtype_ok || s.shape != Fp8ScaleShape(t.shape)) {
    std::fprintf(stderr, "ToFloat: FP8 tensor %s without scales of shape [%s]\n",
                 t.ShapeString().c_str(), absl::StrJoin(Fp8ScaleShape(t.shape), ", ").c_str());
    std::abort();
  }
  const int64_t rows = t.shape[t.shape.size() - 2], cols = t.shape.back();
  const int64_t batch = rows * cols == 0 ? 0 : t.numel() / (rows * cols);
  const int64_t srows = s.shape[s.shape.size() - 2], scols = s.shape.back();
  std::vector<float> out(static_cast<size_t>(t.numel()));
  std::vector<float> row_scales(static_cast<size_t>(scols));
  const auto* q = reinterpret_cast<const uint8_t*>(t.data);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t sbase = (b * srows + r / kFp8BlockSize) * scols;
      for (int64_t j = 0; j < scols; ++j) row_scales[j] = WidenAt(s.dtype, s.data, sbase + j);
      const int64_t base = (b * rows + r) * cols;
      for (int64_t c = 0; c < cols; ++c) {
        out[base + c] = E4m3ToFloatFast(q[base + c]) * row_scales[c / kFp8BlockSize];
      }
    }
  }
  return out;
}

}  // namespace

std::vector<float> ToFloat(const Tensor& t) {
  if (t.fp8()) return DequantizeFp8(t);
  const int64_t n = t.numel();
  std::vector<float> out(static_cast<size_t>(n));
  switch (t.dtype) {
    case DType::kF32:
      std::memcpy(out.data(), t.data, static_cast<size_t>(n) * 4);
      break;
    case DType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, t.data + 2 * i, 2);
        out[i] = Bf16ToFloat(v);
      }
      break;
    case DType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t v;
        std::memcpy(&v, t.data + 2 * i, 2);
        out[i] = Fp16ToFloat(v);
      }
      break;
    case DType::kF8E4M3:  // handled above
    case DType::kInvalid:
      out.clear();
      break;
  }
  return out;
}

}  // namespace draftfeed
