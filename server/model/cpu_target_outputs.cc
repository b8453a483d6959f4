#include "server/model/cpu_target_outputs.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/fp8_e4m3.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/target_outputs.h"
#include "server/model/tensor.h"

namespace draftfeed {
namespace {

void Put(std::byte* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }  // little endian host

}  // namespace

absl::Status CpuTargetOutputs::Write(std::span<const float> final_states, int64_t tokens,
                                     const TargetOutputs& outputs, std::byte* rows,
                                     int64_t row_pitch, int64_t offset) {
  if (!served()) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model_->id, " has no lm_head: target outputs cannot be computed"));
  }
  const int64_t d = model_->config.hidden_size;
  const int64_t v = model_->config.vocab_size;
  std::call_once(widened_, [&] { lm_head_ = ToFloat(model_->weights.lm_head); });
  if (static_cast<int64_t>(lm_head_.size()) != v * d) {
    return absl::InternalError(absl::StrCat("lm_head has ", lm_head_.size(),
                                            " values; the vocabulary x hidden size is ", v * d));
  }
  const TargetOutputsLayout layout = LayoutOf(outputs);
  const int32_t k = outputs.top_k;
  const auto vd = static_cast<int64_t>(outputs.draft_vocab.size());
  const int64_t chunk = std::min(tokens, kChunkTokens);
  std::vector<float> logits(static_cast<size_t>(chunk * v));
  std::vector<int32_t> argmax(static_cast<size_t>(outputs.argmax ? chunk : 0));
  std::vector<int32_t> top_ids(static_cast<size_t>(chunk * k));
  std::vector<float> top_logprobs(top_ids.size());
  std::vector<float> probs(static_cast<size_t>(chunk * vd));
  for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
    const int64_t n = std::min(chunk, tokens - t0);
    cpu::Gemm(final_states.data() + t0 * d, lm_head_.data(), logits.data(), n, v, d, threads_);
    cpu::TargetOutputsFromLogits(logits.data(), n, v, outputs.draft_vocab.data(), vd, k,
                                 outputs.argmax ? argmax.data() : nullptr, top_ids.data(),
                                 top_logprobs.data(), vd > 0 ? probs.data() : nullptr, threads_);
    for (int64_t i = 0; i < n; ++i) {
      std::byte* row = rows + (t0 + i) * row_pitch + offset;
      if (layout.argmax >= 0) Put(row + layout.argmax, &argmax[i], 4);
      if (k > 0) {
        Put(row + layout.top_k_ids, &top_ids[i * k], 4 * size_t(k));
        Put(row + layout.top_k_logprobs, &top_logprobs[i * k], 4 * size_t(k));
      }
      if (vd == 0) continue;
      const float* p = probs.data() + i * vd;
      std::byte* dst = row + layout.probs;
      if (outputs.probs_encoding == CaptureEncoding::kFp8E4m3) {
        float amax = 0;
        for (int64_t j = 0; j < vd; ++j) amax = std::max(amax, p[j]);
        const float scale = amax > 0 ? amax / kE4m3Max : 1.0f;
        Put(row + layout.probs_scale, &scale, 4);
        for (int64_t j = 0; j < vd; ++j) dst[j] = static_cast<std::byte>(FloatToE4m3(p[j] / scale));
      } else {
        for (int64_t j = 0; j < vd; ++j) {
          const uint16_t bits = FloatToBf16(p[j]);
          Put(dst + 2 * j, &bits, 2);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
