// What the GPU kernel benchmarks share: device buffers filled on the device,
// CUDA-event timing into Google Benchmark's manual time, and the counters
// that put each figure beside the machine's ceiling.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"
#include "kernels/common.cuh"
#include "kernels/random_init.cuh"

namespace draftfeed::bench {

// NVIDIA's H200 SXM spec sheet figures, not measurements: HBM3e bandwidth
// and dense (no sparsity) bf16 tensor-core throughput. The DeviceCopy
// benchmark measures what a copy reaches on the machine at hand.
inline constexpr double kHbmBytesPerSecond = 4.8e12;
inline constexpr double kDenseBf16FlopsPerSecond = 989e12;

// Qwen3.6-27B (server/model/random_model.cc, "random:qwen3.6-27b") and the
// batch draftfeed-bench engine times: 16,384 packed tokens, 5 captured layers.
namespace qwen36_27b {
inline constexpr int64_t kTokens = 16384;
inline constexpr int64_t kHidden = 5120;
inline constexpr int64_t kFfn = 17408;
inline constexpr int64_t kVocab = 248320;
inline constexpr int64_t kCaptureSlots = 5;
inline constexpr float kEps = 1e-6f;
// Gated attention: q and its gate interleaved per head ([Hq, 2, hd]), then
// K and V, in one projection row of kAttnRow elements.
inline constexpr int64_t kQHeads = 24;
inline constexpr int64_t kKvHeads = 4;
inline constexpr int64_t kHeadDim = 256;
inline constexpr int64_t kRotaryDim = 64;  // partial_rotary_factor 0.25
inline constexpr float kRopeTheta = 1e7f;
inline constexpr int64_t kAttnRow = kQHeads * 2 * kHeadDim + 2 * kKvHeads * kHeadDim;
// Gated DeltaNet: the conv runs over q | k | v (kConvChannels), followed in
// the projection row by b and a (kGdnRow elements in all).
inline constexpr int64_t kKeyHeads = 16;
inline constexpr int64_t kValueHeads = 48;
inline constexpr int64_t kKeyDim = 128;
inline constexpr int64_t kValueDim = 128;
inline constexpr int64_t kConvKernel = 4;
inline constexpr int64_t kConvChannels = 2 * kKeyHeads * kKeyDim + kValueHeads * kValueDim;
inline constexpr int64_t kGdnRow = kConvChannels + 2 * kValueHeads;
}  // namespace qwen36_27b

// Registers a kernel benchmark: CUDA-event time, in microseconds.
#define DF_GPU_BENCHMARK(fn) BENCHMARK(fn)->UseManualTime()->Unit(benchmark::kMicrosecond)

// The first error of a benchmark's set-up (an allocation or fill), which
// TimeKernel reports instead of timing anything; it must not launch on a
// null buffer, whose fault would end every later benchmark too.
inline cudaError_t& SetupError() {
  static cudaError_t error = cudaSuccess;
  return error;
}
inline void NoteSetup(cudaError_t e) {
  if (SetupError() == cudaSuccess) SetupError() = e;
}

// A device allocation of n elements of T; a failed cudaMalloc leaves get()
// null and is noted as the set-up error.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(int64_t n) : n_(n) {
    const size_t bytes = static_cast<size_t>(n > 0 ? n : 1) * sizeof(T);
    if (const cudaError_t e = cudaMalloc(&p_, bytes); e != cudaSuccess) {
      p_ = nullptr;
      cudaGetLastError();
      NoteSetup(e);
    }
  }
  explicit DeviceArray(const std::vector<T>& host)
      : DeviceArray(static_cast<int64_t>(host.size())) {
    if (p_ != nullptr) {
      NoteSetup(cudaMemcpy(p_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    }
  }
  ~DeviceArray() { cudaFree(p_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return p_; }
  int64_t size() const { return n_; }
  int64_t bytes() const { return n_ * static_cast<int64_t>(sizeof(T)); }

 private:
  T* p_ = nullptr;
  int64_t n_ = 0;
};

// Random values of unit variance times `scale`, plus `offset`
// (FillRandomBf16 / F32): real-sized inputs without generating gigabytes on
// the host. Skipped on a buffer that failed to allocate.
inline void FillRandom(const DeviceArray<cuda::bf16>& a, uint64_t seed, float scale = 1.0f,
                       float offset = 0.0f) {
  if (a.get() != nullptr)
    NoteSetup(cuda::FillRandomBf16(a.get(), a.size(), seed, scale, offset, nullptr));
}
inline void FillRandom(const DeviceArray<float>& a, uint64_t seed, float scale = 1.0f,
                       float offset = 0.0f) {
  if (a.get() != nullptr)
    NoteSetup(cuda::FillRandomF32(a.get(), a.size(), seed, scale, offset, nullptr));
}

// cu_seqlens of packed sequences of the given lengths.
inline std::vector<int32_t> Offsets(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

// What one launch moves and computes; a zero is left out of the report.
struct Work {
  double bytes = 0;  // each input read once and each output written once
  double flops = 0;
};

// Runs `launch` (returning cudaError_t) once untimed, then once per
// benchmark iteration between two events on the default stream, and reports
// GB/s and TFLOP/s beside the spec ceilings. A failed set-up or launch ends
// the benchmark with its error instead of a figure.
template <typename Launch>
void TimeKernel(benchmark::State& state, const Work& work, Launch&& launch) {
  cudaError_t err = SetupError();
  SetupError() = cudaSuccess;  // the next benchmark starts afresh
  if (err == cudaSuccess) err = launch();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    state.SkipWithError(cudaGetErrorString(err));
    return;
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  double seconds = 0;
  for (auto _ : state) {
    cudaEventRecord(start);
    err = launch();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    if (err != cudaSuccess) {
      state.SkipWithError(cudaGetErrorString(err));
      break;
    }
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms * 1e-3);
    seconds += ms * 1e-3;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (err != cudaSuccess || seconds <= 0) return;
  const double n = static_cast<double>(state.iterations());
  if (work.bytes > 0) {
    state.SetBytesProcessed(static_cast<int64_t>(work.bytes * n));
    state.counters["GB/s"] = work.bytes * n / seconds / 1e9;
    state.counters["HBM_GB/s"] = kHbmBytesPerSecond / 1e9;
    state.counters["of_HBM"] = work.bytes * n / seconds / kHbmBytesPerSecond;
  }
  if (work.flops > 0) {
    state.counters["TFLOP/s"] = work.flops * n / seconds / 1e12;
    state.counters["bf16_TFLOP/s"] = kDenseBf16FlopsPerSecond / 1e12;
    state.counters["of_bf16"] = work.flops * n / seconds / kDenseBf16FlopsPerSecond;
  }
}

}  // namespace draftfeed::bench
