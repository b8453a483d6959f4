#include "kernels/cpu/rope.h"

#include <cmath>
#include <vector>

namespace draftfeed::cpu {

void SequencePositions(const int32_t* cu_seqlens, int64_t num_seqs, int32_t* positions) {
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int32_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) positions[t] = t - cu_seqlens[s];
  }
}

void ApplyRope(float* x, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
               int64_t rotary_dim, const int32_t* positions, float theta) {
  const int64_t half = rotary_dim / 2;
  if (half == 0) return;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(rotary_dim);
    inv_freq[j] = 1.0f / std::pow(theta, exponent);
  }
  std::vector<float> cos_t(static_cast<size_t>(half)), sin_t(static_cast<size_t>(half));
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float pos = static_cast<float>(positions[t]);
    for (int64_t j = 0; j < half; ++j) {
      const float angle = pos * inv_freq[j];
      cos_t[j] = std::cos(angle);
      sin_t[j] = std::sin(angle);
    }
    for (int64_t h = 0; h < num_heads; ++h) {
      float* v = x + (t * num_heads + h) * head_dim;
      for (int64_t j = 0; j < half; ++j) {
        const float a = v[j];
        const float b = v[j + half];
        v[j] = a * cos_t[j] - b * sin_t[j];
        v[j + half] = b * cos_t[j] + a * sin_t[j];
      }
    }
  }
}

}  // namespace draftfeed::cpu
