#include "server/model/weight_check.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

// Index of the first element whose exponent bits are all ones (NaN or
// infinity), or -1. Compares bits rather than widening to float, so the loop
// is a plain integer scan the compiler vectorises.
template <typename Bits>
int64_t FirstNonFinite(const std::byte* data, int64_t n, Bits exponent_mask) {
  constexpr int64_t kBlock = 4096;
  Bits block[kBlock];
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    std::memcpy(block, data + start * sizeof(Bits), len * sizeof(Bits));  // data may be unaligned
    bool any = false;
    for (int64_t i = 0; i < len; ++i) any |= (block[i] & exponent_mask) == exponent_mask;
    if (!any) continue;
    for (int64_t i = 0; i < len; ++i) {
      if ((block[i] & exponent_mask) == exponent_mask) return start + i;
    }
  }
  return -1;
}

int64_t FirstNonFinite(const Tensor& t) {
  switch (t.dtype) {
    case DType::kBF16:
      return FirstNonFinite<uint16_t>(t.data, t.numel(), 0x7f80);
    case DType::kF16:
      return FirstNonFinite<uint16_t>(t.data, t.numel(), 0x7c00);
    case DType::kF32:
      return FirstNonFinite<uint32_t>(t.data, t.numel(), 0x7f800000u);
    case DType::kInvalid:
      break;
  }
  return -1;
}

float ElementAsFloat(const Tensor& t, int64_t i) {
  if (t.dtype == DType::kF32) {
    float f;
    std::memcpy(&f, t.data + i * 4, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, t.data + i * 2, 2);
  return t.dtype == DType::kBF16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
}

absl::Status CheckTensor(const Model& model, const WeightSpec& spec, const Tensor& t) {
  if (!t.valid()) return absl::OkStatus();
  const int64_t bad = FirstNonFinite(t);
  if (bad < 0) return absl::OkStatus();
  const float v = ElementAsFloat(t, bad);
  return absl::InvalidArgumentError(
      absl::StrCat(model.id, ": tensor ", spec.name, " (", std::string(DTypeName(t.dtype)), " ",
                   t.ShapeString(), ") holds ", std::isnan(v) ? "NaN" : (v > 0 ? "+Inf" : "-Inf"),
                   " at element ", bad, "; the checkpoint is corrupt (--check_weights)"));
}

}  // namespace

absl::Status CheckWeightsFinite(const Model& model) {
  for (const WeightSpec& spec : DecoderWeightSpecs(model.config)) {
    absl::Status s = CheckTensor(model, spec, WeightSlot(model.weights, spec));
    if (!s.ok()) return s;
  }
  const WeightSpec head = LmHeadSpec(model.config);
  const Tensor& lm_head = WeightSlot(model.weights, head);
  if (lm_head.data == model.weights.embed_tokens.data) return absl::OkStatus();  // tied: scanned
  return CheckTensor(model, head, lm_head);
}

}  // namespace draftfeed
