// Gated DeltaNet prefill over packed sequences: causal depthwise conv + SiLU,
// and the chunked gated delta rule (L2-normalised q/k, fp32 state).
#pragma once

#include "kernels/common.cuh"

namespace draftfeed::cuda {

// y[t, c] = SiLU(Σ_{i<K} w[c, i]·x[t − (K−1) + i, c]) with taps before the
// start of t's sequence reading 0. x rows are x_stride apart; y: [T, C]
// dense; w: [C, K] bf16. fp32 maths, one rounding.
//
// Chunked prefill: x_prefix, when not null, is [K−1, C] dense (16-byte
// aligned for the vector path), the conv inputs of the K−1 tokens before
// sequence 0's first token (row K−2 the one just before); sequence 0's taps
// before its start read it instead of 0. A sequence run in pieces, each
// piece with the K−1 inputs before it as x_prefix (zero rows where those
// precede the sequence), gives the one-pass bits.
cudaError_t CausalConv1dSilu(const bf16* x, int64_t x_stride, const bf16* w, int64_t num_tokens,
                             int64_t channels, int64_t kernel, const int32_t* cu_seqlens,
                             int32_t num_seqs, bf16* y, cudaStream_t stream,
                             const bf16* x_prefix = nullptr);

struct GdnArgs {
  // After the conv: per token, q [Nk, dk] | k [Nk, dk] | v [Nv, dv], rows
  // qkv_stride elements apart (the conv output, so 2·Nk·dk + Nv·dv).
  const bf16* qkv = nullptr;
  int64_t qkv_stride = 0;
  // Raw projections a, b: [T, Nv] with rows ab_stride apart.
  const bf16* a = nullptr;
  const bf16* b = nullptr;
  int64_t ab_stride = 0;
  const float* a_log = nullptr;    // [Nv] fp32
  const float* dt_bias = nullptr;  // [Nv] fp32
  int64_t num_tokens = 0;
  int64_t num_k_heads = 0;              // Nk
  int64_t num_v_heads = 0;              // Nv; value head j reads q/k head j / (Nv / Nk)
  int64_t key_dim = 0;                  // dk
  int64_t value_dim = 0;                // dv
  const int32_t* cu_seqlens = nullptr;  // device, [num_seqs + 1]
  int32_t num_seqs = 0;
  bf16* out = nullptr;  // [T, Nv, dv] dense
  // Chunked prefill: the recurrent state carried across calls, fp32
  // [Nv, dk, dv] dense: S[j][a][b] with a the key dim and b the value dim of
  // value head j, so that o = Sᵀq̂ (transformers' recurrent_state[b, h, dk, dv],
  // kernels/cpu/gdn.cc's state[a·dv + b]). initial_state: the state sequence
  // 0 starts from (null: zero). final_state: written with the state after the
  // last sequence's last token (null: not written; the initial state, or
  // zero, when that sequence is empty). They may be the same buffer only with
  // num_seqs == 1 (cudaErrorInvalidValue otherwise). Split at a multiple of 64
  // tokens (the chunk), a sequence gives the one-pass bits; split elsewhere,
  // its chunks fall elsewhere and outputs differ within the kernel's rounding.
  const float* initial_state = nullptr;
  float* final_state = nullptr;
};

// The full GDN core of a Qwen3.5 linear-attention layer, after its projections
// and conv: gates (β = sigmoid(b),
// g = −exp(A_log)·softplus(a + dt_bias)), q̂ = L2(q)·dk^−½, k̂ = L2(k), then the
// gated delta rule in chunks of 64 tokens per sequence, fp32 state zero at each
// sequence start (sequence 0: initial_state). `workspace` must hold
// GdnWorkspaceBytes(args) bytes.
size_t GdnWorkspaceBytes(const GdnArgs& args);
cudaError_t GatedDeltaRule(const GdnArgs& args, void* workspace, cudaStream_t stream);

// The scan GatedDeltaRule runs at (key_dim, value_dim) on the current device:
// wgmma (sm_90a code, key dim 128, value dims a multiple of 64, Hopper's own
// kernels allowed: kernels/kernel_paths.cuh) with three chunk buffers; else
// mma.sync with two (loads overlap the products), or one where two are more
// shared memory than the device has. Every path gives the same bits.
// cudaErrorInvalidValue for dims the kernels do not take.
struct GdnScanPath {
  bool wgmma = false;
  int stages = 0;
};
cudaError_t ChooseGdnScanPath(int64_t key_dim, int64_t value_dim, GdnScanPath* path);

}  // namespace draftfeed::cuda
