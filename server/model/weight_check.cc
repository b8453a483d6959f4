#include "server/model/weight_check.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fp8_e4m3.h"
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

// e4m3 has no infinities; 0x7f and 0xff are its NaNs.
int64_t FirstE4m3NaN(const std::byte* data, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if ((static_cast<uint8_t>(data[i]) & 0x7f) == 0x7f) return i;
  }
  return -1;
}

int64_t FirstNonFinite(const Tensor& t) {
  switch (t.dtype) {
    case DType::kF8E4M3:
      return FirstE4m3NaN(t.data, t.numel());
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
  if (t.dtype == DType::kF8E4M3) return E4m3ToFloat(static_cast<uint8_t>(t.data[i]));
  if (t.dtype == DType::kF32) {
    float f;
    std::memcpy(&f, t.data + i * 4, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, t.data + i * 2, 2);
  return t.dtype == DType::kBF16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
}

// An FP8 weight's block scales multiply every element of their block: each
// must be finite and positive (a zero scale erases its block, a negative one
// flips it; neither comes out of a quantiser).
absl::Status CheckScales(const Model& model, const WeightSpec& spec, const Tensor& t) {
  const BlockScales& s = t.scale_inv;
  if (!s.valid()) return absl::OkStatus();
  Tensor view;
  view.dtype = s.dtype;
  view.shape = s.shape;
  view.data = s.data;
  const int64_t n = view.numel();
  for (int64_t i = 0; i < n; ++i) {
    const float v = ElementAsFloat(view, i);
    if (std::isfinite(v) && v > 0) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        model.id, ": tensor ", spec.name, "_scale_inv (", std::string(DTypeName(s.dtype)), " ",
        view.ShapeString(), ") holds ", absl::StrCat(v), " at element ", i,
        "; FP8 block scales must be finite and positive, the checkpoint is corrupt "
        "(--check_weights)"));
  }
  return absl::OkStatus();
}

absl::Status CheckTensor(const Model& model, const WeightSpec& spec, const Tensor& t) {
  if (!t.valid()) return absl::OkStatus();
  if (t.fp8()) {
    if (absl::Status st = CheckScales(model, spec, t); !st.ok()) return st;
  }
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
