// Varlen causal GQA attention over packed sequences, flash-style (no T×T
// matrix in memory), head dim 128 or 256 on the tensor cores; 32, 64 and 96 (test-sized
// models) on a simple exact kernel.
#pragma once

#include "kernels/common.cuh"

namespace draftfeed::cuda {

struct AttentionArgs {
  // q: [T, Hq, hd] with token stride q_stride and head stride q_head_stride
  // (so it can be read in place from the interleaved query|gate projection);
  // k, v: [T_kv, Hkv, hd] with token strides k_stride / v_stride, heads dense
  // (T_kv = T unless q_offset says otherwise).
  const bf16* q = nullptr;
  int64_t q_stride = 0;
  int64_t q_head_stride = 0;
  const bf16* k = nullptr;
  int64_t k_stride = 0;
  const bf16* v = nullptr;
  int64_t v_stride = 0;
  int64_t num_tokens = 0;
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;             // query head h reads KV head h / (Hq / Hkv)
  int64_t head_dim = 0;                 // 32, 64, 96, 128 or 256
  const int32_t* cu_seqlens = nullptr;  // device, [num_seqs + 1]
  int32_t num_seqs = 0;
  int32_t max_seqlen = 0;
  float scale = 0;
  bf16* out = nullptr;  // [T, Hq, hd] dense
  // Chunked prefill: one sequence continued past a prefix already run.
  // With q_offset = P > 0 (num_seqs must be 1, cu_seqlens {0, T}) the T
  // queries are positions P .. P+T−1 of one sequence whose keys and values
  // are rows [0, P + T) of k and v, and query i attends keys 0 .. P+i.
  // num_kv_tokens is the row count of k and v: 0 means T, and it must equal
  // P + T; P < 0, P > 0 with num_seqs ≠ 1, or another count is
  // cudaErrorInvalidValue. max_seqlen bounds T (the queries). Any P works;
  // each output row is the bits a one-pass call over all P + T tokens gives
  // that row when P is a multiple of the query tile (AttentionPath::q_tile;
  // any P on the small-head kernel), else equal within bf16 rounding.
  int64_t num_kv_tokens = 0;
  int32_t q_offset = 0;
};

// Block-diagonal causal softmax(q·kᵀ·scale)·v, fp32 softmax and accumulation.
// max_seqlen must bound every sequence's length. q, k, v and out must be
// 16-byte aligned and their strides multiples of 8 elements (cudaErrorInvalidValue
// otherwise).
cudaError_t VarlenCausalAttention(const AttentionArgs& args, cudaStream_t stream);

// The tensor-core kernel VarlenCausalAttention runs at head dim 128 or 256 on
// the current device (kernels/kernel_paths.cuh says how it is chosen).
struct AttentionPath {
  bool wgmma = false;  // else mma.sync
  int kv_tile = 0;     // keys per KV tile
  int smem_bytes = 0;  // dynamic shared memory a block
  int q_tile = 0;      // queries per block: 128 (wgmma) or 64 (mma.sync)
};
// cudaErrorInvalidValue for another head dim; cudaErrorNoKernelImageForDevice
// on a GPU that the built architectures do not cover.
cudaError_t ChooseAttentionPath(int64_t head_dim, AttentionPath* path);

// Head dims 32, 64 and 96 (attention_small_heads.cu): one warp per (token,
// query head), lanes split the head dim, an online softmax over the row's
// keys in fp32; exact and untuned. VarlenCausalAttention calls it after
// checking the arguments; cudaErrorInvalidValue for another head dim.
cudaError_t SmallHeadAttention(const AttentionArgs& a, cudaStream_t stream);

}  // namespace draftfeed::cuda
