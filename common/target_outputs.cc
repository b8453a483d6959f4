#include "common/target_outputs.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace draftfeed {

TargetOutputsLayout LayoutOf(const TargetOutputs& o) {
  TargetOutputsLayout l;
  int64_t at = 0;
  if (o.argmax) {
    l.argmax = at;
    at += 4;
  }
  if (o.top_k > 0) {
    l.top_k_ids = at;
    at += 4 * int64_t{o.top_k};
    l.top_k_logprobs = at;
    at += 4 * int64_t{o.top_k};
  }
  if (!o.draft_vocab.empty()) {
    const auto vd = static_cast<int64_t>(o.draft_vocab.size());
    if (o.probs_encoding == CaptureEncoding::kFp8E4m3) {
      l.probs_scale = at;
      at += 4;
      l.probs = at;
      at += vd;
    } else {
      l.probs = at;
      at += 2 * vd;
    }
  }
  l.bytes = at;
  return l;
}

absl::Status ValidateTargetOutputs(const TargetOutputs& o, int64_t vocab_size) {
  const int64_t max_k = std::min<int64_t>(kMaxTopK, vocab_size);
  if (o.top_k < 0 || o.top_k > max_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("target_outputs.top_k is ", o.top_k, ": it must be in [0, ", max_k,
                     "] (at most ", kMaxTopK, " and the vocabulary's ", vocab_size, ")"));
  }
  const auto vd = static_cast<int64_t>(o.draft_vocab.size());
  if (vd > kMaxDraftVocab) {
    return absl::InvalidArgumentError(absl::StrCat("target_outputs.draft_vocab has ", vd,
                                                   " ids: at most ", kMaxDraftVocab,
                                                   " are served"));
  }
  if (vd > vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("target_outputs.draft_vocab has ", vd,
                                                   " ids, more than the target's vocabulary (",
                                                   vocab_size, ")"));
  }
  // Duplicates by sorting (id, position) pairs: the vocabulary bound may be
  // a placeholder (the client's, before it knows the target's).
  std::vector<std::pair<int32_t, int64_t>> sorted;
  sorted.reserve(static_cast<size_t>(vd));
  for (int64_t j = 0; j < vd; ++j) {
    const int32_t id = o.draft_vocab[static_cast<size_t>(j)];
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("target_outputs.draft_vocab[", j, "] is ",
                                                     id, ", outside the target's vocabulary [0, ",
                                                     vocab_size, ")"));
    }
    sorted.emplace_back(id, j);
  }
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].first == sorted[i - 1].first) {
      return absl::InvalidArgumentError(absl::StrCat("target_outputs.draft_vocab lists id ",
                                                     sorted[i].first, " twice (at ",
                                                     sorted[i - 1].second, " and ",
                                                     sorted[i].second, ")"));
    }
  }
  if (o.probs_encoding != CaptureEncoding::kBf16 && o.probs_encoding != CaptureEncoding::kFp8E4m3) {
    return absl::InvalidArgumentError(
        "target_outputs.draft_probs_encoding must be bf16 or fp8_e4m3");
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
