// Our grouped expert GEMMs (kernels/moe_gemm.cu) against cuBLAS's grouped GEMM
// (cublasGemmGroupedBatchedEx, bench/micro/moe_cublas.h) on exactly the same
// problem: the MoeLayer of moe_layer.h (same inputs, weights and uneven routing
// as the MoE kernel benchmarks), at the Qwen3.6-35B-A3B and Qwen3-30B-A3B
// shapes, 16,384 and 49,152 tokens, gate_up (N = 2I, K = D) and down (N = D,
// K = I). One benchmark times all three in turn in every iteration, so one row
// of the table holds them:
//
//   ours_TFLOP/s     the fused kernel (gate_up: gather in its loads, SwiGLU on
//                    the fp32 accumulators; down: the plain GEMM);
//   cublas_TFLOP/s   cuBLAS's grouped GEMM alone, one group per expert with
//                    rows, its operands prepared beforehand (x already gathered,
//                    the pointer arrays already on the device): the GEMM
//                    against the GEMM;
//   route_TFLOP/s    what replacing our kernel with cuBLAS costs per layer:
//                    gate_up = the routing's offsets to the host (the stream
//                    waits), the pointer arrays up, the gather, the GEMM into
//                    [rows, 2I] and the SwiGLU over it; down = the pointer
//                    arrays up and the GEMM (the offsets are already on the host);
//   cublas_over_ours, route_over_ours   our time over theirs: above 1, cuBLAS
//                    is faster.
//
// All three count the same FLOPs, 2·rows·N·K. The iteration time Google
// Benchmark prints is ours.
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <functional>

#include "bench/micro/gpu_benchmark.h"
#include "bench/micro/moe_cublas.h"
#include "bench/micro/moe_layer.h"
#include "benchmark/benchmark.h"
#include "kernels/elementwise.cuh"
#include "kernels/moe.cuh"

namespace draftfeed::bench {
namespace {

using cuda::bf16;

cudaError_t FromCublas(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? cudaSuccess : cudaErrorUnknown;
}

// Host memory the device copies into without staging (the offsets' trip).
class PinnedInts {
 public:
  explicit PinnedInts(size_t n) {
    if (cudaMallocHost(&p_, n * sizeof(int32_t)) != cudaSuccess) {
      p_ = nullptr;
      NoteSetup(cudaErrorMemoryAllocation);
    }
  }
  ~PinnedInts() { cudaFreeHost(p_); }
  PinnedInts(const PinnedInts&) = delete;
  PinnedInts& operator=(const PinnedInts&) = delete;
  int32_t* get() const { return p_; }

 private:
  int32_t* p_ = nullptr;
};

constexpr int kOurs = 0, kCublas = 1, kRoute = 2;
using Launches = std::array<std::function<cudaError_t()>, 3>;

// Each launch once untimed, then in every iteration each in turn between two
// events on the default stream; the iteration time is ours. A failed set-up
// or launch ends the benchmark with its error.
void TimeInTurn(benchmark::State& state, double flops, const Launches& launches) {
  cudaError_t err = SetupError();
  SetupError() = cudaSuccess;
  for (const auto& launch : launches) {
    if (err == cudaSuccess) err = launch();
  }
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    state.SkipWithError(cudaGetErrorString(err));
    return;
  }
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::array<double, 3> seconds{};
  for (auto _ : state) {
    float ours_ms = 0;
    for (size_t i = 0; i < launches.size() && err == cudaSuccess; ++i) {
      cudaEventRecord(start);
      err = launches[i]();
      cudaEventRecord(stop);
      cudaEventSynchronize(stop);
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      seconds[i] += ms * 1e-3;
      if (i == kOurs) ours_ms = ms;
    }
    if (err != cudaSuccess) {
      state.SkipWithError(cudaGetErrorString(err));
      break;
    }
    state.SetIterationTime(ours_ms * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (err != cudaSuccess || seconds[kOurs] <= 0 || seconds[kCublas] <= 0 || seconds[kRoute] <= 0) {
    return;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["ours_TFLOP/s"] = flops * n / seconds[kOurs] / 1e12;
  state.counters["cublas_TFLOP/s"] = flops * n / seconds[kCublas] / 1e12;
  state.counters["route_TFLOP/s"] = flops * n / seconds[kRoute] / 1e12;
  state.counters["cublas_over_ours"] = seconds[kOurs] / seconds[kCublas];
  state.counters["route_over_ours"] = seconds[kOurs] / seconds[kRoute];
}

enum class Gemm { kGateUp, kDown };

void RunVsCublas(benchmark::State& state, const MoeShape& s, Gemm which) {
  MoeLayer layer(s, state.range(0));
  const cuda::MoeBuffers& b = layer.buffers();
  const bool gate_up = which == Gemm::kGateUp;
  const int64_t rows = layer.rows();
  const int64_t n = gate_up ? 2 * s.inter : s.hidden;
  const int64_t k = gate_up ? s.hidden : s.inter;
  // cuBLAS's own operands and outputs, so it never overwrites ours.
  DeviceArray<bf16> xs(gate_up ? rows * s.hidden : 1);  // x in expert order
  DeviceArray<bf16> out(rows * n);                      // [rows, 2I] gate | up, or y [rows, D]
  DeviceArray<bf16> act(gate_up ? rows * s.inter : 1);  // the SwiGLU of the gate_up product
  PinnedInts offsets(s.experts + 1);
  CublasGroupedGemm gemm;
  if (gemm.Init(s.experts) != CUBLAS_STATUS_SUCCESS) NoteSetup(cudaErrorUnknown);
  const bf16* a = gate_up ? xs.get() : b.act;
  const bf16* w = gate_up ? layer.gate_up_weights() : layer.down_weights();
  auto plan = [&]() {
    return FromCublas(gemm.Plan(offsets.get(), s.experts, a, k, w, n, k, out.get(), n, nullptr));
  };
  auto gather = [&]() {
    return MoeGatherRows(layer.x(), s.hidden, b.routing.row_token, rows, s.hidden, xs.get(),
                         nullptr);
  };
  if (SetupError() == cudaSuccess && offsets.get() != nullptr) {
    // The GEMM-only figure's operands, prepared once.
    NoteSetup(cudaMemcpy(offsets.get(), b.routing.offsets, (s.experts + 1) * sizeof(int32_t),
                         cudaMemcpyDeviceToHost));
    if (gate_up) NoteSetup(gather());
    NoteSetup(plan());
  }
  Launches launches = {[&] { return gate_up ? layer.GateUp() : layer.Down(); },
                       [&] { return FromCublas(gemm.Run(nullptr)); },
                       [&]() -> cudaError_t {
                         if (gate_up) {
                           cudaError_t e = cudaMemcpyAsync(offsets.get(), b.routing.offsets,
                                                           (s.experts + 1) * sizeof(int32_t),
                                                           cudaMemcpyDeviceToHost, nullptr);
                           if (e == cudaSuccess) e = cudaStreamSynchronize(nullptr);
                           if (e == cudaSuccess) e = gather();
                           if (e != cudaSuccess) return e;
                         }
                         if (const cudaError_t e = plan(); e != cudaSuccess) return e;
                         if (const cudaError_t e = FromCublas(gemm.Run(nullptr)); e != cudaSuccess)
                           return e;
                         return gate_up ? cuda::SwiGlu(out.get(), rows, s.inter, act.get(), nullptr)
                                        : cudaSuccess;
                       }};
  TimeInTurn(state, 2.0 * rows * n * k, launches);
  state.counters["groups"] = gemm.groups();
  layer.Report(state);
}

#define DF_MOE_CUBLAS_BENCHMARK(fn) DF_GPU_BENCHMARK(fn)->Arg(16384)->Arg(49152)

void BM_MoeVsCublasGateUp_Qwen36_35B_A3B(benchmark::State& s) {
  RunVsCublas(s, kQwen36_35B_A3B, Gemm::kGateUp);
}
DF_MOE_CUBLAS_BENCHMARK(BM_MoeVsCublasGateUp_Qwen36_35B_A3B);
void BM_MoeVsCublasDown_Qwen36_35B_A3B(benchmark::State& s) {
  RunVsCublas(s, kQwen36_35B_A3B, Gemm::kDown);
}
DF_MOE_CUBLAS_BENCHMARK(BM_MoeVsCublasDown_Qwen36_35B_A3B);
void BM_MoeVsCublasGateUp_Qwen3_30B_A3B(benchmark::State& s) {
  RunVsCublas(s, kQwen3_30B_A3B, Gemm::kGateUp);
}
DF_MOE_CUBLAS_BENCHMARK(BM_MoeVsCublasGateUp_Qwen3_30B_A3B);
void BM_MoeVsCublasDown_Qwen3_30B_A3B(benchmark::State& s) {
  RunVsCublas(s, kQwen3_30B_A3B, Gemm::kDown);
}
DF_MOE_CUBLAS_BENCHMARK(BM_MoeVsCublasDown_Qwen3_30B_A3B);

}  // namespace
}  // namespace draftfeed::bench
