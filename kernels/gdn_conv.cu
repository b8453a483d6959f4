// Gated DeltaNet's first stage (declared in gdn.cuh): the causal depthwise
// conv over [q | k | v] channels, then SiLU, per packed sequence.
#include "kernels/gdn.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

constexpr int kConvThreads = 128;
constexpr int kConvTokens = 32;  // consecutive tokens per thread, sliding window in registers

template <int kVec>
struct BfVec {
  float v[kVec];
  __device__ __forceinline__ void Load(const bf16* p) {
    if constexpr (kVec == vec::kVec) {
      vec::LoadBf16x8(p, v);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) v[i] = __bfloat162float(p[i]);
    }
  }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = 0.0f;
  }
};

// Block = (kConvTokens tokens, kConvThreads·kVec channels). Each thread owns
// kVec consecutive channels over the block's tokens, keeping the last
// kTaps − 1 inputs in registers; a sequence start inside the tile clears them.
// Sequence 0's window starts from x_prefix ([kTaps − 1, channels]) where given.
template <int kTaps, int kVec>
__global__ void __launch_bounds__(kConvThreads)
    CausalConvSiluKernel(const bf16* __restrict__ x, int64_t x_stride, const bf16* __restrict__ w,
                         int64_t num_tokens, int64_t channels, const int32_t* __restrict__ cu,
                         int32_t num_seqs, const bf16* __restrict__ x_prefix,
                         bf16* __restrict__ y) {
  const int64_t c0 = (static_cast<int64_t>(blockIdx.y) * kConvThreads + threadIdx.x) * kVec;
  if (c0 >= channels) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kConvTokens;
  const int64_t t1 = min(num_tokens, t0 + kConvTokens);

  // The thread's weights are kVec·kTaps contiguous bf16: 16-byte loads on the
  // vector path.
  float wt[kTaps][kVec];
  if constexpr (kVec == 8) {
    const uint4* wv = reinterpret_cast<const uint4*>(w + c0 * kTaps);
#pragma unroll
    for (int j = 0; j < kTaps; ++j) {
      float f[vec::kVec];
      vec::UnpackBf16x8(vec::LoadRaw16(wv + j), f);  // one 16-byte load
#pragma unroll
      for (int h = 0; h < vec::kVec; ++h) {
        const int e = 8 * j + h;  // element e is channel e / kTaps, tap e % kTaps
        wt[e % kTaps][e / kTaps] = f[h];
      }
    }
  } else {
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
#pragma unroll
      for (int i = 0; i < kTaps; ++i) wt[i][v] = __bfloat162float(w[(c0 + v) * kTaps + i]);
    }
  }
  // Sequence of t0: the last s with cu[s] <= t0 (cu[num_seqs] = T > t0).
  int lo = 0, hi = num_seqs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (cu[mid] <= t0)
      lo = mid;
    else
      hi = mid;
  }
  int seq = lo;
  int64_t seq_begin = cu[seq], seq_end = cu[seq + 1];

  BfVec<kVec> win[kTaps > 1 ? kTaps - 1 : 1];  // win[i] = x[t − (kTaps−1) + i]
#pragma unroll
  for (int i = 0; i < kTaps - 1; ++i) {
    const int64_t src = t0 - (kTaps - 1) + i;
    if (src >= seq_begin) {
      win[i].Load(x + src * x_stride + c0);
    } else if (seq == 0 && x_prefix != nullptr) {
      // Only the tile holding sequence 0's first tokens gets here; prefix
      // row kTaps−1 + (src − seq_begin) is input src.
      win[i].Load(x_prefix + (kTaps - 1 + (src - seq_begin)) * channels + c0);
    } else {
      win[i].Zero();
    }
  }
  // Four tokens' loads in flight before their use.
  constexpr int kGroup = 4;
#pragma unroll 1
  for (int64_t tg = t0; tg < t1; tg += kGroup) {
    BfVec<kVec> cur[kGroup];
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      if (tg + u < t1) cur[u].Load(x + (tg + u) * x_stride + c0);
    }
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const int64_t t = tg + u;
      if (t >= t1) break;
      if (t >= seq_end) {  // a new sequence starts at t: earlier inputs read 0
        while (cu[seq + 1] <= t) ++seq;
        seq_begin = cu[seq];
        seq_end = cu[seq + 1];
#pragma unroll
        for (int i = 0; i < kTaps - 1; ++i) win[i].Zero();
      }
      float acc[kVec];
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < kTaps - 1; ++i) a += wt[i][v] * win[i].v[v];
        acc[v] = vec::Silu(a + wt[kTaps - 1][v] * cur[u].v[v]);
      }
      bf16* yt = y + t * channels + c0;
      if constexpr (kVec == 8) {
        vec::StoreBf16x8(yt, acc);
      } else {
#pragma unroll
        for (int v = 0; v < kVec; ++v) yt[v] = __float2bfloat16(acc[v]);
      }
#pragma unroll
      for (int i = 0; i + 1 < kTaps - 1; ++i) win[i] = win[i + 1];
      if constexpr (kTaps > 1) win[kTaps - 2] = cur[u];
    }
  }
}

template <int kTaps>
cudaError_t LaunchConv(const bf16* x, int64_t x_stride, const bf16* w, int64_t num_tokens,
                       int64_t channels, const int32_t* cu, int32_t num_seqs, const bf16* x_prefix,
                       bf16* y, cudaStream_t stream) {
  const bool vec =
      channels % 8 == 0 && x_stride % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(y) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(x_prefix) % 16 == 0;
  const int per_block = kConvThreads * (vec ? 8 : 1);
  const dim3 grid(static_cast<unsigned>((num_tokens + kConvTokens - 1) / kConvTokens),
                  static_cast<unsigned>((channels + per_block - 1) / per_block));
  if (vec) {
    CausalConvSiluKernel<kTaps, 8><<<grid, kConvThreads, 0, stream>>>(
        x, x_stride, w, num_tokens, channels, cu, num_seqs, x_prefix, y);
  } else {
    CausalConvSiluKernel<kTaps, 1><<<grid, kConvThreads, 0, stream>>>(
        x, x_stride, w, num_tokens, channels, cu, num_seqs, x_prefix, y);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t CausalConv1dSilu(const bf16* x, int64_t x_stride, const bf16* w, int64_t num_tokens,
                             int64_t channels, int64_t kernel, const int32_t* cu_seqlens,
                             int32_t num_seqs, bf16* y, cudaStream_t stream, const bf16* x_prefix) {
  if (num_tokens < 0 || channels <= 0 || num_seqs <= 0 || x_stride < channels) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;
  // One instantiation per kernel width (the taps live in registers).
  using Launcher = cudaError_t (*)(const bf16*, int64_t, const bf16*, int64_t, int64_t,
                                   const int32_t*, int32_t, const bf16*, bf16*, cudaStream_t);
  static constexpr Launcher kByTaps[] = {LaunchConv<1>, LaunchConv<2>, LaunchConv<3>,
                                         LaunchConv<4>, LaunchConv<5>, LaunchConv<6>,
                                         LaunchConv<7>, LaunchConv<8>};
  if (kernel < 1 || kernel > 8) return cudaErrorInvalidValue;
  return kByTaps[kernel - 1](x, x_stride, w, num_tokens, channels, cu_seqlens, num_seqs, x_prefix,
                             y, stream);
}

}  // namespace draftfeed::cuda
