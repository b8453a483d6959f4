// Gated DeltaNet prefill (conv and delta rule) at the Qwen3.6-27B shape, in GB/s and TFLOP/s,
// and the delta rule at the Qwen3.6-35B-A3B shape (32 value heads, 16 key heads, 128 × 128).
//
// Inputs sit where the engine keeps them: the conv reads q | k | v from the
// projection row (kGdnRow elements, b and a after them), the rule reads the
// conv's output and b, a from the projection. The rule's FLOPs are the
// recurrence's own, whatever the chunked algorithm spends: per token and
// value head, 2·dk·dv each for k·S, the rank-1 state update and q·S.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench/micro/gpu_benchmark.h"
#include "benchmark/benchmark.h"
#include "kernels/checksum.cuh"
#include "kernels/checksum_terms.h"
#include "kernels/gdn.cuh"

namespace draftfeed::bench {
namespace {

using cuda::bf16;
using qwen36_27b::kConvChannels;
using qwen36_27b::kConvKernel;
using qwen36_27b::kGdnRow;
using qwen36_27b::kKeyDim;
using qwen36_27b::kKeyHeads;
using qwen36_27b::kValueDim;
using qwen36_27b::kValueHeads;

void RunConv(benchmark::State& state, const std::vector<int32_t>& lens) {
  const std::vector<int32_t> cu = Offsets(lens);
  const int64_t t = cu.back();
  DeviceArray<bf16> proj(t * kGdnRow), w(kConvChannels * kConvKernel), y(t * kConvChannels);
  DeviceArray<int32_t> d_cu(cu);
  FillRandom(proj, 1);
  FillRandom(w, 2, 0.5f);
  TimeKernel(state, {2.0 * t * kConvChannels * sizeof(bf16)}, [&] {
    return cuda::CausalConv1dSilu(proj.get(), kGdnRow, w.get(), t, kConvChannels, kConvKernel,
                                  d_cu.get(), static_cast<int32_t>(lens.size()), y.get(), nullptr);
  });
}

void BM_CausalConv1dSilu_1x8192(benchmark::State& state) { RunConv(state, {8192}); }
DF_GPU_BENCHMARK(BM_CausalConv1dSilu_1x8192);

void BM_CausalConv1dSilu_Mixed16384(benchmark::State& state) {
  RunConv(state, {8192, 4096, 2048, 1024, 512, 512});
}
DF_GPU_BENCHMARK(BM_CausalConv1dSilu_Mixed16384);

// value_heads: 48 for the 27B, 32 for the 35B-A3B (both have 16 key heads of 128).
void RunDeltaRule(benchmark::State& state, const std::vector<int32_t>& lens,
                  int64_t value_heads = kValueHeads) {
  const std::vector<int32_t> cu = Offsets(lens);
  const int64_t t = cu.back();
  const int64_t conv_channels = 2 * kKeyHeads * kKeyDim + value_heads * kValueDim;
  const int64_t gdn_row = conv_channels + 2 * value_heads;
  DeviceArray<bf16> qkv(t * conv_channels), proj(t * gdn_row), out(t * value_heads * kValueDim);
  DeviceArray<int32_t> d_cu(cu);
  // A = exp(A_log) across the released init range [0.01, 16], as the
  // correctness test spans it: some heads forget within a token, some
  // remember across many chunks.
  std::vector<float> a_log(value_heads);
  for (int64_t h = 0; h < value_heads; ++h) {
    a_log[h] = static_cast<float>(std::log(0.01) + std::log(1600.0) * h / (value_heads - 1));
  }
  DeviceArray<float> d_a_log(a_log), dt_bias(value_heads);
  FillRandom(qkv, 1);
  FillRandom(proj, 2);
  FillRandom(dt_bias, 3);

  cuda::GdnArgs g;
  g.qkv = qkv.get();
  g.qkv_stride = conv_channels;
  g.b = proj.get() + conv_channels;
  g.a = proj.get() + conv_channels + value_heads;
  g.ab_stride = gdn_row;
  g.a_log = d_a_log.get();
  g.dt_bias = dt_bias.get();
  g.num_tokens = t;
  g.num_k_heads = kKeyHeads;
  g.num_v_heads = value_heads;
  g.key_dim = kKeyDim;
  g.value_dim = kValueDim;
  g.cu_seqlens = d_cu.get();
  g.num_seqs = static_cast<int32_t>(lens.size());
  g.out = out.get();
  DeviceArray<unsigned char> workspace(static_cast<int64_t>(cuda::GdnWorkspaceBytes(g)));

  Work work;
  work.bytes = static_cast<double>(t) * (gdn_row + value_heads * kValueDim) * sizeof(bf16);
  work.flops = 6.0 * t * value_heads * kKeyDim * kValueDim;
  TimeKernel(state, work, [&] { return cuda::GatedDeltaRule(g, workspace.get(), nullptr); });
  // The output's payload checksum (the protocol's, kernels/checksum.cuh, on
  // the GPU), so that builds of two versions of the rule can be compared bit
  // for bit from their benchmark rows (the inputs are seeded).
  DeviceArray<unsigned long long> scratch(v1::kChecksumLanes);
  uint64_t lanes[v1::kChecksumLanes], sum = 0;
  if (out.get() != nullptr && scratch.get() != nullptr &&
      cuda::PayloadChecksum(out.get(), out.bytes(), scratch.get(), lanes, &sum, nullptr) ==
          cudaSuccess) {
    char label[40];
    std::snprintf(label, sizeof(label), "out_checksum=%016llx",
                  static_cast<unsigned long long>(sum));
    state.SetLabel(label);
  }
}

void BM_GatedDeltaRule_1x8192(benchmark::State& state) { RunDeltaRule(state, {8192}); }
DF_GPU_BENCHMARK(BM_GatedDeltaRule_1x8192);

void BM_GatedDeltaRule_4x2048(benchmark::State& state) {
  RunDeltaRule(state, {2048, 2048, 2048, 2048});
}
DF_GPU_BENCHMARK(BM_GatedDeltaRule_4x2048);

void BM_GatedDeltaRule_Mixed16384(benchmark::State& state) {
  RunDeltaRule(state, {8192, 4096, 2048, 1024, 512, 512});
}
DF_GPU_BENCHMARK(BM_GatedDeltaRule_Mixed16384);

// The 35B-A3B's linear-attention layers: 32 value heads.
constexpr int64_t k35bValueHeads = 32;

void BM_GatedDeltaRule_35b_1x8192(benchmark::State& state) {
  RunDeltaRule(state, {8192}, k35bValueHeads);
}
DF_GPU_BENCHMARK(BM_GatedDeltaRule_35b_1x8192);

void BM_GatedDeltaRule_35b_Mixed16384(benchmark::State& state) {
  RunDeltaRule(state, {8192, 4096, 2048, 1024, 512, 512}, k35bValueHeads);
}
DF_GPU_BENCHMARK(BM_GatedDeltaRule_35b_Mixed16384);

}  // namespace
}  // namespace draftfeed::bench
