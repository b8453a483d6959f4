// CPU reference of a mixture-of-experts MLP (Qwen3-MoE / Qwen3.5-MoE): the
// router's softmax and top-k, then SwiGLU experts combined by routing weight.
// All fp32; the shared expert and its gate are the caller's (a dense SwiGLU).
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

// Per token: p = softmax(logits[t, :]) over all `experts` in fp32, then the
// top_k largest p sorted by descending probability, an exact tie going to the
// lower expert id (transformers leaves CUDA's tie order unspecified; this
// fixes one). With `renormalize` the k weights are divided by their sum, else
// they are the probabilities themselves. logits: [tokens, experts];
// expert_ids, weights: [tokens, top_k]. Requires 1 <= top_k <= experts.
void MoeRoute(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
              int32_t* expert_ids, float* weights);

// y[t] = Σ_j weights[t, j] · down_e · (SiLU(gate_e · x_t) ⊙ up_e · x_t), e =
// expert_ids[t, j], the terms added into y[t] = 0 in ascending expert id (as
// transformers' eager loop adds them; equal ids in slot order). x: [tokens,
// hidden]; gate_up: [E, 2*inter, hidden], per expert rows [0, inter) gate and
// [inter, 2*inter) up (out x in, transformers' fused layout); down: [E,
// hidden, inter]; y: [tokens, hidden], overwritten, must not alias x. Every
// id must lie in [0, E). Each y row depends only on its own token, whatever
// the batch or the thread count (num_threads <= 0: all cores), so packed and
// separate batches give identical bits.
void MoeExperts(const float* x, int64_t tokens, int64_t hidden, int64_t inter, const float* gate_up,
                const float* down, const int32_t* expert_ids, const float* weights, int64_t top_k,
                float* y, int num_threads = 0);

// MoeExperts over the experts [first_expert, first_expert + num_experts)
// only: one rank's of an expert-parallel group. gate_up and down hold just
// those experts (expert first_expert at index 0); slots routed to other
// experts are skipped, so y[t] is the sum of this range's terms in ascending
// expert id (0 for a token routed elsewhere). Ranges in ascending order
// summed in rank order give every term of MoeExperts, grouped by range.
void MoeExpertRange(const float* x, int64_t tokens, int64_t hidden, int64_t inter,
                    const float* gate_up, const float* down, int64_t first_expert,
                    int64_t num_experts, const int32_t* expert_ids, const float* weights,
                    int64_t top_k, float* y, int num_threads = 0);

}  // namespace draftfeed::cpu
