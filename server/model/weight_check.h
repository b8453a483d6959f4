// --check_weights (on by default): a pass over every weight of a loaded model
// that refuses NaN and infinities, which would otherwise load fine and serve
// NaN states, and for FP8 weights NaN codes (0x7f, 0xff) and block scales that
// are not finite, not positive or so large that the FP8 GEMMs overflow.
//
// It reads the weights where the loader left them (the checkpoint's mmap'd
// safetensors bytes, or a built-in model's buffers), split into chunks that
// every core scans at once with loops the compiler vectorises.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "server/model/model.h"

namespace draftfeed {

// The largest FP8 block scale (weight_scale_inv) accepted: 2^64 / 448, about
// 4.1e16, so that no dequantized weight (448 x scale at most) exceeds 2^64.
// Why that bound: an FP8 GEMM sums, in fp32, K products of a weight and an
// activation and writes the sum as bf16; fp32 and bf16 both end at about
// 2^128. A weight under 2^64 leaves 2^64 for K x |activation|: with K up to
// 2^16 (the widest contraction of any Qwen shape is under 2^15) that is
// activations up to 2^48 (2.8e14) before an output overflows to Inf, where
// hidden states of a working model stay under about 1e5. A scale over it
// cannot come out of a quantizer (real scales are amax/448, about 1e-3): the
// checkpoint is corrupt. Checking only that 448 x scale is finite would pass
// 1e35, whose weights of 4e37 overflow at the first activation over 10.
inline constexpr double kMaxFp8BlockScale = 0x1p64 / 448.0;

struct WeightCheckStats {
  int64_t tensors = 0;  // tensors scanned, FP8 scale tensors included
  int64_t bytes = 0;    // their bytes
  int threads = 0;      // threads that scanned them
  double seconds = 0;   // wall time of the scan
};

// Scans every decoder tensor and lm_head; of the bad values, the first in
// canonical order (a tensor's scales before its values) fails with
// INVALID_ARGUMENT naming the model, the tensor, the element and its index,
// the value and the fix. Tensors without host data (absent lm_head, weights
// made on the device) are skipped. `threads` <= 0: one per hardware thread.
absl::Status CheckWeightsFinite(const Model& model, WeightCheckStats* stats = nullptr,
                                int threads = 0);

}  // namespace draftfeed
