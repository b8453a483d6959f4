#include "kernels/random_init.cuh"

namespace draftfeed::cuda {
namespace {

// splitmix64 finaliser: a good 64-bit mix of the counter.
__device__ __forceinline__ uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// 24 random bits of (seed, i) -> [0, 1).
__device__ __forceinline__ float Unit(uint64_t seed, int64_t i) {
  const uint64_t h = Mix(seed ^ Mix(static_cast<uint64_t>(i)));
  return static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
}

// [0, 1) to [−√3, √3): unit variance.
__device__ __forceinline__ float Uniform(uint64_t seed, int64_t i) {
  return (Unit(seed, i) * 2.0f - 1.0f) * 1.7320508f;
}

// kLogUniform: p[i] = log(a + b·u); otherwise p[i] = b + a·Uniform (a = scale, b = offset).
template <typename T, bool kLogUniform>
__global__ void FillKernel(T* p, int64_t n, uint64_t seed, float a, float b) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v;
    if constexpr (kLogUniform) {
      v = logf(a + b * Unit(seed, i));
    } else {
      v = b + a * Uniform(seed, i);
    }
    if constexpr (sizeof(T) == 2) {
      p[i] = __float2bfloat16(v);
    } else {
      p[i] = v;
    }
  }
}

// N(0, 1) of (seed, row) by Box-Muller from two hashes of a separate stream;
// u1 is kept off 0 so the log is finite.
__device__ __forceinline__ float RowNormal(uint64_t seed, int64_t row) {
  const uint64_t s = Mix(seed ^ 0x5DEECE66DULL);
  const float u1 = Unit(s, 2 * row) + 0.5f / 16777216.0f;
  const float u2 = Unit(s, 2 * row + 1);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

__global__ void FillRowScaledKernel(bf16* p, int64_t n, int64_t cols, uint64_t seed, float scale,
                                    float offset, float row_log_sigma) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float row_scale = scale * expf(row_log_sigma * RowNormal(seed, i / cols));
    p[i] = __float2bfloat16(offset + row_scale * Uniform(seed, i));
  }
}

template <typename T, bool kLogUniform = false>
cudaError_t Fill(T* p, int64_t n, uint64_t seed, float a, float b, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 132 * 32);
  FillKernel<T, kLogUniform>
      <<<static_cast<unsigned>(blocks), threads, 0, stream>>>(p, n, seed, a, b);
  return cudaGetLastError();
}

}  // namespace

cudaError_t FillRandomBf16(bf16* p, int64_t n, uint64_t seed, float scale, float offset,
                           cudaStream_t stream) {
  return Fill(p, n, seed, scale, offset, stream);
}

cudaError_t FillRandomF32(float* p, int64_t n, uint64_t seed, float scale, float offset,
                          cudaStream_t stream) {
  return Fill(p, n, seed, scale, offset, stream);
}

cudaError_t FillRowScaledRandomBf16(bf16* p, int64_t rows, int64_t cols, uint64_t seed, float scale,
                                    float offset, float row_log_sigma, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n <= 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 132 * 32);
  FillRowScaledKernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      p, n, cols, seed, scale, offset, row_log_sigma);
  return cudaGetLastError();
}

cudaError_t FillLogUniformBf16(bf16* p, int64_t n, uint64_t seed, float lo, float hi,
                               cudaStream_t stream) {
  return Fill<bf16, true>(p, n, seed, lo, hi - lo, stream);
}

cudaError_t FillLogUniformF32(float* p, int64_t n, uint64_t seed, float lo, float hi,
                              cudaStream_t stream) {
  return Fill<float, true>(p, n, seed, lo, hi - lo, stream);
}

}  // namespace draftfeed::cuda
