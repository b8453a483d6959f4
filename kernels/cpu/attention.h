// CPU reference attention: varlen causal GQA over packed sequences, with an
// optional K/V prefix per sequence (chunked prefill).
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

// Sequence s: queries rows [cu_q[s], cu_q[s+1]) of q/out, keys/values rows
// [cu_k[s], cu_k[s+1]) of k/v, kv_len_s >= q_len_s; query i of s sits at
// position (kv_len_s - q_len_s) + i and attends keys 0..that position of its
// sequence. q, out: [rows, num_q_heads, head_dim]; k, v: [rows, num_kv_heads,
// head_dim], all dense. Query head h reads KV head h / (num_q_heads /
// num_kv_heads). scores = (q·k)·scale, softmax in fp32 (online, over key
// blocks fixed relative to the sequence start), out = Σ p·v / Σ p. Memory is
// O(block) per thread, never T×T. Work is spread over up to num_threads
// threads (<= 0: all cores).
//
// A row's arithmetic depends only on its query, its position and its
// sequence's keys 0..position: never on the batch around it, the thread count
// or how the sequence's queries are split across calls. So packed and alone
// give identical bits, and the last n queries over a P-key prefix (kv_len =
// P + n) give the bits of the same rows of the one-pass call, for any P. (The
// bits do depend on the CPU: the kernel runs the widest of its x86-64-v4,
// -v3 and baseline paths the CPU has, and v3/v4 fuse multiply-adds.)
//
// Aborts, naming the sequence, if kv_len_s < q_len_s or q_len_s < 0, or if
// num_kv_heads does not divide num_q_heads.
void VarlenCausalAttention(const float* q, const float* k, const float* v, const int32_t* cu_q,
                           const int32_t* cu_k, int64_t num_seqs, int64_t num_q_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale, float* out,
                           int num_threads);

// Block-diagonal causal attention without a prefix: the call above with
// cu_k = cu_q = cu_seqlens (token t of sequence s attends cu_seqlens[s] ≤ u ≤ t).
void VarlenCausalAttention(const float* q, const float* k, const float* v,
                           const int32_t* cu_seqlens, int64_t num_seqs, int64_t num_q_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale, float* out,
                           int num_threads);

// Tests pin the instruction set so each path is checked where it can run: 0
// chooses by CPU (the default), 1 the baseline (SSE2), 2 x86-64-v3 (AVX2), 3
// x86-64-v4 (AVX-512). False where the path cannot run here. Every path gives
// the same bits (no contraction; lanes are rows).
bool UseAttentionPathForTesting(int path);

}  // namespace draftfeed::cpu
