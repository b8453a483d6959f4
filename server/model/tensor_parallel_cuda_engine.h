// Tensor parallelism on GPUs: one model instance over tp GPUs (or, to prove
// a plan on one GPU, tp ranks sharing it), one CudaEngine per rank holding
// its ShardingPlan slices, the partial block outputs summed by a
// DeviceAllReduce (NCCL across GPUs) after every mixer and MLP. Each forward
// runs every rank on its own thread; the capture is written and sent by the
// plan's capture rank alone.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/model/cuda_engine.h"
#include "server/model/sharding_plan.h"

namespace draftfeed {

class TensorParallelCudaEngine final : public Engine {
 public:
  // Slices `model` for every rank (views into its mapped files where the part
  // is contiguous) and creates rank r's CudaEngine on devices[r] with
  // `options` (its device and rank fields are set here). Real-size random
  // models draw every rank's slices on its GPU, from seeds of the rank's
  // own (benchmarks: the states differ from the unsharded model's, and
  // model().fingerprint carries a "+tpN" suffix saying so). FP8 models are refused
  // (their block scales would have to be cut with the weights). `model`
  // must outlive the engine.
  static absl::StatusOr<std::unique_ptr<TensorParallelCudaEngine>> Create(
      const Model* model, ShardingPlan plan, const std::vector<int>& devices,
      const CudaEngineOptions& options);
  ~TensorParallelCudaEngine() override;

  const Model& model() const override;
  std::string device_name() const override;  // "cuda:0,1 tp2"
  ParallelLayout layout() const override;
  std::vector<CaptureEncoding> encodings() const override;
  int64_t max_capture_layers() const override;
  // The capture rank's: it computes the target outputs with the whole lm_head.
  bool serves_target_outputs() const override;
  // Chunked prefill: every rank carries its own heads' K/V and GDN states
  // (each forward runs on all ranks with the same resume_tokens/carry_last).
  int64_t max_carry_tokens() const override;
  // Ranks on one GPU sum in a fixed order; NCCL's all-reduce splits the
  // message by its size, so an element's summation order follows the batch.
  bool batch_invariant() const override { return all_reduce_kind() != "nccl"; }
  int64_t CarryBytes(int64_t tokens) const override;  // all ranks together
  absl::Status ReserveCarry(int64_t tokens) override;
  void DropCarry() override;
  absl::Status Forward(const ForwardInput& in, std::span<std::byte> out) override;
  absl::Status ForwardAsync(const ForwardInput& in, std::span<std::byte> out,
                            CopiedCallback on_copied) override;
  absl::Status ForwardToDevice(const ForwardInput& in, const DeviceSink& sink,
                               CopiedCallback on_sent) override;
  bool has_device_capture() const override { return true; }
  // Every rank's forward, the capture left in the capture rank's device
  // memory (benchmarks of the forward alone).
  absl::Status ForwardOnDevice(const ForwardInput& in);

  // One rank of `plan` alone on `device`, summing with no one: its block
  // outputs stay partial, so its forward times a rank's own work (the MoE
  // strategies' per-rank cost at shapes two ranks of which do not fit one
  // GPU) and its values are not the model's. For benchmarks.
  struct LoneRank {
    RankWeights slices;
    std::unique_ptr<Model> model;
    std::unique_ptr<CudaEngine> engine;  // declared last: destroyed first
  };
  static absl::StatusOr<LoneRank> CreateLoneRank(const Model* model, const ShardingPlan& plan,
                                                 int rank, int device,
                                                 const CudaEngineOptions& options);

  const ShardingPlan& plan() const;
  const CudaEngine& rank(int r) const;
  // What sums the ranks' partials: "nccl", "one-device kernel" or "none".
  std::string all_reduce_kind() const;

 private:
  struct Impl;
  explicit TensorParallelCudaEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace draftfeed
