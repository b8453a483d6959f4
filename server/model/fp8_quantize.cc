#include "server/model/fp8_quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/fp8_e4m3.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

// Keeps the source model's storage (for the tensors left as they were) and
// the buffers made here alive together.
struct QuantizedStorage {
  std::shared_ptr<const void> base;
  std::vector<std::vector<uint8_t>> codes;
  std::vector<std::vector<float>> floats;
};

}  // namespace

Fp8Blocks QuantizeFp8Blocks(const Tensor& t) {
  const std::vector<float> w = ToFloat(t);
  const int64_t rows = t.shape[t.shape.size() - 2], cols = t.shape.back();
  const int64_t batch = rows * cols == 0 ? 0 : t.numel() / (rows * cols);
  const std::vector<int64_t> scale_shape = Fp8ScaleShape(t.shape);
  const int64_t srows = scale_shape[scale_shape.size() - 2], scols = scale_shape.back();
  Fp8Blocks out;
  out.codes.resize(w.size());
  out.scales.resize(static_cast<size_t>(batch * srows * scols));
  for (int64_t b = 0; b < batch; ++b) {
    const float* wb = w.data() + b * rows * cols;
    uint8_t* qb = out.codes.data() + b * rows * cols;
    for (int64_t br = 0; br < srows; ++br) {
      const int64_t r0 = br * kFp8BlockSize, r1 = std::min(rows, r0 + kFp8BlockSize);
      for (int64_t bc = 0; bc < scols; ++bc) {
        const int64_t c0 = bc * kFp8BlockSize, c1 = std::min(cols, c0 + kFp8BlockSize);
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(wb[r * cols + c]));
        }
        // An all-zero block has no magnitude to map onto 448; any positive
        // scale encodes it exactly (as +0 codes), and 1 keeps the scale
        // finite and nonzero, which --check_weights and the GEMMs' scale
        // multiplies rely on (0 would turn a later 0 * inf into NaN).
        const float s = amax > 0.0f ? amax / kE4m3Max : 1.0f;
        out.scales[static_cast<size_t>((b * srows + br) * scols + bc)] = s;
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) qb[r * cols + c] = FloatToE4m3(wb[r * cols + c] / s);
        }
      }
    }
  }
  return out;
}

absl::Status QuantizeModelFp8(Model& model) {
  const ModelConfig& c = model.config;
  if (c.quantization.enabled) {
    return absl::FailedPreconditionError(
        absl::StrCat("--quantize fp8: model ", model.id,
                     " is already FP8 (an FP8 checkpoint or -fp8 built-in); load it without "
                     "--quantize"));
  }
  if (model.weights_on_device_random) {
    return absl::FailedPreconditionError(
        absl::StrCat("--quantize fp8: model ", model.id,
                     " has its weights made on the GPU; use its -fp8 built-in variant"));
  }
  const std::vector<WeightSpec> specs = DecoderWeightSpecs(c);
  for (const WeightSpec& spec : specs) {
    if (!spec.fp8_eligible) continue;
    const Tensor& t = WeightSlot(model.weights, spec);
    if (t.fp8()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--quantize fp8: model ", model.id, " tensor ", spec.name, " is already F8_E4M3"));
    }
    if (!t.valid() || t.shape != spec.shape) {
      return absl::InvalidArgumentError(absl::StrCat("--quantize fp8: model ", model.id, " tensor ",
                                                     spec.name, " is missing or not of shape ",
                                                     spec.origin));
    }
    if (spec.expert_parts.size() > 1 && c.moe_intermediate_size % kFp8BlockSize != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--quantize fp8: model ", model.id, ": moe_intermediate_size=", c.moe_intermediate_size,
          " is not a multiple of ", kFp8BlockSize,
          ", so the stacked [gate; up] experts' scale blocks would straddle gate and up"));
    }
  }
  auto storage = std::make_shared<QuantizedStorage>();
  storage->base = model.storage;
  for (const WeightSpec& spec : specs) {
    if (!spec.fp8_eligible) continue;
    Tensor& t = WeightSlot(model.weights, spec);
    Fp8Blocks q = QuantizeFp8Blocks(t);
    t.dtype = DType::kF8E4M3;
    t.data = reinterpret_cast<const std::byte*>(q.codes.data());
    t.scale_inv.dtype = DType::kF32;
    t.scale_inv.shape = Fp8ScaleShape(t.shape);
    t.scale_inv.data = reinterpret_cast<const std::byte*>(q.scales.data());
    storage->codes.push_back(std::move(q.codes));  // moving keeps the heap buffers in place
    storage->floats.push_back(std::move(q.scales));
  }
  model.config.quantization = Fp8Quantization{.enabled = true};
  model.storage = std::move(storage);
  model.fingerprint = ComputeFingerprint(model);
  return absl::OkStatus();
}

absl::Status ApplyQuantizeFlag(Model& model, std::string_view value) {
  if (value.empty() || value == "none") return absl::OkStatus();
  if (value == "fp8") return QuantizeModelFp8(model);
  return absl::InvalidArgumentError(
      absl::StrCat("--quantize=", std::string(value), " is not supported; accepted: none, fp8"));
}

absl::StatusOr<std::unique_ptr<Model>> DequantizedFp8Copy(const Model& model) {
  if (model.weights_on_device_random) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model.id, " has no host weights to dequantize"));
  }
  auto out = std::make_unique<Model>(model);
  auto storage = std::make_shared<QuantizedStorage>();
  storage->base = model.storage;
  std::vector<WeightSpec> specs = DecoderWeightSpecs(model.config);
  specs.push_back(LmHeadSpec(model.config));
  for (const WeightSpec& spec : specs) {
    Tensor& t = WeightSlot(out->weights, spec);
    if (!t.valid() || !t.fp8()) continue;
    std::vector<float> f = ToFloat(t);
    t.dtype = DType::kF32;
    t.data = reinterpret_cast<const std::byte*>(f.data());
    t.scale_inv = BlockScales{};
    storage->floats.push_back(std::move(f));
  }
  out->id = absl::StrCat(model.id, "-dequantized");
  out->config.quantization = Fp8Quantization{};
  out->storage = std::move(storage);
  out->fingerprint = ComputeFingerprint(*out);
  return out;
}

}  // namespace draftfeed
