#include "client/src/target_outputs.h"

#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/fp8_e4m3.h"

namespace draftfeed {

absl::StatusOr<TargetOutputs> CheckedTargetOutputs(const TargetOutputOptions& options) {
  TargetOutputs o;
  o.argmax = options.argmax;
  o.top_k = options.top_k;
  o.draft_vocab = options.draft_vocab;
  if (options.probs_encoding != Encoding::kBf16 && options.probs_encoding != Encoding::kFp8E4m3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FeedOptions.target_outputs.probs_encoding is ", static_cast<int>(options.probs_encoding),
        "; draft probabilities come as bf16 (1) or fp8_e4m3 (2)"));
  }
  o.probs_encoding = static_cast<CaptureEncoding>(options.probs_encoding);
  // The largest id is the target's to bound (its vocabulary); here only what
  // no target could take.
  if (absl::Status s = ValidateTargetOutputs(o, std::numeric_limits<int32_t>::max()); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("FeedOptions.", s.message()));
  }
  return o;
}

TargetOutputOffsets RowOffsets(const TargetOutputs& outputs, const TargetOutputsLayout& layout,
                               int64_t hidden_bytes) {
  auto at = [hidden_bytes](int64_t offset) { return offset < 0 ? -1 : hidden_bytes + offset; };
  TargetOutputOffsets r;
  r.argmax = at(layout.argmax);
  r.top_k_ids = at(layout.top_k_ids);
  r.top_k_logprobs = at(layout.top_k_logprobs);
  r.probs_scale = at(layout.probs_scale);
  r.probs = at(layout.probs);
  r.top_k = outputs.top_k;
  r.num_draft = static_cast<int64_t>(outputs.draft_vocab.size());
  r.probs_encoding = static_cast<Encoding>(outputs.probs_encoding);
  return r;
}

void HiddenBatch::draft_probs(int64_t t, std::span<float> probs) const {
  const std::span<const std::byte> b = bytes();
  if (outputs.probs < 0 || b.empty()) return;
  const std::byte* row = b.data() + t * bytes_per_token;
  const auto n = static_cast<int64_t>(std::min<size_t>(probs.size(), size_t(outputs.num_draft)));
  if (outputs.probs_encoding == Encoding::kFp8E4m3) {
    float scale;
    std::memcpy(&scale, row + outputs.probs_scale, 4);
    const auto* codes = reinterpret_cast<const uint8_t*>(row + outputs.probs);
    for (int64_t j = 0; j < n; ++j) probs[j] = E4m3ToFloatFast(codes[j]) * scale;
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    uint16_t bits;
    std::memcpy(&bits, row + outputs.probs + 2 * j, 2);
    const uint32_t wide = uint32_t{bits} << 16;
    std::memcpy(&probs[j], &wide, 4);
  }
}

}  // namespace draftfeed
