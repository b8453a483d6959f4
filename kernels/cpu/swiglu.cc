#include "kernels/cpu/swiglu.h"

#include <cmath>

namespace draftfeed::cpu {

void SwiGlu(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    // x / (1 + e^−x) is finite for every x: e^−x overflows to inf only where
    // the quotient is −0 anyway.
    out[i] = (g / (1.0f + std::exp(-g))) * up[i];
  }
}

}  // namespace draftfeed::cpu
