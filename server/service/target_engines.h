// The engines behind draftfeed-target: the CPU engine (sharded over threads
// at --tp > 1), or one CUDA instance per --tp consecutive GPUs (a replica of
// one GPU, or a tensor-parallel group), and the GPUs' memory gauges.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <span>

#include "absl/status/statusor.h"
#include "server/model/engine.h"
#include "server/model/sharding_plan.h"
#include "server/service/metrics.h"

namespace draftfeed {

struct TargetEngineOptions {
  std::vector<int> gpus;  // empty: the CPU engine
  int cpu_threads = 0;    // 0 = all cores (split over the ranks)
  int64_t max_batch_tokens = 16384;
  // > max_batch_tokens: each engine reserves the state to carry one sequence
  // this long across forwards (chunked prefill). An engine that cannot is an
  // error when `require_sequence_tokens`, else it serves without chunking.
  int64_t max_sequence_tokens = 0;
  bool require_sequence_tokens = false;
  int64_t max_capture_layers = 8;
  bool fp8_expert_gemms = true;
  std::string fp8_gemm = "auto";  // auto, draftfeed or cublaslt (CudaEngineOptions::Fp8Gemm)
  int load_threads = 0;
};

// Every engine, in --devices order; a tensor-parallel group's start-up lines
// (each rank's weights and workspace, what sums them) go to stderr. Errors
// name the device or rank. gpus.size() must be a multiple of plan.tp.
absl::StatusOr<std::vector<std::unique_ptr<Engine>>> MakeTargetEngines(
    const Model* model, const ShardingPlan& plan, const TargetEngineOptions& options);

// Has every engine reserve what carrying one sequence of max_sequence_tokens
// takes (a line to stderr says how much, where); errors name the flag, the
// device and the bytes.
absl::Status ReserveSequenceCarry(std::span<Engine* const> engines,
                                  const TargetEngineOptions& options);

// draftfeed_gpu_memory_{used,total}_bytes (cudaMemGetInfo: every allocation,
// not only ours) once per distinct GPU of `gpus` (a group's ranks may share
// one). Nothing in a build without CUDA.
void AddGpuMemoryGauges(MetricsRegistry& registry, const std::vector<int>& gpus);

}  // namespace draftfeed
