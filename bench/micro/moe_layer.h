// One MoE layer's device state at a real shape, shared by the MoE kernel
// benchmarks (moe_benchmark.cc) and the cuBLAS grouped-GEMM comparison
// (moe_cublas_benchmark.cc), so both time exactly the same problem: the same
// inputs, weights and routing.
//
// Routing is realistically uneven: logit[t, e] = s_e·z[t, e] with z ~ N(0, 1)
// and s_e = exp(0.2·n_e), n_e ~ N(0, 1), which is what a router whose expert
// rows have unequal norms (random:qwen3.6-35b-a3b's router init) gives on
// isotropic normed states: the hottest expert gets several times the mean
// load and a few almost none. Report() puts the hottest and coldest expert's
// load over the mean beside a figure.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "bench/micro/gpu_benchmark.h"
#include "benchmark/benchmark.h"
#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/moe.cuh"

namespace draftfeed::bench {

struct MoeShape {
  int64_t hidden, inter;
  int experts, top_k;
};
// server/model/random_model.cc: random:qwen3.6-35b-a3b, random:qwen3-30b-a3b.
inline constexpr MoeShape kQwen36_35B_A3B = {2048, 512, 256, 8};
inline constexpr MoeShape kQwen3_30B_A3B = {2048, 768, 128, 8};

// Router logits [tokens, experts] with per-expert spread s_e, drawn on the
// host once per shape and size.
inline std::vector<float> UnevenLogits(int64_t tokens, int experts, uint64_t seed) {
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

inline std::vector<cuda::bf16> ToBf16(const std::vector<float>& f) {
  std::vector<cuda::bf16> b(f.size());
  for (size_t i = 0; i < f.size(); ++i) b[i] = __float2bfloat16(f[i]);
  return b;
}

// Inputs, weights, workspace, and the routing already computed (TopK +
// Permute, bf16 logits as the router GEMM writes them), so each benchmark
// times only its own kernel.
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
    NoteSetup(Permute());
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

  const MoeShape& shape() const { return s_; }
  int64_t tokens() const { return tokens_; }
  int64_t rows() const { return tokens_ * s_.top_k; }
  const cuda::bf16* x() const { return x_.get(); }
  const cuda::bf16* gate_up_weights() const { return gate_up_.get(); }
  const cuda::bf16* down_weights() const { return down_.get(); }
  const cuda::MoeBuffers& buffers() const { return b_; }

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
  // The FP8 experts (--fp8_experts fp8): the same weights quantized in
  // 128 x 128 blocks (each expert's rows a whole number of blocks, so the
  // stacked matrix quantized at once is every expert's layout), x and the
  // SwiGLU activations per token and 128 group, as the engine's producers
  // write them. Built on first use.
  cudaError_t PrepareFp8() {
    if (fp8_ != nullptr) return fp8_->status;
    const int64_t d = s_.hidden, i = s_.inter, e = s_.experts;
    fp8_ = std::make_unique<Fp8State>(s_, tokens_, rows());
    Fp8State& f = *fp8_;
    cudaError_t err =
        cuda::QuantizeActivationsFp8(x_.get(), d, tokens_, d, f.xq.get(), f.xs.get(), nullptr);
    if (err == cudaSuccess) {
      err = cuda::QuantizeWeightBlocksFp8(gate_up_.get(), e * 2 * i, d, f.gate_upq.get(),
                                          f.gate_ups.get(), cuda::Fp8ScaleStride(d), nullptr);
    }
    if (err == cudaSuccess) {
      err = cuda::QuantizeWeightBlocksFp8(down_.get(), e * d, i, f.downq.get(), f.downs.get(),
                                          cuda::Fp8ScaleStride(i), nullptr);
    }
    if (err == cudaSuccess) err = GateUpFp8();
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    f.status = err;
    return err;
  }
  // After PrepareFp8() returned cudaSuccess.
  cudaError_t GateUpFp8() const {
    const Fp8State& f = *fp8_;
    return cuda::MoeGateUpSwiGluFp8(f.xq.get(), f.xs.get(), cuda::Fp8RowsPadded(tokens_),
                                    f.gate_upq.get(), f.gate_ups.get(), s_.hidden, s_.inter,
                                    s_.experts, rows(), b_.routing, b_.act, nullptr,
                                    {f.actq.get(), f.acts.get()});
  }
  cudaError_t DownFp8() const {
    const Fp8State& f = *fp8_;
    return cuda::MoeDownFp8(f.actq.get(), f.acts.get(), cuda::Fp8RowsPadded(rows()), f.downq.get(),
                            f.downs.get(), s_.hidden, s_.inter, s_.experts, rows(), b_.routing,
                            b_.y, nullptr);
  }
  cudaError_t Combine() const {
    return cuda::MoeCombine(b_.y, b_.routing.pair_row, b_.weights, tokens_, s_.top_k, s_.hidden,
                            nullptr, 0, nullptr, 0, residual_.get(), nullptr);
  }

 private:
  MoeShape s_;
  int64_t tokens_;
  DeviceArray<cuda::bf16> x_, gate_up_, down_, logits_;
  DeviceArray<float> residual_;
  DeviceArray<char> workspace_;
  // The FP8 operands: e4m3 codes and their scales (fp8_gemm_operands.cuh).
  struct Fp8State {
    Fp8State(const MoeShape& s, int64_t tokens, int64_t rows)
        : xq(tokens * s.hidden),
          xs(s.hidden / 128 * cuda::Fp8RowsPadded(tokens)),
          gate_upq(int64_t{s.experts} * 2 * s.inter * s.hidden),
          gate_ups(int64_t{s.experts} * 2 * s.inter / 128 * cuda::Fp8ScaleStride(s.hidden)),
          downq(int64_t{s.experts} * s.hidden * s.inter),
          downs(int64_t{s.experts} * s.hidden / 128 * cuda::Fp8ScaleStride(s.inter)),
          actq(cuda::Fp8RowsPadded(rows) * s.inter),
          acts(s.inter / 128 * cuda::Fp8RowsPadded(rows)) {}
    // Each operand's codes, then its scales: the order the constructor
    // initialises them in.
    DeviceArray<uint8_t> xq;
    DeviceArray<float> xs;
    DeviceArray<uint8_t> gate_upq;
    DeviceArray<float> gate_ups;
    DeviceArray<uint8_t> downq;
    DeviceArray<float> downs;
    DeviceArray<uint8_t> actq;
    DeviceArray<float> acts;
    cudaError_t status = cudaSuccess;
  };
  std::unique_ptr<Fp8State> fp8_;
  cuda::MoeBuffers b_;
  double hot_vs_mean_ = 0, cold_vs_mean_ = 0;
};

}  // namespace draftfeed::bench
