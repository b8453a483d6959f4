// CPU reference of the Gated DeltaNet (Qwen3.5 linear attention) pieces:
// causal depthwise conv, L2 norm, gates and the gated delta rule, all fp32,
// over packed sequences given by cu_seqlens (num_seqs + 1 offsets from 0).
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

// y[t, c] = SiLU(Σ_{i<kernel} w[c, i]·x[t − (kernel−1) + i, c]): tap kernel−1
// is the current token, and taps before the start of t's sequence read 0,
// but sequence 0's read `x_prefix` when given: [kernel − 1, channels], the
// inputs of the kernel − 1 tokens before it (chunked prefill's carried tail).
// x, y: [T, channels] dense (y must not alias x); w: [channels, kernel].
void CausalConv1dSilu(const float* x, const float* w, const int32_t* cu_seqlens, int64_t num_seqs,
                      int64_t channels, int64_t kernel, float* y,
                      const float* x_prefix = nullptr);

// In place, per head: x ← (x / sqrt(Σx² + eps))·scale, over
// [num_tokens, num_heads, head_dim] with consecutive tokens token_stride
// elements apart (heads dense inside a token). The GDN uses eps = 1e-6, and
// scale = head_dim^−½ for q, 1 for k.
void L2NormHeads(float* x, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                 int64_t token_stride, float eps, float scale);

// Per token and value head j, from the projections a, b [T, num_heads]:
//   beta = sigmoid(b),  g = −exp(a_log[j])·softplus(a + dt_bias[j]),
// with softplus(x) = x for x > 20 as in PyTorch. g, beta: [T, num_heads].
void GdnGates(const float* a, const float* b, const float* a_log, const float* dt_bias,
              int64_t num_tokens, int64_t num_heads, float* g, float* beta);

// Operands of the gated delta rule. q, k: [T, num_k_heads, key_dim] and v:
// [T, num_v_heads, value_dim], each with its own token stride (so they can
// be read in place from the conv output); q already L2-normed and scaled, k
// L2-normed. g (log-decay) and beta: [T, num_v_heads]. o: [T, num_v_heads,
// value_dim] dense. Value head j reads q/k head j / (num_v_heads / num_k_heads).
struct DeltaRuleArgs {
  const float* q = nullptr;
  int64_t q_stride = 0;
  const float* k = nullptr;
  int64_t k_stride = 0;
  const float* v = nullptr;
  int64_t v_stride = 0;
  const float* g = nullptr;
  const float* beta = nullptr;
  float* o = nullptr;
  const int32_t* cu_seqlens = nullptr;
  int64_t num_seqs = 0;
  int64_t num_k_heads = 0;
  int64_t num_v_heads = 0;
  int64_t key_dim = 0;
  int64_t value_dim = 0;
  // Chunked prefill carries one sequence's state between calls. State layout:
  // [num_v_heads, key_dim, value_dim], S[j][i][d] with o = Sᵀq (transformers'
  // recurrent_state[b, j, i, d]). `initial_state`: where sequence 0 starts
  // (null: zero); `final_state`: written with the state after the last
  // sequence's last token (null: not written). A call with one sequence may
  // pass the same buffer as both.
  const float* initial_state = nullptr;
  float* final_state = nullptr;
};

// Token-by-token recurrence with state S [key_dim, value_dim], zero at every
// sequence start (but sequence 0's, from initial_state when given):  S ← e^g·S;  S ← S + k·(β(v − Sᵀk))ᵀ;  o = Sᵀq.
// Parallel over (sequence, value head) on up to num_threads threads.
void GatedDeltaRuleRecurrent(const DeltaRuleArgs& args, int num_threads);

// The same maths in chunks of chunk_size tokens (the prefill form of
// transformers' torch_chunk_gated_delta_rule, WY/UT transform per chunk).
// Chunks start at every sequence's first token; a sequence's last chunk is
// just shorter, which equals zero-padding it. Decays are only ever formed as
// exp(γ_r − γ_s) with s ≤ r, so long chunks of strong decay cannot overflow.
void GatedDeltaRuleChunked(const DeltaRuleArgs& args, int64_t chunk_size, int num_threads);

}  // namespace draftfeed::cpu
