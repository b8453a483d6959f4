// Tensor-parallel forward speed: one model instance over --tp ranks on
// --devices (ranks may share a GPU), beside the same model unsharded on the
// first device, same batch, same run. On one GPU, tp ranks sharing it run
// tp times one rank's work plus the sums, so the ratio shows what sharding
// costs (narrower GEMMs, the all-reduces) and which MoE strategy (ep or
// split) gives a rank less work; on tp GPUs it is the speed-up.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/bench_batches.h"
#include "server/model/cuda_engine.h"
#include "server/model/sharding_plan.h"
#include "server/model/tensor_parallel_cuda_engine.h"

ABSL_FLAG(std::string, model, "random:qwen3.6-35b-a3b", "Model spec or checkpoint directory.");
ABSL_FLAG(int64_t, tokens, 16384, "Packed tokens per batch.");
ABSL_FLAG(int32_t, min_len, 512, "Shortest sequence in the batch.");
ABSL_FLAG(int32_t, max_len, 8192, "Longest sequence in the batch.");
ABSL_FLAG(int32_t, capture, 5, "Captured layers: evenly spaced, the last one the final norm.");
ABSL_FLAG(int32_t, iters, 5, "Timed iterations (median reported).");
ABSL_FLAG(int32_t, tp, 2, "Tensor-parallel ranks.");
ABSL_FLAG(std::string, moe_parallel, "ep", "MoE strategy: ep or split.");
ABSL_FLAG(std::string, devices, "0,0",
          "The ranks' GPUs, one per rank (repeat an index to share a GPU).");
ABSL_FLAG(bool, baseline, true, "Also time the unsharded engine on the first device.");
ABSL_FLAG(bool, lone_ranks, false,
          "Time each rank alone on the first device, one after the other, with no sums (its "
          "outputs stay partial): a rank's own work, for shapes two ranks of which do not fit "
          "one GPU. The group's step is about the slowest rank plus the sums.");

namespace draftfeed {
namespace {

template <typename E>
absl::StatusOr<double> MedianSeconds(E& engine, const ForwardInput& in, int iters) {
  DF_RETURN_IF_ERROR(engine.ForwardOnDevice(in));  // warm-up
  std::vector<double> secs;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    DF_RETURN_IF_ERROR(engine.ForwardOnDevice(in));
    secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return bench::Median(secs);
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
  return 1;
}

int Run() {
  std::vector<int> devices;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_devices), ',')) {
    int d = -1;
    if (!absl::SimpleAtoi(part, &d) || d < 0) {
      return Fail(absl::InvalidArgumentError("--devices: not a GPU index list"));
    }
    devices.push_back(d);
  }
  auto moe = ParseMoeParallel(absl::GetFlag(FLAGS_moe_parallel));
  if (!moe.ok()) return Fail(moe.status());
  auto model = OpenModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return Fail(model.status());
  const ModelConfig& c = (*model)->config;
  auto plan = PlanTensorParallel(c, absl::GetFlag(FLAGS_tp), *moe);
  if (!plan.ok()) return Fail(plan.status());
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const std::vector<int32_t> lens =
      bench::MixedLengths(tokens, absl::GetFlag(FLAGS_min_len), absl::GetFlag(FLAGS_max_len), 0);
  const std::vector<int32_t> ids = bench::RandomTokens(tokens, c.vocab_size, 1);
  const std::vector<int32_t> layers = bench::SpacedLayers(c, absl::GetFlag(FLAGS_capture));
  const ForwardInput in{ids, lens, layers};
  CudaEngineOptions opt;
  opt.max_tokens = tokens;
  opt.max_seqs = static_cast<int64_t>(lens.size());
  opt.max_layers = static_cast<int64_t>(layers.size());
  const int iters = absl::GetFlag(FLAGS_iters);
  std::printf("model %s, %lld tokens in %zu sequences, %zu captured layers\n", (*model)->id.c_str(),
              static_cast<long long>(tokens), lens.size(), layers.size());
  std::printf("%s", DescribePlan(*plan, model->get()).c_str());

  double base = 0;
  if (absl::GetFlag(FLAGS_baseline)) {
    opt.device = devices.front();
    auto whole = CudaEngine::Create(model->get(), opt);
    if (!whole.ok()) return Fail(whole.status());
    auto s = MedianSeconds(**whole, in, iters);
    if (!s.ok()) return Fail(s.status());
    base = *s;
    std::printf("unsharded on cuda:%d: median %.1f ms = %.0f tokens/s; weights %.2f GiB\n",
                devices.front(), base * 1e3, tokens / base,
                (*whole)->weight_bytes() / 1073741824.0);
  }
  if (absl::GetFlag(FLAGS_lone_ranks)) {
    double slowest = 0;
    for (int r = 0; r < plan->tp; ++r) {
      auto rank =
          TensorParallelCudaEngine::CreateLoneRank(model->get(), *plan, r, devices.front(), opt);
      if (!rank.ok()) return Fail(rank.status());
      auto s = MedianSeconds(*rank->engine, in, iters);
      if (!s.ok()) return Fail(s.status());
      slowest = std::max(slowest, *s);
      std::printf(
          "  rank %d alone on cuda:%d: median %.1f ms; weights %.2f GiB, workspace %.2f GiB\n", r,
          devices.front(), *s * 1e3, rank->engine->weight_bytes() / 1073741824.0,
          rank->engine->workspace_bytes() / 1073741824.0);
    }
    // Each sum moves [T, hidden] (bf16; the MoE blocks' fp32) once per block.
    const double sum_bytes =
        static_cast<double>(plan->all_reduces.size()) * tokens * c.hidden_size * 2;
    std::printf(
        "slowest rank: %.1f ms = %.0f tokens/s before the sums (%zu all-reduces of "
        "[%lld, %lld], %.1f GB of bf16 in all)",
        slowest * 1e3, tokens / slowest, plan->all_reduces.size(), static_cast<long long>(tokens),
        static_cast<long long>(c.hidden_size), sum_bytes / 1e9);
    if (base > 0) std::printf(", %.2fx the unsharded engine", base / slowest);
    std::printf("\n");
    return 0;
  }
  auto tp = TensorParallelCudaEngine::Create(model->get(), *plan, devices, opt);
  if (!tp.ok()) return Fail(tp.status());
  for (int r = 0; r < plan->tp; ++r) {
    std::printf("  rank %d on cuda:%d: weights %.2f GiB, workspace %.2f GiB\n", r,
                devices[static_cast<size_t>(r)], (*tp)->rank(r).weight_bytes() / 1073741824.0,
                (*tp)->rank(r).workspace_bytes() / 1073741824.0);
  }
  auto s = MedianSeconds(**tp, in, iters);
  if (!s.ok()) return Fail(s.status());
  std::printf("%s (sums: %s): median %.1f ms = %.0f tokens/s", (*tp)->device_name().c_str(),
              (*tp)->all_reduce_kind().c_str(), *s * 1e3, tokens / *s);
  if (base > 0) std::printf(", %.3f of unsharded", base / *s);
  std::printf("\n");
  return 0;
}

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "draftfeed-tp-bench: a tensor-parallel CUDA engine's forward beside the unsharded one.\n"
      "  draftfeed-tp-bench --model random:qwen3.6-35b-a3b --tp 2 --moe_parallel ep "
      "--devices 0,1");
  absl::ParseCommandLine(argc, argv);
  return draftfeed::Run();
}
