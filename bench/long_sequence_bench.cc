#include "bench/long_sequence_bench.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <span>
#include <vector>

#include "bench/bench_batches.h"
#include "common/status_macros.h"
#include "server/model/cuda_engine.h"
#include "server/model/model.h"
#include "server/service/forward_chunks.h"

namespace draftfeed::bench {
namespace {

// Seconds of `fn`, or a negative value on an error (printed).
template <typename Fn>
double Time(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status s = fn();
  if (!s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return -1;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int RunLongSequenceBench(const LongSequenceOptions& o) {
  auto model = OpenModel(o.model);
  if (!model.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const ModelConfig& c = (*model)->config;
  const int64_t n = o.sequence_tokens;
  const std::vector<int32_t> lens = {static_cast<int32_t>(n)};
  const std::vector<int32_t> ids = RandomTokens(n, c.vocab_size, 1);
  const std::vector<int32_t> layers = SpacedLayers(c, o.capture);
  CudaEngineOptions opt;
  opt.device = o.device;
  opt.max_tokens = o.one_pass ? n : o.forward_tokens;
  opt.max_seqs = 16;
  opt.max_layers = static_cast<int64_t>(layers.size());
  cudaSetDevice(o.device);
  auto engine = CudaEngine::Create(model->get(), opt);
  if (!engine.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  if (absl::Status s = (*engine)->ReserveCarry(n); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  const std::vector<ForwardChunk> chunks = PlanForwardChunks(lens, o.forward_tokens);
  std::printf("model %s: one sequence of %lld tokens in %zu forwards of <= %lld; weights %.2f "
              "GiB, workspace %.2f GiB, carry %.2f GiB\n",
              (*model)->id.c_str(), static_cast<long long>(n), chunks.size(),
              static_cast<long long>(o.forward_tokens), (*engine)->weight_bytes() / 1073741824.0,
              (*engine)->workspace_bytes() / 1073741824.0,
              (*engine)->CarryBytes(n) / 1073741824.0);
  auto chunked = [&]() -> absl::Status {
    for (const ForwardChunk& ch : chunks) {
      ForwardInput in{std::span<const int32_t>(ids).subspan(static_cast<size_t>(ch.token_begin),
                                                            static_cast<size_t>(ch.tokens())),
                      ch.seq_lens, layers};
      in.resume_tokens = ch.resume_tokens;
      in.carry_last = ch.carry_last;
      DF_RETURN_IF_ERROR((*engine)->ForwardOnDevice(in));
    }
    return absl::OkStatus();
  };
  auto one = [&]() -> absl::Status { return (*engine)->ForwardOnDevice({ids, lens, layers}); };
  std::vector<double> secs, secs_one;
  if (Time(chunked) < 0) return 1;  // warm-up
  if (o.one_pass && Time(one) < 0) return 1;
  for (int i = 0; i < o.iters; ++i) {
    secs.push_back(Time(chunked));
    if (o.one_pass) secs_one.push_back(Time(one));
    if (secs.back() < 0 || (o.one_pass && secs_one.back() < 0)) return 1;
  }
  const double med = Median(secs);
  std::printf("chunked: median %.2f s = %.0f tokens/s (of %zu runs)\n", med, n / med, secs.size());
  if (o.one_pass) {
    const double m1 = Median(secs_one);
    std::printf("one pass: median %.2f s = %.0f tokens/s; chunked / one pass = %.3f\n", m1,
                n / m1, m1 / med);
  }
  // Profiled (a sync after every op): each family's share over all chunks.
  (*engine)->set_profile(true);
  std::vector<std::pair<std::string, double>> total;
  for (const ForwardChunk& ch : chunks) {
    ForwardInput in{std::span<const int32_t>(ids).subspan(static_cast<size_t>(ch.token_begin),
                                                          static_cast<size_t>(ch.tokens())),
                    ch.seq_lens, layers};
    in.resume_tokens = ch.resume_tokens;
    in.carry_last = ch.carry_last;
    if (!(*engine)->ForwardOnDevice(in).ok()) return 1;
    for (const auto& [name, ms] : (*engine)->last_op_times().ms) {
      bool found = false;
      for (auto& [n2, t] : total) {
        if (n2 == name) {
          t += ms;
          found = true;
        }
      }
      if (!found) total.emplace_back(name, ms);
    }
  }
  (*engine)->set_profile(false);
  double sum = 0, attn_ms = 0;
  for (const auto& [name, ms] : total) {
    sum += ms;
    if (name == "attention") attn_ms = ms;
  }
  int64_t attn_layers = 0;
  for (LayerKind k : c.layer_types) attn_layers += k == LayerKind::kFullAttention;
  const double attn_flops = 2.0 * c.head_dim * c.num_heads * double(n) * double(n) * attn_layers;
  std::printf("per op family (profiled, %.1f ms in all); attention %.0f TFLOP/s:\n", sum,
              attn_ms > 0 ? attn_flops / (attn_ms * 1e-3) / 1e12 : 0.0);
  for (const auto& [name, ms] : total) {
    std::printf("  %-12s %10.2f ms  %5.1f%%\n", name.c_str(), ms, 100.0 * ms / sum);
  }
  return 0;
}

}  // namespace draftfeed::bench
