#include "kernels/rope.cuh"

#include <algorithm>

#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

__global__ void PositionsKernel(const int32_t* cu_seqlens, int32_t num_seqs, int64_t num_tokens,
                                int32_t* positions) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= num_tokens) return;
  // The last sequence s with cu_seqlens[s] ≤ t holds t; taking the last one
  // steps over empty sequences that start at the same offset.
  int32_t lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (cu_seqlens[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  positions[t] = static_cast<int32_t>(t - cu_seqlens[lo]);
}

constexpr int kRopeThreads = 256;
// Bounds a block's (cos, sin) table: 4096 pairs, 32 KB of shared memory.
constexpr int kMaxTableEntries = 4096;

__device__ __forceinline__ void Rotate(float a, float b, float2 cs, float& ya, float& yb) {
  // Products rounded before the add (no FMA), as the reference does.
  ya = __fsub_rn(__fmul_rn(a, cs.x), __fmul_rn(b, cs.y));
  yb = __fadd_rn(__fmul_rn(b, cs.x), __fmul_rn(a, cs.y));
}

// A block rotates `tokens_per_block` tokens. It first builds their (cos, sin)
// table in shared memory, one sincos per (token, frequency) however many heads
// share it, then walks (token, head, kV dims) items: with kV = 8 each item is
// a 16-byte load from each half of the rotated slice.
template <int kV>
__global__ void __launch_bounds__(kRopeThreads)
    RopeKernel(bf16* x, int64_t num_tokens, int heads, int64_t token_stride, int64_t head_stride,
               int half, int tokens_per_block, const int32_t* positions, float theta) {
  extern __shared__ float smem[];
  float* inv_freq = smem;                                                  // [half]
  float2* table = reinterpret_cast<float2*>(smem + 2 * ((half + 1) / 2));  // [tokens][half]
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * tokens_per_block;
  const int tokens = static_cast<int>(std::min<int64_t>(tokens_per_block, num_tokens - t0));

  // inv_freq = 1 / θ^(2j/R) in fp32 as transformers (and the CPU reference)
  // form it: the exponent and the reciprocal are fp32 operations, and the
  // power is taken in double and rounded once, i.e. correctly rounded like
  // glibc's powf (equal for every j of θ ∈ {1e4..1e7}, R ∈ {32..256}). The
  // device powf's few ulps would move the angle by ~1e-3 rad at positions in
  // the tens of thousands.
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(2 * half);
    inv_freq[j] =
        1.0f / static_cast<float>(pow(static_cast<double>(theta), static_cast<double>(exponent)));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < tokens * half; i += blockDim.x) {
    const int tt = i / half;
    const float angle = static_cast<float>(positions[t0 + tt]) * inv_freq[i - tt * half];
    float s, c;
    sincosf(angle, &s, &c);
    table[i] = make_float2(c, s);
  }
  __syncthreads();

  const int vecs = half / kV;
  const int per_token = heads * vecs;
  for (int i = threadIdx.x; i < tokens * per_token; i += blockDim.x) {
    const int tt = i / per_token;
    const int h = (i - tt * per_token) / vecs;
    const int j = (i - tt * per_token - h * vecs) * kV;
    bf16* p = x + (t0 + tt) * token_stride + h * head_stride + j;
    const float2* cs = table + tt * half + j;
    if constexpr (kV == vec::kVec) {
      float a[kV], b[kV], ya[kV], yb[kV];
      vec::LoadBf16x8(p, a);
      vec::LoadBf16x8(p + half, b);
#pragma unroll
      for (int k = 0; k < kV; ++k) Rotate(a[k], b[k], cs[k], ya[k], yb[k]);
      vec::StoreBf16x8(p, ya);
      vec::StoreBf16x8(p + half, yb);
    } else {
      float ya, yb;
      Rotate(__bfloat162float(p[0]), __bfloat162float(p[half]), cs[0], ya, yb);
      p[0] = __float2bfloat16(ya);
      p[half] = __float2bfloat16(yb);
    }
  }
}

}  // namespace

cudaError_t PositionsFromCuSeqlens(const int32_t* cu_seqlens, int32_t num_seqs, int64_t num_tokens,
                                   int32_t* positions, cudaStream_t stream) {
  if (num_tokens < 0 || num_seqs < 0) return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  if (num_seqs == 0) return cudaErrorInvalidValue;
  constexpr int kThreads = 256;
  const int64_t blocks = (num_tokens + kThreads - 1) / kThreads;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  PositionsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(cu_seqlens, num_seqs,
                                                                          num_tokens, positions);
  return cudaGetLastError();
}

cudaError_t ApplyRope(bf16* x, int64_t num_tokens, int64_t heads, int64_t head_dim,
                      int64_t token_stride, int64_t head_stride, int64_t rotary_dim,
                      const int32_t* positions, float theta, cudaStream_t stream) {
  if (num_tokens < 0 || heads < 0 || heads > INT32_MAX || rotary_dim < 0 || rotary_dim % 2 != 0 ||
      rotary_dim > head_dim || rotary_dim / 2 > kMaxTableEntries) {
    return cudaErrorInvalidValue;
  }
  const int half = static_cast<int>(rotary_dim / 2);
  if (num_tokens == 0 || heads == 0 || half == 0) return cudaSuccess;
  // Both halves of every head's slice start 16-byte aligned: 16-byte items.
  const bool vectorised = half % vec::kVec == 0 && token_stride % vec::kVec == 0 &&
                          head_stride % vec::kVec == 0 && vec::Aligned16(x);
  const int kv = vectorised ? vec::kVec : 1;
  const int64_t per_token = heads * (half / kv);
  if (per_token > INT32_MAX / 2) return cudaErrorInvalidValue;  // int item indices
  // About two items per thread, within the table's bound.
  const int tokens_per_block = static_cast<int>(std::clamp<int64_t>(
      std::min<int64_t>(2 * kRopeThreads / per_token, kMaxTableEntries / half), 1, num_tokens));
  const int64_t blocks = (num_tokens + tokens_per_block - 1) / tokens_per_block;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * 2 * ((half + 1) / 2) +
                      sizeof(float2) * static_cast<size_t>(tokens_per_block) * half;
  const auto kernel = vectorised ? RopeKernel<vec::kVec> : RopeKernel<1>;
  kernel<<<static_cast<unsigned>(blocks), kRopeThreads, smem, stream>>>(
      x, num_tokens, static_cast<int>(heads), token_stride, head_stride, half, tokens_per_block,
      positions, theta);
  return cudaGetLastError();
}

}  // namespace draftfeed::cuda
