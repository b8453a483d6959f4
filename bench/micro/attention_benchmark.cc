// Varlen causal attention at the Qwen3.6-27B (and Qwen3-8B) head shapes, in TFLOP/s against bf16's.
//
// FLOPs are the causal ones: per sequence of L tokens and query head,
// 2 matmuls (q·kᵀ, p·v) of 2·L²/2·hd each. q is read in place from the
// interleaved query|gate projection and K, V from the same row, as the
// engine calls it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bench/micro/gpu_benchmark.h"
#include "benchmark/benchmark.h"
#include "kernels/attention.cuh"

namespace draftfeed::bench {
namespace {

using cuda::bf16;

struct Shape {
  int64_t hq, hkv, hd;
  bool gated;  // q heads interleaved with their gate heads (Qwen3.6)
};
constexpr Shape kQwen36_27B = {qwen36_27b::kQHeads, qwen36_27b::kKvHeads, qwen36_27b::kHeadDim,
                               true};
constexpr Shape kQwen3_8B = {32, 8, 128, false};  // server/model/random_model.cc, random:qwen3-8b

void RunAttention(benchmark::State& state, const Shape& s, const std::vector<int32_t>& lens) {
  const std::vector<int32_t> cu = Offsets(lens);
  const int64_t t = cu.back();
  const int64_t q_head_stride = s.gated ? 2 * s.hd : s.hd;
  const int64_t row = s.hq * q_head_stride + 2 * s.hkv * s.hd;  // q (| gate) | k | v
  DeviceArray<bf16> proj(t * row), out(t * s.hq * s.hd);
  DeviceArray<int32_t> d_cu(cu);
  FillRandom(proj, 1, 1.5f);

  cuda::AttentionArgs a;
  a.q = proj.get();
  a.q_stride = row;
  a.q_head_stride = q_head_stride;
  a.k = proj.get() + s.hq * q_head_stride;
  a.v = a.k + s.hkv * s.hd;
  a.k_stride = a.v_stride = row;
  a.num_tokens = t;
  a.num_q_heads = s.hq;
  a.num_kv_heads = s.hkv;
  a.head_dim = s.hd;
  a.cu_seqlens = d_cu.get();
  a.num_seqs = static_cast<int32_t>(lens.size());
  a.max_seqlen = *std::max_element(lens.begin(), lens.end());
  a.scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  a.out = out.get();

  Work work;
  for (int32_t l : lens) work.flops += 2.0 * 2.0 * double(l) * l / 2.0 * s.hd * s.hq;
  TimeKernel(state, work, [&] { return cuda::VarlenCausalAttention(a, nullptr); });
}

void BM_AttentionQwen36_27B_1x8192(benchmark::State& state) {
  RunAttention(state, kQwen36_27B, {8192});
}
DF_GPU_BENCHMARK(BM_AttentionQwen36_27B_1x8192);

void BM_AttentionQwen36_27B_2x4096(benchmark::State& state) {
  RunAttention(state, kQwen36_27B, {4096, 4096});
}
DF_GPU_BENCHMARK(BM_AttentionQwen36_27B_2x4096);

// A 16,384-token batch of mixed lengths, as the engine benchmark packs them.
void BM_AttentionQwen36_27B_Mixed16384(benchmark::State& state) {
  RunAttention(state, kQwen36_27B, {8192, 4096, 2048, 1024, 512, 512});
}
DF_GPU_BENCHMARK(BM_AttentionQwen36_27B_Mixed16384);

void BM_AttentionQwen3_8B_1x8192(benchmark::State& state) {
  RunAttention(state, kQwen3_8B, {8192});
}
DF_GPU_BENCHMARK(BM_AttentionQwen3_8B_1x8192);

}  // namespace
}  // namespace draftfeed::bench
