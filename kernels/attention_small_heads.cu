// The exact attention kernel of the small head dims (32, 64, 96: the
// test-sized models, e.g. the transformers goldens), which
// VarlenCausalAttention (attention.cu) hands them to.
#include <cmath>

#include "kernels/attention.cuh"

namespace draftfeed::cuda {
namespace {

// Small head dims (32, 64, 96: the test-sized models, e.g. the transformers
// goldens) take a simple exact kernel: one warp per (token, query head), lanes
// split the head dim, online softmax over the row's keys in fp32. Not tuned:
// real models use 128 or 256 above.
template <int HD>
__global__ void __launch_bounds__(128) SmallHeadAttentionKernel(AttentionArgs a) {
  constexpr int kPer = HD / 32;
  const int lane = threadIdx.x & 31;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5));
  if (row >= a.num_tokens * a.num_q_heads) return;
  const int64_t t = row / a.num_q_heads;
  const int64_t h = row % a.num_q_heads;
  const int64_t kvh = h / (a.num_q_heads / a.num_kv_heads);
  // The sequence holding t: the last s with cu[s] <= t.
  int lo = 0, hi = a.num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.cu_seqlens[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t start = a.cu_seqlens[lo];
  float q[kPer], o[kPer];
  const bf16* qp = a.q + t * a.q_stride + h * a.q_head_stride;
  for (int i = 0; i < kPer; ++i) {
    q[i] = __bfloat162float(qp[lane + 32 * i]) * a.scale;
    o[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  // Query t is position q_offset + t of its sequence; with q_offset > 0 the
  // one sequence starts at k/v row 0, so its keys are rows 0 .. q_offset + t.
  const int64_t last_key = t + a.q_offset;
  for (int64_t s = start; s <= last_key; ++s) {
    const bf16* kp = a.k + s * a.k_stride + kvh * a.head_dim;
    float dot = 0.f;
    for (int i = 0; i < kPer; ++i) dot += q[i] * __bfloat162float(kp[lane + 32 * i]);
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    const float m_new = fmaxf(m, dot);
    const float corr = __expf(m - m_new);
    const float p = __expf(dot - m_new);
    l = l * corr + p;
    const bf16* vp = a.v + s * a.v_stride + kvh * a.head_dim;
    for (int i = 0; i < kPer; ++i) o[i] = o[i] * corr + p * __bfloat162float(vp[lane + 32 * i]);
    m = m_new;
  }
  bf16* op = a.out + (t * a.num_q_heads + h) * a.head_dim;
  for (int i = 0; i < kPer; ++i) op[lane + 32 * i] = __float2bfloat16(o[i] / l);
}

template <int HD>
cudaError_t LaunchSmallHead(const AttentionArgs& a, cudaStream_t stream) {
  const int64_t rows = a.num_tokens * a.num_q_heads;
  SmallHeadAttentionKernel<HD><<<static_cast<unsigned>((rows + 3) / 4), 128, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t SmallHeadAttention(const AttentionArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 32:
      return LaunchSmallHead<32>(a, stream);
    case 64:
      return LaunchSmallHead<64>(a, stream);
    case 96:
      return LaunchSmallHead<96>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace draftfeed::cuda
