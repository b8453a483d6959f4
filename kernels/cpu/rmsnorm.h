// CPU reference RMSNorm in the three conventions of the Qwen3 / Qwen3.5
// families. Row-wise over `width` contiguous elements, so per-head q/k norms
// are the same call with rows = tokens * heads and width = head_dim.
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

enum class RmsNormKind {
  kZeroCentred,     // y = x̂·(1 + w)  (Qwen3.5 RMSNorm₀; w stored around 0)
  kMultiplicative,  // y = w·x̂        (Qwen3 / Llama; w stored around 1)
};

// x̂ = x·(mean(x²) + eps)^−½ per row. x, y: [rows, width]; w: [width].
// y may alias x.
void RmsNorm(const float* x, const float* w, int64_t rows, int64_t width, float eps,
             RmsNormKind kind, float* y);

// Gated DeltaNet output norm: y = w·x̂·SiLU(z), multiplicative w.
// x, z, y: [rows, width]; w: [width]. y may alias x.
void GatedRmsNorm(const float* x, const float* z, const float* w, int64_t rows, int64_t width,
                  float eps, float* y);

}  // namespace draftfeed::cpu
