// The dot product every CPU reference kernel shares (internal to kernels/cpu).
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

// Eight interleaved partial sums let the compiler vectorise without
// reassociating on its own, and fix the summation order for every row, so
// results never depend on the thread count or on packing.
inline float Dot(const float* a, const float* b, int64_t n) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) part[l] += a[i + l] * b[i + l];
  }
  for (; i < n; ++i) part[i % 8] += a[i] * b[i];
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

}  // namespace draftfeed::cpu
