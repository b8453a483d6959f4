#include "server/service/target_engines.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/log_line.h"
#include "common/status_macros.h"
#include "server/model/cpu_engine.h"
#include "server/model/sharded_cpu_engine.h"
#if DRAFTFEED_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "server/model/cuda_engine.h"
#include "server/model/tensor_parallel_cuda_engine.h"
#endif

namespace draftfeed {

absl::StatusOr<std::vector<std::unique_ptr<Engine>>> MakeTargetEngines(
    const Model* model, const ShardingPlan& plan, const TargetEngineOptions& options) {
  std::vector<std::unique_ptr<Engine>> engines;
  const int tp = plan.tp;
  if (options.gpus.empty()) {
    if (tp > 1) {
      DF_ASSIGN_OR_RETURN(engines.emplace_back(),
                          ShardedCpuEngine::Create(model, plan, options.cpu_threads));
    } else {
      DF_ASSIGN_OR_RETURN(engines.emplace_back(), CpuEngine::Create(model, options.cpu_threads));
    }
    return engines;
  }
#if DRAFTFEED_HAVE_CUDA
  CudaEngineOptions copt;
  copt.max_tokens = options.max_batch_tokens;
  copt.max_seqs = std::min<int64_t>(copt.max_tokens, 4096);
  copt.max_layers = options.max_capture_layers;
  copt.fp8_expert_gemms = options.fp8_expert_gemms;
  using Fp8Gemm = CudaEngineOptions::Fp8Gemm;
  copt.fp8_gemm = options.fp8_gemm == "draftfeed"  ? Fp8Gemm::kDraftfeed
                  : options.fp8_gemm == "cublaslt" ? Fp8Gemm::kCublasLt
                                                   : Fp8Gemm::kAuto;
  copt.load_threads = options.load_threads;
  const std::vector<int>& gpus = options.gpus;
  for (size_t first = 0; first < gpus.size(); first += static_cast<size_t>(tp)) {
    if (tp == 1) {
      copt.device = gpus[first];
      absl::StatusOr<std::unique_ptr<CudaEngine>> engine = CudaEngine::Create(model, copt);
      if (!engine.ok()) {
        return absl::Status(engine.status().code(),
                            absl::StrCat("cuda:", gpus[first], ": ", engine.status().message()));
      }
      engines.push_back(*std::move(engine));
      continue;
    }
    const std::vector<int> group(gpus.begin() + static_cast<std::ptrdiff_t>(first),
                                 gpus.begin() + static_cast<std::ptrdiff_t>(first + tp));
    DF_ASSIGN_OR_RETURN(std::unique_ptr<TensorParallelCudaEngine> engine,
                        TensorParallelCudaEngine::Create(model, plan, group, copt));
    for (int r = 0; r < tp; ++r) {
      const CudaEngine& rank = engine->rank(r);
      LogF(
          "draftfeed-target: %s rank %d on cuda:%d: %.2f GiB weights + %.2f GiB "
          "workspace%s",
          engine->device_name().c_str(), r, group[static_cast<size_t>(r)],
          static_cast<double>(rank.weight_bytes()) / (1 << 30),
          static_cast<double>(rank.workspace_bytes()) / (1 << 30),
          r == 0 ? absl::StrCat(", partial sums by ", engine->all_reduce_kind()).c_str() : "");
    }
    engines.push_back(std::move(engine));
  }
  return engines;
#else
  return absl::FailedPreconditionError(
      "this build has no CUDA engine (built without nvcc); use --device=cpu");
#endif
}

absl::Status ReserveSequenceCarry(std::span<Engine* const> engines,
                                  const TargetEngineOptions& options) {
  const int64_t tokens = options.max_sequence_tokens;
  if (tokens <= options.max_batch_tokens) return absl::OkStatus();
  for (Engine* e : engines) {
    const absl::Status s = e->ReserveCarry(tokens);
    if (s.ok()) {
      LogF(
          "draftfeed-target: %s carries one sequence of up to %lld tokens across "
          "forwards of %lld: %.2f GiB",
          e->device_name().c_str(), static_cast<long long>(tokens),
          static_cast<long long>(options.max_batch_tokens),
          static_cast<double>(e->CarryBytes(tokens)) / (1 << 30));
      continue;
    }
    if (s.code() == absl::StatusCode::kUnimplemented && !options.require_sequence_tokens) {
      LogF("draftfeed-target: %s: %s; batches are limited to --max_batch_tokens=%lld",
           e->device_name().c_str(), std::string(s.message()).c_str(),
           static_cast<long long>(options.max_batch_tokens));
      continue;
    }
    return absl::Status(
        s.code(), absl::StrCat("--max_sequence_tokens=", tokens, ": ", e->device_name(), ": ",
                               s.message(), "; lower --max_sequence_tokens (to ",
                               options.max_batch_tokens, " for no chunked prefill)"));
  }
  return absl::OkStatus();
}

void AddGpuMemoryGauges(MetricsRegistry& registry, const std::vector<int>& gpus) {
#if DRAFTFEED_HAVE_CUDA
  std::vector<int> distinct;
  for (int g : gpus) {
    if (std::find(distinct.begin(), distinct.end(), g) == distinct.end()) distinct.push_back(g);
  }
  for (int g : distinct) {
    const std::string name = absl::StrCat("cuda:", g);
    const auto sample = [g, name](bool used) {
      size_t free_b = 0, total_b = 0;
      int prev = 0;
      cudaGetDevice(&prev);
      cudaSetDevice(g);
      const bool ok = cudaMemGetInfo(&free_b, &total_b) == cudaSuccess;
      cudaSetDevice(prev);
      if (!ok) return std::vector<GaugeSample>{};
      return std::vector<GaugeSample>{
          {.labels = {{"device", name}},
           .value = static_cast<double>(used ? total_b - free_b : total_b)}};
    };
    registry.AddGaugeCallback("draftfeed_gpu_memory_used_bytes",
                              "Device memory in use (cudaMemGetInfo), per GPU.",
                              [sample] { return sample(true); });
    registry.AddGaugeCallback("draftfeed_gpu_memory_total_bytes",
                              "Device memory (cudaMemGetInfo), per GPU.",
                              [sample] { return sample(false); });
  }
#else
  (void)registry;
  (void)gpus;
#endif
}

}  // namespace draftfeed
