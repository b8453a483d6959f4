// Tensor parallelism on the CPU: tp ranks on threads, each running the CPU
// reference forward over its ShardingPlan slices, the all-reduce an
// in-process sum. It runs the same plan as a multi-GPU engine, so tests
// prove the plan where there is no second GPU.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "server/model/engine.h"
#include "server/model/sharding_plan.h"

namespace draftfeed {

class ShardedCpuEngine final : public Engine {
 public:
  // Slices and widens every rank's weights; `model` must outlive the engine.
  // num_threads (0 = all cores) is split evenly over the ranks, each at
  // least one.
  static absl::StatusOr<std::unique_ptr<ShardedCpuEngine>> Create(const Model* model,
                                                                  ShardingPlan plan,
                                                                  int num_threads);
  ~ShardedCpuEngine() override;

  const Model& model() const override;
  std::string device_name() const override;  // "cpu tp2"
  ParallelLayout layout() const override;
  // As CpuEngine: bf16, and fp8_e4m3 encoded from the fp32 states.
  std::vector<CaptureEncoding> encodings() const override {
    return {CaptureEncoding::kBf16, CaptureEncoding::kFp8E4m3};
  }
  absl::Status Forward(const ForwardInput& in, std::span<std::byte> out) override;
  // The capture rank computes them with the whole lm_head (the vocabulary is
  // not cut across ranks).
  bool serves_target_outputs() const override;
  // Chunked prefill: each rank carries its heads' share, on the host.
  int64_t max_carry_tokens() const override;
  // The ranks are CPU engines and their partials are summed in rank order.
  bool batch_invariant() const override { return true; }
  // Partials summed over tp ranks are other bits than one rank's sums.
  std::string numerics() const override { return "cpu fp32 tp" + std::to_string(layout().tp); }
  int64_t CarryBytes(int64_t tokens) const override;
  absl::Status ReserveCarry(int64_t tokens) override;
  void DropCarry() override;
  // Same forward, fp32 capture (rank 0's residual stream).
  absl::Status ForwardFloat(const ForwardInput& in, std::span<float> out);

  const ShardingPlan& plan() const;

 private:
  struct Impl;
  explicit ShardedCpuEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace draftfeed
