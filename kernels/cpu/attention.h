// CPU reference attention: varlen causal GQA over packed sequences.
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

// Block-diagonal causal attention: token t of sequence s attends tokens
// cu_seqlens[s] ≤ u ≤ t only. q, out: [T, num_q_heads, head_dim]; k, v:
// [T, num_kv_heads, head_dim], all dense. Query head h reads KV head
// h / (num_q_heads / num_kv_heads). scores = (q·k)·scale, softmax in fp32
// with the row max subtracted, out = Σ p·v. Memory is O(longest sequence)
// per thread, never T×T. Rows are spread over up to num_threads threads
// (<= 0: all cores); each row's arithmetic is independent of the others, so
// packed and separate batches give identical bits.
void VarlenCausalAttention(const float* q, const float* k, const float* v,
                           const int32_t* cu_seqlens, int64_t num_seqs, int64_t num_q_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale, float* out,
                           int num_threads);

}  // namespace draftfeed::cpu
