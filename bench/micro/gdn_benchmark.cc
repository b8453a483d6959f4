// Gated DeltaNet prefill (conv and delta rule) at the Qwen3.6-27B shape, in GB/s and TFLOP/s.
//
// Inputs sit where the engine keeps them: the conv reads q | k | v from the
// projection row (kGdnRow elements, b and a after them), the rule reads the
// conv's output and b, a from the projection. The rule's FLOPs are the
// recurrence's own, whatever the chunked algorithm spends: per token and
// value head, 2·dk·dv each for k·S, the rank-1 state update and q·S.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "bench/micro/gpu_benchmark.h"
#include "benchmark/benchmark.h"
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

void RunDeltaRule(benchmark::State& state, const std::vector<int32_t>& lens) {
  const std::vector<int32_t> cu = Offsets(lens);
  const int64_t t = cu.back();
  DeviceArray<bf16> qkv(t * kConvChannels), proj(t * kGdnRow), out(t * kValueHeads * kValueDim);
  DeviceArray<int32_t> d_cu(cu);
  // A = exp(A_log) across the released init range [0.01, 16], as the
  // correctness test spans it: some heads forget within a token, some
  // remember across many chunks.
  std::vector<float> a_log(kValueHeads);
  for (int64_t h = 0; h < kValueHeads; ++h) {
    a_log[h] = static_cast<float>(std::log(0.01) + std::log(1600.0) * h / (kValueHeads - 1));
  }
  DeviceArray<float> d_a_log(a_log), dt_bias(kValueHeads);
  FillRandom(qkv, 1);
  FillRandom(proj, 2);
  FillRandom(dt_bias, 3);

  cuda::GdnArgs g;
  g.qkv = qkv.get();
  g.qkv_stride = kConvChannels;
  g.b = proj.get() + kConvChannels;
  g.a = proj.get() + kConvChannels + kValueHeads;
  g.ab_stride = kGdnRow;
  g.a_log = d_a_log.get();
  g.dt_bias = dt_bias.get();
  g.num_tokens = t;
  g.num_k_heads = kKeyHeads;
  g.num_v_heads = kValueHeads;
  g.key_dim = kKeyDim;
  g.value_dim = kValueDim;
  g.cu_seqlens = d_cu.get();
  g.num_seqs = static_cast<int32_t>(lens.size());
  g.out = out.get();
  DeviceArray<unsigned char> workspace(static_cast<int64_t>(cuda::GdnWorkspaceBytes(g)));

  Work work;
  work.bytes = static_cast<double>(t) *
               (kConvChannels + 2 * kValueHeads + kValueHeads * kValueDim) * sizeof(bf16);
  work.flops = 6.0 * t * kValueHeads * kKeyDim * kValueDim;
  TimeKernel(state, work, [&] { return cuda::GatedDeltaRule(g, workspace.get(), nullptr); });
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

}  // namespace
}  // namespace draftfeed::bench
