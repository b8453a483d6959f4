// The CPU reference attention (kernels/cpu/attention.h) at the random models' head shapes, in
// wall time and GFLOP/s:
//
//   build/bin/draftfeed-bench-cpu-attention [--benchmark_filter=27000]
//
// tiny-random's (4 query heads, 2 KV heads, head_dim 64) at 4,096 and 27,000 tokens,
// small-random-qwen3's (8, 2, 128) and small-random's (4, 2, 256) at 4,096, each one sequence
// on 1 and 2 threads; and a chunked-prefill step: tiny-random's last 1,024 queries of a
// 27,000-token sequence over its whole K/V. FLOPs count the causal ones: per query head and
// query at position p, 2 matmuls (q·kᵀ, p·v) of (p + 1)·head_dim multiply-adds each.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "bench/micro/benchmark_main.h"
#include "benchmark/benchmark.h"
#include "kernels/cpu/attention.h"

namespace draftfeed {
namespace {

struct Shape {
  const char* name;
  int64_t hq, hkv, hd;
};
constexpr Shape kTiny = {"tiny", 4, 2, 64};     // tiny-random
constexpr Shape kHd128 = {"hd128", 8, 2, 128};  // small-random-qwen3
constexpr Shape kHd256 = {"hd256", 4, 2, 256};  // small-random

// The last q_len queries of one kv_len-token sequence (q_len == kv_len: the whole prefill).
void BM_CpuAttention(benchmark::State& state, Shape s, int64_t kv_len, int64_t q_len, int threads) {
  std::vector<float> q(q_len * s.hq * s.hd), k(kv_len * s.hkv * s.hd), v(k.size());
  std::mt19937_64 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::vector<float>* x : {&q, &k, &v}) {
    for (float& e : *x) e = normal(rng);
  }
  std::vector<float> out(q.size());
  const std::vector<int32_t> cu_q = {0, static_cast<int32_t>(q_len)};
  const std::vector<int32_t> cu_k = {0, static_cast<int32_t>(kv_len)};
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
  for (auto _ : state) {
    if (q_len == kv_len) {
      cpu::VarlenCausalAttention(q.data(), k.data(), v.data(), cu_q.data(), 1, s.hq, s.hkv, s.hd,
                                 scale, out.data(), threads);
    } else {
      cpu::VarlenCausalAttention(q.data(), k.data(), v.data(), cu_q.data(), cu_k.data(), 1, s.hq,
                                 s.hkv, s.hd, scale, out.data(), threads);
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  double mac = 0;  // Σ over queries of (p + 1), p = kv_len - q_len + i
  for (int64_t i = 0; i < q_len; ++i) mac += double(kv_len - q_len + i + 1);
  state.counters["GFLOP/s"] = benchmark::Counter(2.0 * 2.0 * mac * s.hd * s.hq * 1e-9,
                                                 benchmark::Counter::kIsIterationInvariantRate);
}

void RegisterAll() {
  struct Case {
    Shape s;
    int64_t kv_len, q_len;
  };
  const Case cases[] = {{kTiny, 4096, 4096},
                        {kTiny, 27000, 27000},
                        {kHd128, 4096, 4096},
                        {kHd256, 4096, 4096},
                        {kTiny, 27000, 1024}};
  for (const Case& c : cases) {
    for (int threads : {1, 2}) {
      std::string name = std::string("CpuAttention/") + c.s.name + "/T" + std::to_string(c.kv_len);
      if (c.q_len != c.kv_len) name += "/last" + std::to_string(c.q_len);
      name += "/threads:" + std::to_string(threads);
      benchmark::RegisterBenchmark(name.c_str(), BM_CpuAttention, c.s, c.kv_len, c.q_len, threads)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
}

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  if (!draftfeed::bench::InitBenchmarks(argc, argv, "0.5")) return 1;
  draftfeed::RegisterAll();
  return draftfeed::bench::RunRegisteredBenchmarks();
}
