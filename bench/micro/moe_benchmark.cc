// The MoE kernels at the Qwen3.6-35B-A3B shape (D 2048, 256 experts, top 8,
// expert width 512) and Qwen3-30B-A3B's (128 experts, width 768), for 16,384
// and 49,152 tokens: the grouped expert GEMMs in TFLOP/s beside cuBLASLt's
// dense GEMM of the same M, N, K (every row through one weight matrix, the
// ceiling a grouped GEMM approaches), and routing, permutation and combine
// times.
//
// Routing is realistically uneven: logit[t, e] = s_e·z[t, e] with z ~ N(0, 1)
// and s_e = exp(0.2·n_e), n_e ~ N(0, 1), which is what a router whose expert
// rows have unequal norms (random:qwen3.6-35b-a3b's router init) gives on
// isotropic normed states: the hottest expert gets several times the mean
// load and a few almost none. Each GEMM benchmark reports the hottest
// expert's load over the mean (hot_vs_mean) beside its figure.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "bench/micro/gpu_benchmark.h"
#include "benchmark/benchmark.h"
#include "kernels/moe.cuh"
#include "server/model/cuda_gemm.h"

namespace draftfeed::bench {
namespace {

using cuda::bf16;

struct MoeShape {
  int64_t hidden, inter;
  int experts, top_k;
};
// server/model/random_model.cc: random:qwen3.6-35b-a3b, random:qwen3-30b-a3b.
constexpr MoeShape kQwen36_35B_A3B = {2048, 512, 256, 8};
constexpr MoeShape kQwen3_30B_A3B = {2048, 768, 128, 8};

// Router logits [tokens, experts] (bf16, as the router GEMM writes them)
// with per-expert spread s_e, drawn on the host once per shape and size.
std::vector<float> UnevenLogits(int64_t tokens, int experts, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> spread(experts);
  for (float& s : spread) s = std::exp(0.2f * normal(rng));
  std::vector<float> logits(static_cast<size_t>(tokens * experts));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int e = 0; e < experts; ++e) logits[t * experts + e] = spread[e] * normal(rng);
  }
  return logits;
}

std::vector<bf16> ToBf16(const std::vector<float>& f) {
  std::vector<bf16> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = __float2bfloat16(f[i]);
  return b;
}

// One layer's MoE state for `tokens` tokens: inputs, weights, workspace, and
// the routing already computed (TopK + Permute), so each benchmark times
// only its own kernel.
class MoeLayer {
 public:
  MoeLayer(const MoeShape& s, int64_t tokens)
      : s_(s),
        tokens_(tokens),
        x_(tokens * s.hidden),
        gate_up_(int64_t{s.experts} * 2 * s.inter * s.hidden),
        down_(int64_t{s.experts} * s.hidden * s.inter),
        logits_(ToBf16(UnevenLogits(tokens, s.experts, 7))),
        residual_(tokens * s.hidden),
        workspace_(static_cast<int64_t>(
            cuda::MoeWorkspaceBytes(tokens, s.experts, s.top_k, s.hidden, s.inter))) {
    FillRandom(x_, 1);
    FillRandom(gate_up_, 2, 1.0f / std::sqrt(static_cast<float>(s.hidden)));
    FillRandom(down_, 3, 1.0f / std::sqrt(static_cast<float>(s.inter)));
    FillRandom(residual_, 4);
    if (workspace_.get() == nullptr || logits_.get() == nullptr) return;
    b_ = cuda::CarveMoeWorkspace(workspace_.get(), tokens, s.experts, s.top_k, s.hidden, s.inter);
    NoteSetup(Route());
    NoteSetup(cuda::MoePermute(b_.expert_ids, tokens, s.experts, s.top_k, b_.routing, nullptr));
    NoteSetup(GateUp());
    NoteSetup(cudaDeviceSynchronize());
    std::vector<int32_t> counts(s.experts);
    if (cudaMemcpy(counts.data(), b_.routing.counts, counts.size() * 4, cudaMemcpyDeviceToHost) ==
        cudaSuccess) {
      const double mean = static_cast<double>(rows()) / s.experts;
      hot_vs_mean_ = *std::max_element(counts.begin(), counts.end()) / mean;
      cold_vs_mean_ = *std::min_element(counts.begin(), counts.end()) / mean;
    }
  }

  int64_t rows() const { return tokens_ * s_.top_k; }
  void Report(benchmark::State& state) const {
    state.counters["hot_vs_mean"] = hot_vs_mean_;
    state.counters["cold_vs_mean"] = cold_vs_mean_;
  }

  cudaError_t Route() const {
    return cuda::MoeTopK(logits_.get(), s_.experts, tokens_, s_.experts, s_.top_k, true,
                         b_.expert_ids, b_.weights, nullptr);
  }
  cudaError_t Permute() const {
    return cuda::MoePermute(b_.expert_ids, tokens_, s_.experts, s_.top_k, b_.routing, nullptr);
  }
  cudaError_t GateUp() const {
    return cuda::MoeGateUpSwiGlu(x_.get(), s_.hidden, gate_up_.get(), s_.hidden, s_.inter,
                                 s_.experts, rows(), b_.routing, b_.act, nullptr);
  }
  cudaError_t Down() const {
    return cuda::MoeDown(b_.act, down_.get(), s_.hidden, s_.inter, s_.experts, rows(), b_.routing,
                         b_.y, nullptr);
  }
  cudaError_t Combine() const {
    return cuda::MoeCombine(b_.y, b_.routing.pair_row, b_.weights, tokens_, s_.top_k, s_.hidden,
                            nullptr, 0, nullptr, 0, residual_.get(), nullptr);
  }

 private:
  MoeShape s_;
  int64_t tokens_;
  DeviceArray<bf16> x_, gate_up_, down_, logits_;
  DeviceArray<float> residual_;
  DeviceArray<char> workspace_;
  cuda::MoeBuffers b_;
  double hot_vs_mean_ = 0, cold_vs_mean_ = 0;
};

void RunGateUp(benchmark::State& state, const MoeShape& s) {
  MoeLayer layer(s, state.range(0));
  Work work;
  work.flops = 2.0 * layer.rows() * 2 * s.inter * s.hidden;
  TimeKernel(state, work, [&] { return layer.GateUp(); });
  layer.Report(state);
}

void RunDown(benchmark::State& state, const MoeShape& s) {
  MoeLayer layer(s, state.range(0));
  Work work;
  work.flops = 2.0 * layer.rows() * s.hidden * s.inter;
  TimeKernel(state, work, [&] { return layer.Down(); });
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
