// CPU reference of the target outputs taken from a token's full-vocabulary
// logits: the argmax, the top-k with log_softmax values, and the softmax
// restricted to a draft vocabulary (EAGLE-3's target distribution), in fp32.
// The wire encodings (bf16, or e4m3 with a per-token scale) are the caller's;
// the CUDA op (kernels/target_outputs.cuh) follows the same definitions:
//   - argmax and top-k: larger logit first, ties to the lower id;
//   - logprob(i) = l_i - (m + log Σ_v exp(l_v - m)), m = max_v l_v;
//   - draft probs: p_j = exp(l_{d_j} - md) / Σ_j exp(l_{d_j} - md), md the
//     largest draft-column logit.
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

// logits: [tokens, vocab] fp32. draft: `num_draft` target ids, each < vocab
// (the probs' columns, in that order). Each output may be null (not asked):
// argmax [tokens]; top_ids, top_logprobs [tokens, top_k]; probs [tokens,
// num_draft]. Threads split the tokens; results do not depend on their number.
void TargetOutputsFromLogits(const float* logits, int64_t tokens, int64_t vocab,
                             const int32_t* draft, int64_t num_draft, int32_t top_k,
                             int32_t* argmax, int32_t* top_ids, float* top_logprobs, float* probs,
                             int threads);

}  // namespace draftfeed::cpu
