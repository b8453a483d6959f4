// Fine-grained FP8 quantization at load (--quantize fp8), with the scheme of
// Qwen's FP8 releases: each 128x128 block of a GEMM weight gets one fp32
// scale s = max|W| / 448 and its elements become e4m3(W / s) (round to
// nearest even), so W ~= e4m3 * s with |error| at most half an e4m3 step of
// |W / s|, times s.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/model.h"
#include "server/model/tensor.h"

namespace draftfeed {

// One tensor quantized: the e4m3 codes (the weight's shape) and fp32 block
// scales of Fp8ScaleShape(weight shape), blocks restarting in every leading
// index (each expert of a stacked [E, rows, cols] has its own grid).
struct Fp8Blocks {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};
// `t` must be BF16, F16 or F32 with at least two dims.
Fp8Blocks QuantizeFp8Blocks(const Tensor& t);

// Replaces every fp8_eligible tensor of `model` (weight_layout.h) with an
// owned F8_E4M3 copy and F32 scales, marks the config as FP8 and recomputes
// the fingerprint. Refuses a model that is already FP8, one whose weights
// live on the device, and stacked gate/up experts whose moe_intermediate_size
// is not a multiple of 128 (their scales could not be split per expert).
absl::Status QuantizeModelFp8(Model& model);

// --quantize: "" or "none" leaves the model as it is, "fp8" quantizes it;
// anything else is refused naming the accepted values.
absl::Status ApplyQuantizeFlag(Model& model, std::string_view value);

// A copy of `model` in which every FP8 tensor is replaced by its dequantized
// values (exactly float(e4m3) * float(scale)) stored as F32 and the config is
// unquantized: what the FP8 checkpoint means, for references. Other tensors
// are shared, not copied.
absl::StatusOr<std::unique_ptr<Model>> DequantizedFp8Copy(const Model& model);

}  // namespace draftfeed
