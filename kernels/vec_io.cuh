// Device-side helpers shared by the memory-bound op families (embedding,
// rmsnorm, elementwise): 16-byte loads and stores of 8 elements widened to
// fp32, and a rows × columns launcher. Internal to kernels/; no launchers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"

namespace draftfeed::cuda::vec {

// Elements per 16-byte bf16 vector; fp32 rows move the same 8 elements as two
// float4 so that one index walks both dtypes.
inline constexpr int kVec = 8;

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Keeps the raw bits so a caller can hold a prefetched vector cheaply.
__device__ __forceinline__ uint4 LoadRaw16(const void* p) {
  return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ void UnpackBf16x8(const uint4& raw, float (&v)[kVec]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec / 2; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    v[2 * k] = f.x;
    v[2 * k + 1] = f.y;
  }
}

__device__ __forceinline__ void LoadBf16x8(const bf16* p, float (&v)[kVec]) {
  UnpackBf16x8(LoadRaw16(p), v);
}

__device__ __forceinline__ void StoreBf16x8(bf16* p, const float (&v)[kVec]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec / 2; ++k) h[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ void LoadF32x8(const float* p, float (&v)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ void StoreF32x8(float* p, const float (&v)[kVec]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// SiLU(x) = x / (1 + e^−x), the same expression as the CPU references; finite
// for every x (e^−x = inf only where the quotient is −0 anyway).
__device__ __forceinline__ float Silu(float x) { return x / (1.0f + expf(-x)); }

// o / (1 + e^−g) = o·sigmoid(g) with a single rounding of the quotient (the
// gated attention's output gate).
__device__ __forceinline__ float Gate(float o, float g) { return o / (1.0f + expf(-g)); }

// Calls f(row, col) for every row < rows and col < cols: columns across
// threads (so a warp reads consecutive vectors of one row), rows across
// gridDim.y with a stride loop (gridDim.y is capped at 65535).
template <class F>
__global__ void __launch_bounds__(256) RowsKernel(F f, int64_t rows, int64_t cols) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) f(row, col);
}

template <class F>
cudaError_t LaunchRows(const F& f, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  // A row of a few vectors gets a one-warp block rather than a mostly idle 256.
  const int threads = static_cast<int>(std::min<int64_t>(256, (cols + 31) / 32 * 32));
  const int64_t col_blocks = (cols + threads - 1) / threads;
  if (col_blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(col_blocks),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  RowsKernel<<<grid, threads, 0, stream>>>(f, rows, cols);
  return cudaGetLastError();
}

}  // namespace draftfeed::cuda::vec
