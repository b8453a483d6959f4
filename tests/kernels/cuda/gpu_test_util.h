// Helpers for tests that need a GPU: they skip cleanly (GTEST_SKIP) without one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace draftfeed::testing {

inline bool HasGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define DF_REQUIRE_GPU()                                                   \
  do {                                                                     \
    if (!::draftfeed::testing::HasGpu()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)

// Asserts a CUDA call succeeded (evaluates `expr` once).
#define DF_CUDA_OK(expr)                                            \
  do {                                                              \
    const cudaError_t df_err_ = (expr);                             \
    ASSERT_EQ(df_err_, cudaSuccess) << cudaGetErrorString(df_err_); \
  } while (0)

// Owns a device buffer of T.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) { cudaMalloc(&p_, std::max<size_t>(1, n) * sizeof(T)); }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { Upload(h); }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  size_t size() const { return n_; }
  void Upload(const std::vector<T>& h) {
    cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  std::vector<T> Download() const {
    std::vector<T> h(n_);
    cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

inline std::vector<__nv_bfloat16> ToBf16(const std::vector<float>& f) {
  std::vector<__nv_bfloat16> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = __float2bfloat16(f[i]);
  return b;
}

inline std::vector<float> ToF32(const std::vector<__nv_bfloat16>& b) {
  std::vector<float> f(b.size());
  for (size_t i = 0; i < b.size(); ++i) f[i] = __bfloat162float(b[i]);
  return f;
}

// bf16-representable random values, so CPU and GPU see identical inputs.
inline std::vector<float> RandomBf16Values(size_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = __bfloat162float(__float2bfloat16(d(rng)));
  return v;
}

}  // namespace draftfeed::testing
