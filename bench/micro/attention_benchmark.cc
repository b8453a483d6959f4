// Varlen causal attention at the Qwen3.6-27B (and Qwen3-8B) head shapes, in TFLOP/s against bf16's.
//
// FLOPs are the causal ones: per sequence of L tokens and query head,
// 2 matmuls (q·kᵀ, p·v) of 2·L²/2·hd each. q is read in place from the
// interleaved query|gate projection and K, V from the same row, as the
// engine calls it. A chunked-prefill case runs one piece of a long sequence
// after a prefix (AttentionArgs::q_offset): K and V of the whole sequence in
// a buffer of their own, 4·hd·Hq·Σ_i (q_offset + i + 1) FLOPs.
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

// With q_offset > 0, lens is the one piece's length and K, V are read from a
// [q_offset + lens[0], 2, Hkv, hd] buffer (k | v per token).
void RunAttention(benchmark::State& state, const Shape& s, const std::vector<int32_t>& lens,
                  int32_t q_offset = 0) {
  const std::vector<int32_t> cu = Offsets(lens);
  const int64_t t = cu.back();
  const int64_t q_head_stride = s.gated ? 2 * s.hd : s.hd;
  const int64_t row = s.hq * q_head_stride + 2 * s.hkv * s.hd;  // q (| gate) | k | v
  const int64_t kv_row = 2 * s.hkv * s.hd;
  DeviceArray<bf16> proj(t * row), out(t * s.hq * s.hd);
  DeviceArray<bf16> kv_cache(q_offset > 0 ? (q_offset + t) * kv_row : 0);
  DeviceArray<int32_t> d_cu(cu);
  FillRandom(proj, 1, 1.5f);

  cuda::AttentionArgs a;
  a.q = proj.get();
  a.q_stride = row;
  a.q_head_stride = q_head_stride;
  a.k = proj.get() + s.hq * q_head_stride;
  a.v = a.k + s.hkv * s.hd;
  a.k_stride = a.v_stride = row;
  if (q_offset > 0) {
    FillRandom(kv_cache, 2, 1.5f);
    a.k = kv_cache.get();
    a.v = a.k + s.hkv * s.hd;
    a.k_stride = a.v_stride = kv_row;
    a.num_kv_tokens = q_offset + t;
    a.q_offset = q_offset;
  }
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
  if (q_offset > 0) {  // Σ_i (q_offset + i + 1) keys over the piece's t queries
    work.flops = 4.0 * s.hd * s.hq * (double(q_offset) * t + double(t) * (t + 1) / 2);
  } else {
    for (int32_t l : lens) work.flops += 2.0 * 2.0 * double(l) * l / 2.0 * s.hd * s.hq;
  }
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

// Chunked prefill at long context: the last 8,192 queries of a 131,072-token
// sequence, after a prefix of 122,880 (15 pieces of 8,192) already run.
void BM_AttentionQwen36_27B_8192AfterPrefix122880(benchmark::State& state) {
  RunAttention(state, kQwen36_27B, {8192}, 122880);
}
DF_GPU_BENCHMARK(BM_AttentionQwen36_27B_8192AfterPrefix122880);

void BM_AttentionQwen3_8B_1x8192(benchmark::State& state) {
  RunAttention(state, kQwen3_8B, {8192});
}
DF_GPU_BENCHMARK(BM_AttentionQwen3_8B_1x8192);

}  // namespace
}  // namespace draftfeed::bench
