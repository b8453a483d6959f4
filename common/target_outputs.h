// What a stream may ask of the target beyond hidden states: per token, from the
// post-final-norm state through lm_head, the full-vocabulary argmax, the top-k
// over the full vocabulary (ids and log-probabilities) and the softmax over a
// draft vocabulary (EAGLE-3's target distribution), and how those bytes sit in
// a token's payload row. The target writes them, the client reads them; both
// take the layout from here.
//
// A token's row on the wire is its hidden-state capture (CaptureBytesPerToken)
// followed by TargetOutputsLayout::bytes of outputs, in this order:
//   argmax            int32                       (when asked)
//   top_k ids         int32 [k], best first        (k > 0)
//   top_k logprobs    fp32  [k], log_softmax of the full logits
//   draft probs       bf16  [Vd]                   (bf16)
//                  or fp32 scale, then e4m3 [Vd]   (fp8_e4m3: p = code * scale)
// Every value little-endian. Keeping outputs in the token's row means every
// transport, the chunking into whole tokens and the payload checksum carry them
// unchanged.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "common/capture_encoding.h"

namespace draftfeed {

inline constexpr int32_t kMaxTopK = 256;
inline constexpr int64_t kMaxDraftVocab = 65536;

struct TargetOutputs {
  bool argmax = false;
  int32_t top_k = 0;                 // 0: none
  std::vector<int32_t> draft_vocab;  // target ids; the probs' columns, in this order
  CaptureEncoding probs_encoding = CaptureEncoding::kBf16;
  bool empty() const { return !argmax && top_k == 0 && draft_vocab.empty(); }
  friend bool operator==(const TargetOutputs&, const TargetOutputs&) = default;
};

// Byte offsets within a token's outputs (not its whole row); -1 where absent.
struct TargetOutputsLayout {
  int64_t argmax = -1;
  int64_t top_k_ids = -1;
  int64_t top_k_logprobs = -1;
  int64_t probs_scale = -1;  // fp8_e4m3 only
  int64_t probs = -1;
  int64_t bytes = 0;  // the outputs' bytes per token (0 when none is asked)
};

TargetOutputsLayout LayoutOf(const TargetOutputs& outputs);

// INVALID_ARGUMENT naming the field: top_k outside [0, min(256, vocab)], a
// draft vocabulary of more than 65,536 ids or with an id outside [0, vocab) or
// one listed twice, or a probs encoding other than bf16 / fp8_e4m3.
absl::Status ValidateTargetOutputs(const TargetOutputs& outputs, int64_t vocab_size);

}  // namespace draftfeed
