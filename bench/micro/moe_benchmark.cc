// The MoE kernels at the Qwen3.6-35B-A3B shape (D 2048, 256 experts, top 8,
// expert width 512) and Qwen3-30B-A3B's (128 experts, width 768), for 16,384
// and 49,152 tokens: the grouped expert GEMMs in TFLOP/s beside cuBLASLt's
// dense GEMM of the same M, N, K (every row through one weight matrix, the
// ceiling a grouped GEMM approaches), and routing, permutation and combine
// times. The Fp8 forms time the FP8 experts' GEMMs on the same problem.
//
// Routing is realistically uneven (bench/micro/moe_layer.h); each GEMM
// benchmark reports the hottest expert's load over the mean (hot_vs_mean)
// beside its figure.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "bench/micro/gpu_benchmark.h"
#include "bench/micro/moe_layer.h"
#include "benchmark/benchmark.h"
#include "kernels/moe.cuh"
#include "server/model/cuda_gemm.h"

namespace draftfeed::bench {
namespace {

using cuda::bf16;

// fp8: the FP8 experts' GEMMs (e4m3 operands, 128-block scales) on the same
// problem, the same FLOPs.
void RunGateUp(benchmark::State& state, const MoeShape& s, bool fp8 = false) {
  MoeLayer layer(s, state.range(0));
  if (fp8) NoteSetup(layer.PrepareFp8());
  Work work;
  work.flops = 2.0 * layer.rows() * 2 * s.inter * s.hidden;
  TimeKernel(state, work, [&] { return fp8 ? layer.GateUpFp8() : layer.GateUp(); });
  layer.Report(state);
}

void RunDown(benchmark::State& state, const MoeShape& s, bool fp8 = false) {
  MoeLayer layer(s, state.range(0));
  if (fp8) NoteSetup(layer.PrepareFp8());
  Work work;
  work.flops = 2.0 * layer.rows() * s.hidden * s.inter;
  TimeKernel(state, work, [&] { return fp8 ? layer.DownFp8() : layer.Down(); });
  layer.Report(state);
}

void RunRoute(benchmark::State& state, const MoeShape& s) {
  MoeLayer layer(s, state.range(0));
  // Logits read, ids and weights written.
  TimeKernel(state, {state.range(0) * (2.0 * s.experts + 8.0 * s.top_k)},
             [&] { return layer.Route(); });
}

void RunPermute(benchmark::State& state, const MoeShape& s) {
  MoeLayer layer(s, state.range(0));
  // Ids read twice, ranks written and rewritten, row tokens written.
  TimeKernel(state, {layer.rows() * 4.0 * 5.0}, [&] { return layer.Permute(); });
}

void RunCombine(benchmark::State& state, const MoeShape& s) {
  MoeLayer layer(s, state.range(0));
  // y rows read, the fp32 residual read and written.
  TimeKernel(state, {layer.rows() * s.hidden * 2.0 + state.range(0) * s.hidden * 8.0},
             [&] { return layer.Combine(); });
}

// cuBLASLt's dense GEMM at the grouped GEMM's M (all T·k rows), N and K.
void RunDenseCeiling(benchmark::State& state, int64_t m, int64_t n, int64_t k) {
  DeviceArray<bf16> x(m * k), w(n * k), y(m * n);
  DeviceArray<char> ws(64 << 20);
  FillRandom(x, 5);
  FillRandom(w, 6, 1.0f / std::sqrt(static_cast<float>(k)));
  CublasLtGemm gemm;
  if (!gemm.Init(ws.get(), 64 << 20).ok()) NoteSetup(cudaErrorUnknown);
  TimeKernel(state, {0, 2.0 * m * n * k}, [&] {
    return gemm.Run(x.get(), w.get(), y.get(), m, n, k, nullptr).ok() ? cudaSuccess
                                                                      : cudaErrorUnknown;
  });
}

#define DF_MOE_BENCHMARK(fn) DF_GPU_BENCHMARK(fn)->Arg(16384)->Arg(49152)

void BM_MoeGateUpSwiGlu_Qwen36_35B_A3B(benchmark::State& s) { RunGateUp(s, kQwen36_35B_A3B); }
DF_MOE_BENCHMARK(BM_MoeGateUpSwiGlu_Qwen36_35B_A3B);
void BM_MoeDown_Qwen36_35B_A3B(benchmark::State& s) { RunDown(s, kQwen36_35B_A3B); }
DF_MOE_BENCHMARK(BM_MoeDown_Qwen36_35B_A3B);
void BM_MoeGateUpSwiGluFp8_Qwen36_35B_A3B(benchmark::State& s) {
  RunGateUp(s, kQwen36_35B_A3B, true);
}
DF_MOE_BENCHMARK(BM_MoeGateUpSwiGluFp8_Qwen36_35B_A3B);
void BM_MoeDownFp8_Qwen36_35B_A3B(benchmark::State& s) { RunDown(s, kQwen36_35B_A3B, true); }
DF_MOE_BENCHMARK(BM_MoeDownFp8_Qwen36_35B_A3B);
void BM_MoeTopK_Qwen36_35B_A3B(benchmark::State& s) { RunRoute(s, kQwen36_35B_A3B); }
DF_MOE_BENCHMARK(BM_MoeTopK_Qwen36_35B_A3B);
void BM_MoePermute_Qwen36_35B_A3B(benchmark::State& s) { RunPermute(s, kQwen36_35B_A3B); }
DF_MOE_BENCHMARK(BM_MoePermute_Qwen36_35B_A3B);
void BM_MoeCombine_Qwen36_35B_A3B(benchmark::State& s) { RunCombine(s, kQwen36_35B_A3B); }
DF_MOE_BENCHMARK(BM_MoeCombine_Qwen36_35B_A3B);
void BM_DenseCeilingGateUp_Qwen36_35B_A3B(benchmark::State& s) {
  const MoeShape& m = kQwen36_35B_A3B;
  RunDenseCeiling(s, s.range(0) * m.top_k, 2 * m.inter, m.hidden);
}
DF_MOE_BENCHMARK(BM_DenseCeilingGateUp_Qwen36_35B_A3B);
void BM_DenseCeilingDown_Qwen36_35B_A3B(benchmark::State& s) {
  const MoeShape& m = kQwen36_35B_A3B;
  RunDenseCeiling(s, s.range(0) * m.top_k, m.hidden, m.inter);
}
DF_MOE_BENCHMARK(BM_DenseCeilingDown_Qwen36_35B_A3B);

void BM_MoeGateUpSwiGlu_Qwen3_30B_A3B(benchmark::State& s) { RunGateUp(s, kQwen3_30B_A3B); }
DF_MOE_BENCHMARK(BM_MoeGateUpSwiGlu_Qwen3_30B_A3B);
void BM_MoeDown_Qwen3_30B_A3B(benchmark::State& s) { RunDown(s, kQwen3_30B_A3B); }
DF_MOE_BENCHMARK(BM_MoeDown_Qwen3_30B_A3B);
void BM_MoeGateUpSwiGluFp8_Qwen3_30B_A3B(benchmark::State& s) {
  RunGateUp(s, kQwen3_30B_A3B, true);
}
DF_MOE_BENCHMARK(BM_MoeGateUpSwiGluFp8_Qwen3_30B_A3B);
void BM_MoeDownFp8_Qwen3_30B_A3B(benchmark::State& s) { RunDown(s, kQwen3_30B_A3B, true); }
DF_MOE_BENCHMARK(BM_MoeDownFp8_Qwen3_30B_A3B);
void BM_DenseCeilingGateUp_Qwen3_30B_A3B(benchmark::State& s) {
  const MoeShape& m = kQwen3_30B_A3B;
  RunDenseCeiling(s, s.range(0) * m.top_k, 2 * m.inter, m.hidden);
}
DF_MOE_BENCHMARK(BM_DenseCeilingGateUp_Qwen3_30B_A3B);
void BM_DenseCeilingDown_Qwen3_30B_A3B(benchmark::State& s) {
  const MoeShape& m = kQwen3_30B_A3B;
  RunDenseCeiling(s, s.range(0) * m.top_k, m.hidden, m.inter);
}
DF_MOE_BENCHMARK(BM_DenseCeilingDown_Qwen3_30B_A3B);

}  // namespace
}  // namespace draftfeed::bench
