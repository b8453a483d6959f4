// Target outputs from full-vocabulary fp32 logits on the GPU: per token the
// argmax, the top-k (ids and log_softmax values) and the softmax restricted
// to a draft vocabulary, written straight into each token's row of a payload.
// The definitions are the CPU reference's (kernels/cpu/target_outputs.h):
//   - argmax and top-k: larger logit first, ties to the lower id;
//   - logprob(i) = l_i - (m + log Σ_v exp(l_v - m)), m = max_v l_v;
//   - draft probs p_j = exp(l_{d_j} - md) / Σ_j exp(l_{d_j} - md).
// Encodings of the probs: bf16 (round to nearest even of the fp32 p), or
// fp8_e4m3 with one fp32 scale per token, s = max_j p_j / 448 (1 where that
// is not > 0) and code_j = RNE-satfinite(p_j / s) with IEEE division, as
// kernels/capture_fp8.cuh encodes hidden states.
//
// Each row of logits is read once: the draft columns are picked out of the
// stream as it passes (through a vocabulary-ordered index of the draft ids,
// built once per draft vocabulary), and the top-k is kept as a shrinking
// candidate set above a rising threshold, so top_k 0 and 256 move the same
// bytes. The op is target_outputs.cu, the index target_outputs_index.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace draftfeed::cuda {

// Byte offsets within a token's row; -1 where the output is not asked.
struct TargetOutputOffsets {
  int64_t argmax = -1;          // int32
  int64_t top_k_ids = -1;       // int32 [top_k], best first
  int64_t top_k_logprobs = -1;  // fp32 [top_k]
  int64_t probs_scale = -1;     // fp32, fp8 only
  int64_t probs = -1;           // bf16 [num_draft], or e4m3 [num_draft] when probs_fp8
  bool probs_fp8 = false;
};

inline constexpr int32_t kTargetOutputsMaxTopK = 256;
inline constexpr int64_t kTargetOutputsMaxDraft = 65536;

// Device bytes of the index of a draft vocabulary of `num_draft` ids over
// `vocab` (about 4 * vocab + 8 * num_draft).
size_t DraftIndexBytes(int64_t vocab, int64_t num_draft);

// Builds into `index` (DraftIndexBytes, 16-byte aligned) what the op reads
// the draft columns through, from `draft` (device, `num_draft` distinct ids
// in [0, vocab), in the probs' column order; any order of ids). Ids outside
// [0, vocab) are skipped; a repeated id leaves one of its columns unwritten.
cudaError_t BuildDraftIndex(const int32_t* draft, int64_t num_draft, int64_t vocab, void* index,
                            cudaStream_t stream);

// For each token t < tokens: reads logits[t * logits_pitch + v], v < vocab
// (logits_pitch >= vocab, in elements), and writes its outputs at
// out + t * row_pitch + offsets.* (any pitch and offset: unaligned outputs
// are written bytewise). `draft_index` is BuildDraftIndex's for the same
// vocab and num_draft (null when num_draft is 0); top_k in [0, min(256,
// vocab)], num_draft in [0, 65536]. An output whose offset is -1 is neither
// computed nor written; top_k 0 or num_draft 0 likewise.
cudaError_t TargetOutputsFromLogits(const float* logits, int64_t tokens, int64_t vocab,
                                    int64_t logits_pitch, const void* draft_index,
                                    int64_t num_draft, int32_t top_k,
                                    const TargetOutputOffsets& offsets, uint8_t* out,
                                    int64_t row_pitch, cudaStream_t stream);

}  // namespace draftfeed::cuda
