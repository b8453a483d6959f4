#include "kernels/rank_sum.cuh"

#include <algorithm>

namespace draftfeed::cuda {
namespace {

struct RankBuffers {
  void* p[kMaxRankSumRanks];
};

template <typename T>
__device__ float Load(const void* p, int64_t i) {
  if constexpr (sizeof(T) == 2) {
    return __bfloat162float(static_cast<const bf16*>(p)[i]);
  } else {
    return static_cast<const float*>(p)[i];
  }
}

template <typename T>
__global__ void SumRanksKernel(RankBuffers b, int ranks, int64_t begin, int64_t end) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < end;
       i += stride) {
    float s = Load<T>(b.p[0], i);
    for (int r = 1; r < ranks; ++r) s += Load<T>(b.p[r], i);
    for (int r = 0; r < ranks; ++r) {
      if constexpr (sizeof(T) == 2) {
        static_cast<bf16*>(b.p[r])[i] = __float2bfloat16(s);
      } else {
        static_cast<float*>(b.p[r])[i] = s;
      }
    }
  }
}

__global__ void AddF32Kernel(float* residual, const float* delta, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    residual[i] += delta[i];
  }
}

unsigned GridFor(int64_t n) {
  constexpr int64_t kMaxBlocks = 4096;  // grid-stride beyond: enough to fill any GPU
  return static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (n + 255) / 256));
}

}  // namespace

cudaError_t SumRanks(void* const* buffers, int ranks, bool bf16_elements, int64_t begin,
                     int64_t end, cudaStream_t stream) {
  if (ranks < 1 || ranks > kMaxRankSumRanks || begin < 0 || end < begin) {
    return cudaErrorInvalidValue;
  }
  if (end == begin) return cudaSuccess;
  RankBuffers b{};
  for (int r = 0; r < ranks; ++r) b.p[r] = buffers[r];
  const unsigned grid = GridFor(end - begin);
  if (bf16_elements) {
    SumRanksKernel<bf16><<<grid, 256, 0, stream>>>(b, ranks, begin, end);
  } else {
    SumRanksKernel<float><<<grid, 256, 0, stream>>>(b, ranks, begin, end);
  }
  return cudaGetLastError();
}

cudaError_t AddF32(float* residual, const float* delta, int64_t n, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  AddF32Kernel<<<GridFor(n), 256, 0, stream>>>(residual, delta, n);
  return cudaGetLastError();
}

}  // namespace draftfeed::cuda
