// The activation quantizer divides by a group's scale through its
// reciprocal (kernels/fp8_quantize_group.cuh): this counts, on the device,
// the (amax, x) pairs of bf16 values where that e4m3 differs from the e4m3
// of the IEEE quotient. Every positive finite amax and every x with
// |x| <= amax is tried.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace draftfeed::testing {

struct DivisionCheck {
  uint64_t pairs = 0;                              // (amax, x) pairs tried
  uint64_t mismatches = 0;                         // pairs whose e4m3 bytes differ
  uint32_t first_amax_bits = 0, first_x_bits = 0;  // the first one found (bf16 bits)
};

cudaError_t CheckReciprocalDivisionForEveryBf16(DivisionCheck* out);

}  // namespace draftfeed::testing
