// CUDA engine: bf16 weights on one GPU, cuBLASLt GEMMs (bf16 in, fp32
// accumulate), kernels/ ops, an fp32 residual stream, and one workspace sized
// at start-up from the token budget (no allocation on the hot path).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/host_buffer_pool.h"
#include "server/model/engine.h"
#include "server/model/weight_layout.h"

namespace draftfeed {

class DeviceAllReduce;  // server/model/device_all_reduce.h

// One rank of a tensor-parallel group (TensorParallelCudaEngine): the engine's
// model then holds the rank's slices, with ShardingPlan::rank_config as its
// config. The defaults are a whole model on one GPU.
struct CudaRankOptions {
  int rank = 0;
  // Sums the ranks' partial block outputs after every mixer and MLP (the
  // plan's all_reduces); null for a single rank.
  DeviceAllReduce* all_reduce = nullptr;
  // The routed experts this rank evaluates, [expert_begin, expert_begin +
  // num_local_experts) of the config's num_experts (the router still scores
  // all of them); 0 = all.
  int64_t expert_begin = 0;
  int64_t num_local_experts = 0;
  // The rank's tensor shapes in DecoderWeightSpecs order (an expert-parallel
  // rank's experts are fewer than its config says); empty = the config's.
  std::vector<WeightSpec> specs;
  // Whether this rank writes the capture. The group's other ranks reserve no
  // capture buffers and skip the capture writes.
  bool capture = true;
};

struct CudaEngineOptions {
  int device = 0;
  int64_t max_tokens = 16384;  // token budget: sizes the workspace
  int64_t max_seqs = 4096;     // sequences per batch
  // Capture slots (layers one batch may capture); 0 = num_layers + 1. Two
  // capture buffers of max_tokens x max_layers x hidden bf16 are reserved
  // (one is copied to the host while the next forward fills the other).
  int64_t max_layers = 0;
  bool profile = false;  // time every op family (adds syncs; benchmarks only)
  // FP8 models: the routed experts through the FP8 grouped GEMMs (the FP8
  // engine's maths, half the expert memory), or dequantized to bf16 at load
  // for the bf16 grouped GEMMs (bf16 activations; faster on the H200:
  // docs/performance.md).
  bool fp8_expert_gemms = true;
  // FP8 models: the GEMM behind the dense FP8 projections (ChooseFp8Gemm,
  // cuda_device.h). kAuto: draftfeed's Hopper kernel (kernels/hopper_gemm.cuh)
  // where it runs (a little faster than cuBLASLt's at the 27B's shapes:
  // docs/performance.md), else cuBLASLt's block-scaled mode on sm_90, and
  // draftfeed's portable kernel (kernels/fp8_gemm_portable.cuh) on other GPUs
  // and under DRAFTFEED_PORTABLE_KERNELS; kCublasLt: cuBLASLt's, refused at creation
  // where it does not serve block scales; kDraftfeed: draftfeed's Hopper
  // kernel (kernels/hopper_gemm.cuh) where it runs, else the portable one.
  // The MoE experts take the Hopper kernel wherever it runs, whatever this says.
  enum class Fp8Gemm { kAuto, kDraftfeed, kCublasLt };
  Fp8Gemm fp8_gemm = Fp8Gemm::kAuto;
  // Weight upload: reader threads (0 = DefaultReadThreads()) filling pinned
  // chunks of load_chunk_bytes (a multiple of 4096) while earlier chunks copy.
  int load_threads = 0;
  size_t load_chunk_bytes = 16 << 20;
  CudaRankOptions rank;
};

struct OpTimes {
  // Milliseconds per op family over the last Forward when profiling.
  std::vector<std::pair<std::string, double>> ms;
};

class CudaEngine final : public Engine {
 public:
  // Uploads (or, for real-size random models, generates) the weights once.
  static absl::StatusOr<std::unique_ptr<CudaEngine>> Create(const Model* model,
                                                            const CudaEngineOptions& options);
  ~CudaEngine() override;

  const Model& model() const override;
  std::string device_name() const override;
  // Runs the forward and copies the [T, K, H] capture to host memory.
  absl::Status Forward(const ForwardInput& in, std::span<std::byte> out) override;
  // Runs the forward, then copies the capture on a copy stream while the next
  // forward fills the other capture buffer. `out` should be pinned
  // (PinnedHostAllocator); pageable memory works but the copy then blocks.
  // `on_copied` runs on the engine's copy thread.
  absl::Status ForwardAsync(const ForwardInput& in, std::span<std::byte> out,
                            CopiedCallback on_copied) override;
  // Runs the forward only, the capture left in device memory (for benchmarks
  // of the forward alone).
  absl::Status ForwardOnDevice(const ForwardInput& in);
  absl::Status ForwardToDevice(const ForwardInput& in, const DeviceSink& sink,
                               CopiedCallback on_sent) override;
  bool has_device_capture() const override { return true; }
  // bf16, and fp8_e4m3 encoded on the GPU from the bf16 capture.
  std::vector<CaptureEncoding> encodings() const override;
  int64_t max_capture_layers() const override;
  // Where the model has lm_head (or ties it to the embedding): uploaded on
  // the first batch that asks for target outputs.
  bool serves_target_outputs() const override;
  // Chunked prefill: ReserveCarry allocates the K/V of `tokens` tokens per
  // attention layer and the GDN layers' states now (cuda_sequence_carry.cc).
  int64_t max_carry_tokens() const override;
  bool batch_invariant() const override { return true; }
  // The GPU's name and SM count (cuBLASLt's heuristics follow both) and the
  // FP8 GEMM serving the projections.
  std::string numerics() const override;
  int64_t CarryBytes(int64_t tokens) const override;
  absl::Status ReserveCarry(int64_t tokens) override;
  void DropCarry() override;

  int64_t weight_bytes() const;
  int64_t workspace_bytes() const;
  // An FP8 model's device buffers by how they run: through FP8 GEMMs, or
  // dequantized to bf16 at load (the routed experts). Both 0 for bf16 models.
  struct Fp8Layout {
    int64_t gemm_buffers = 0, dequantized_buffers = 0;
  };
  Fp8Layout fp8_layout() const;
  const OpTimes& last_op_times() const;
  // Times every op family (syncs after each op: for benchmarks only).
  void set_profile(bool on);

 private:
  struct Impl;
  explicit CudaEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Number of CUDA devices (0 when there is no driver or GPU).
int CudaDeviceCount();

// Page-locked host memory (cudaHostAlloc, portable to every device) for the
// target's capture buffers: device-to-host copies into it run at full
// bandwidth and overlap the next forward.
HostAllocator PinnedHostAllocator();

}  // namespace draftfeed
