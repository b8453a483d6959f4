#include "kernels/cpu/rmsnorm.h"

#include <cmath>

namespace draftfeed::cpu {
namespace {

// The sum of squares is kept in double: torch's fp32 reduction is pairwise,
// and a plain fp32 running sum over thousands of elements would be the
// least accurate step of the whole norm.
float InvRms(const float* x, int64_t width, float eps) {
  double sum = 0.0;
  for (int64_t i = 0; i < width; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float mean = static_cast<float>(sum / static_cast<double>(width));
  return 1.0f / std::sqrt(mean + eps);
}

}  // namespace

void RmsNorm(const float* x, const float* w, int64_t rows, int64_t width, float eps,
             RmsNormKind kind, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    float* yr = y + r * width;
    const float inv = InvRms(xr, width, eps);
    if (kind == RmsNormKind::kZeroCentred) {
      for (int64_t i = 0; i < width; ++i) yr[i] = (xr[i] * inv) * (1.0f + w[i]);
    } else {
      for (int64_t i = 0; i < width; ++i) yr[i] = w[i] * (xr[i] * inv);
    }
  }
}

void GatedRmsNorm(const float* x, const float* z, const float* w, int64_t rows, int64_t width,
                  float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    const float* zr = z + r * width;
    float* yr = y + r * width;
    const float inv = InvRms(xr, width, eps);
    for (int64_t i = 0; i < width; ++i) {
      const float silu = zr[i] / (1.0f + std::exp(-zr[i]));
      yr[i] = (w[i] * (xr[i] * inv)) * silu;
    }
  }
}

}  // namespace draftfeed::cpu
