// Chunked prefill's plan: how a batch larger than one forward is cut into
// forwards of at most `max_forward_tokens` tokens, each carrying the sequence
// it splits into the next (ForwardInput::resume_tokens, carry_last).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace draftfeed {

struct ForwardChunk {
  int64_t token_begin = 0;  // the chunk is tokens [token_begin, token_end) of the batch
  int64_t token_end = 0;
  std::vector<int32_t> seq_lens;  // of the parts of sequences in the chunk
  int64_t resume_tokens = 0;      // the first part continues a sequence this far in
  bool carry_last = false;        // the last part goes on in the next chunk
  int64_t tokens() const { return token_end - token_begin; }
};

// Where a spanning sequence is cut: at a multiple of kSplitAlign tokens from
// its start, so every part but the last is whole GDN chunks of 64 (the CPU
// and CUDA delta rules then compute exactly what one pass does) and attention
// tiles stay aligned. A chunk ends early rather than cut a sequence less than
// kSplitAlign tokens in; with a budget under kSplitAlign cuts fall anywhere.
inline constexpr int64_t kSplitAlign = 64;

// The forwards of a batch of `seq_lens` (each >= 1) under a budget of
// `max_forward_tokens` (>= 1): sequences packed in order, each chunk as full
// as the alignment allows. One chunk, the whole batch, when it fits.
std::vector<ForwardChunk> PlanForwardChunks(std::span<const int32_t> seq_lens,
                                            int64_t max_forward_tokens);

}  // namespace draftfeed
