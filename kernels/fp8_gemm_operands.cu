#include <cuda_fp8.h>

#include <algorithm>

#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

// Sixteen lanes per (token, 128-group), 8 values (one 16-byte load) a lane:
// the group's amax by shuffles within the half warp, then one 8-byte store a
// lane, so a warp reads and writes two whole groups per step. Each thread
// walks several groups (grid-stride) to keep enough loads in flight.
constexpr int kLanesPerGroup = 16;
constexpr int kThreads = 256;

__device__ __forceinline__ uint8_t ToE4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The max over the 16 lanes of a half warp (both halves reduce at once).
__device__ __forceinline__ float HalfWarpMax(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Quantizes the lane's 8 values of one group and writes them and the scale.
__device__ __forceinline__ void QuantizeGroup(const float (&v)[vec::kVec], int sub,
                                              uint8_t* group_out, float* scale_out, bool live,
                                              bool in_range) {
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < vec::kVec; ++j) amax = fmaxf(amax, fabsf(v[j]));
  amax = HalfWarpMax(amax);
  const float s = live ? fmaxf(amax, kFp8MinAmax) / kFp8Max : 0.0f;
  uint2 packed = {0, 0};
  if (live) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      packed.x |= static_cast<uint32_t>(ToE4m3(__fdiv_rn(v[j], s))) << (8 * j);
      packed.y |= static_cast<uint32_t>(ToE4m3(__fdiv_rn(v[4 + j], s))) << (8 * j);
    }
  }
  if (!in_range) return;
  reinterpret_cast<uint2*>(group_out)[sub] = packed;
  if (sub == 0) *scale_out = s;
}

// Calls body(row, group, sub, in_range) for every group of every row <
// m_pad, a half warp a group, two groups a warp per step. The loop runs over
// warp-uniform pairs so both halves take the same steps and every shuffle
// has all 32 lanes; a half past the end (odd group count) computes on row 0
// and stores nothing.
template <typename Body>
__device__ __forceinline__ void ForEachGroup(int64_t m_pad, int64_t groups, Body&& body) {
  const int64_t items = m_pad * groups;
  const int64_t pairs = (items + 1) / 2;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int half = (threadIdx.x & 31) / kLanesPerGroup;
  const int sub = threadIdx.x % kLanesPerGroup;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; p < pairs;
       p += warps) {
    const int64_t item = 2 * p + half;
    const bool in_range = item < items;
    const int64_t it = in_range ? item : 0;
    body(it / groups, it % groups, sub, in_range);
  }
}

__global__ void QuantizeActivationsKernel(const bf16* __restrict__ x, int64_t ldx, int64_t m,
                                          int64_t m_pad, int64_t k, uint8_t* __restrict__ xq,
                                          float* __restrict__ x_scale) {
  const int64_t groups = k / kFp8Block;
  ForEachGroup(m_pad, groups, [&](int64_t row, int64_t g, int sub, bool in_range) {
    const bool live = row < m;
    float v[vec::kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (live) vec::LoadBf16x8(x + row * ldx + g * kFp8Block + sub * vec::kVec, v);
    QuantizeGroup(v, sub, xq + row * k + g * kFp8Block, x_scale + g * m_pad + row, live, in_range);
  });
}

__global__ void SwiGluQuantizeKernel(const bf16* __restrict__ gate_up, int64_t m, int64_t m_pad,
                                     int64_t f, uint8_t* __restrict__ xq,
                                     float* __restrict__ x_scale) {
  const int64_t groups = f / kFp8Block;
  ForEachGroup(m_pad, groups, [&](int64_t row, int64_t g, int sub, bool in_range) {
    const bool live = row < m;
    float v[vec::kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (live) {
      const bf16* gp = gate_up + row * 2 * f + g * kFp8Block + sub * vec::kVec;
      float gv[vec::kVec], uv[vec::kVec];
      vec::LoadBf16x8(gp, gv);
      vec::LoadBf16x8(gp + f, uv);
#pragma unroll
      for (int j = 0; j < vec::kVec; ++j) {
        // SwiGlu's value, rounded to bf16 as the unfused path stores it.
        v[j] = __bfloat162float(__float2bfloat16(vec::Silu(gv[j]) * uv[j]));
      }
    }
    QuantizeGroup(v, sub, xq + row * f + g * kFp8Block, x_scale + g * m_pad + row, live, in_range);
  });
}

// One 256-thread block per 128x128 weight block (partial at the edges).
__global__ void QuantizeWeightBlocksKernel(const bf16* __restrict__ w, int64_t n, int64_t k,
                                           uint8_t* __restrict__ wq, float* __restrict__ w_scale,
                                           int64_t scale_stride) {
  const int64_t nb = blockIdx.y, kb = blockIdx.x;
  const int64_t r0 = nb * kFp8Block, c0 = kb * kFp8Block;
  const int64_t rows = min(kFp8Block, n - r0), cols = min(kFp8Block, k - c0);
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < rows * cols; i += blockDim.x) {
    amax = fmaxf(amax, fabsf(__bfloat162float(w[(r0 + i / cols) * k + c0 + i % cols])));
  }
  __shared__ float warp_max[8];
  amax = WarpMax(amax);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, warp_max[i]);
  const float s = amax > 0.0f ? amax / kFp8Max : 1.0f;
  for (int64_t i = threadIdx.x; i < rows * cols; i += blockDim.x) {
    const int64_t at = (r0 + i / cols) * k + c0 + i % cols;
    wq[at] = ToE4m3(__fdiv_rn(__bfloat162float(w[at]), s));
  }
  if (threadIdx.x == 0) w_scale[nb * scale_stride + kb] = s;
}

__global__ void DequantizeWeightBlocksKernel(const uint8_t* __restrict__ wq,
                                             const float* __restrict__ scale, int64_t scale_stride,
                                             int64_t n, int64_t k, bf16* __restrict__ w) {
  const int64_t total = n * k;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / k, c = i % k;
    __nv_fp8_e4m3 q;
    q.__x = wq[i];
    w[i] = __float2bfloat16(static_cast<float>(q) *
                            scale[(r / kFp8Block) * scale_stride + c / kFp8Block]);
  }
}

// Enough blocks to fill the GPU many times over; each warp then walks its
// share of the group pairs.
unsigned GroupBlocks(int64_t m_pad, int64_t k) {
  const int64_t pairs = (m_pad * (k / kFp8Block) + 1) / 2;
  const int64_t blocks = (pairs + kThreads / 32 - 1) / (kThreads / 32);
  return static_cast<unsigned>(std::min<int64_t>(blocks, 132 * 16));
}

}  // namespace

cudaError_t QuantizeActivationsFp8(const bf16* x, int64_t ldx, int64_t m, int64_t k, uint8_t* xq,
                                   float* x_scale, cudaStream_t stream) {
  if (m < 0 || k <= 0 || k % kFp8Block != 0 || ldx < k) return cudaErrorInvalidValue;
  const int64_t m_pad = Fp8RowsPadded(m);
  if (m_pad == 0) return cudaSuccess;
  QuantizeActivationsKernel<<<GroupBlocks(m_pad, k), kThreads, 0, stream>>>(x, ldx, m, m_pad, k, xq,
                                                                            x_scale);
  return cudaGetLastError();
}

cudaError_t SwiGluQuantizeFp8(const bf16* gate_up, int64_t m, int64_t ffn_dim, uint8_t* xq,
                              float* x_scale, cudaStream_t stream) {
  if (m < 0 || ffn_dim <= 0 || ffn_dim % kFp8Block != 0) return cudaErrorInvalidValue;
  const int64_t m_pad = Fp8RowsPadded(m);
  if (m_pad == 0) return cudaSuccess;
  SwiGluQuantizeKernel<<<GroupBlocks(m_pad, ffn_dim), kThreads, 0, stream>>>(gate_up, m, m_pad,
                                                                             ffn_dim, xq, x_scale);
  return cudaGetLastError();
}

cudaError_t QuantizeWeightBlocksFp8(const bf16* w, int64_t n, int64_t k, uint8_t* wq,
                                    float* w_scale, int64_t scale_stride, cudaStream_t stream) {
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block, nb = (n + kFp8Block - 1) / kFp8Block;
  if (n <= 0 || k <= 0 || scale_stride < kb || nb > 65535) return cudaErrorInvalidValue;
  QuantizeWeightBlocksKernel<<<dim3(static_cast<unsigned>(kb), static_cast<unsigned>(nb)), 256, 0,
                               stream>>>(w, n, k, wq, w_scale, scale_stride);
  return cudaGetLastError();
}

cudaError_t DequantizeWeightBlocksFp8(const uint8_t* wq, const float* scale, int64_t scale_stride,
                                      int64_t n, int64_t k, bf16* w, cudaStream_t stream) {
  if (n <= 0 || k <= 0) return cudaErrorInvalidValue;
  const int64_t total = n * k;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 1 << 16));
  DequantizeWeightBlocksKernel<<<blocks, 256, 0, stream>>>(wq, scale, scale_stride, n, k, w);
  return cudaGetLastError();
}

}  // namespace draftfeed::cuda
