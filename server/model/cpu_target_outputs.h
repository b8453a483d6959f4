// Target outputs on the CPU engines: the post-final-norm states through
// lm_head (fp32, in chunks of tokens so a large batch never holds all its
// logits at once), then the argmax, top-k and draft-vocabulary softmax of
// kernels/cpu/target_outputs.h, encoded into each token's row as
// common/target_outputs.h lays it out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "common/target_outputs.h"
#include "server/model/model.h"

namespace draftfeed {

class CpuTargetOutputs {
 public:
  // `model` must outlive this; lm_head is widened to fp32 on first use.
  CpuTargetOutputs(const Model* model, int threads) : model_(model), threads_(threads) {}

  bool served() const { return model_->weights.lm_head.valid(); }

  // Writes token t's outputs at rows + t * row_pitch + offset for the
  // `tokens` states [tokens, H] in `final_states`.
  absl::Status Write(std::span<const float> final_states, int64_t tokens,
                     const TargetOutputs& outputs, std::byte* rows, int64_t row_pitch,
                     int64_t offset);

  // Tokens whose logits are held at once.
  static constexpr int64_t kChunkTokens = 256;

 private:
  const Model* model_;
  const int threads_;
  std::once_flag widened_;
  std::vector<float> lm_head_;  // [V, H] fp32
};

}  // namespace draftfeed
