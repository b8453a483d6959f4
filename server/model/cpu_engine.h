// CPU reference engine: fp32 maths over the bf16/fp16/fp32 weights, exactly as
// transformers' modeling defines the model; the oracle for every other backend.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "server/model/engine.h"

namespace draftfeed {

class CpuEngine final : public Engine {
 public:
  // Widens every weight to fp32 once; `model` must outlive the engine.
  static absl::StatusOr<std::unique_ptr<CpuEngine>> Create(const Model* model, int num_threads);
  ~CpuEngine() override;

  const Model& model() const override;
  std::string device_name() const override { return "cpu"; }
  // bf16, and fp8_e4m3 encoded from the fp32 states (one rounding).
  std::vector<CaptureEncoding> encodings() const override {
    return {CaptureEncoding::kBf16, CaptureEncoding::kFp8E4m3};
  }
  absl::Status Forward(const ForwardInput& in, std::span<std::byte> out) override;
  bool serves_target_outputs() const override;
  // Chunked prefill: the carried sequence's state lives on the host and grows
  // with it, up to ReserveCarry's limit (nothing is allocated up front).
  int64_t max_carry_tokens() const override;
  // Every op is row-local or per sequence in a fixed order (goldens_packed_test).
  bool batch_invariant() const override { return true; }
  std::string numerics() const override { return "cpu fp32"; }
  int64_t CarryBytes(int64_t tokens) const override;
  absl::Status ReserveCarry(int64_t tokens) override;
  void DropCarry() override;
  // Same forward, fp32 capture (the residual stream is fp32 throughout here).
  absl::Status ForwardFloat(const ForwardInput& in, std::span<float> out);

 private:
  struct Impl;
  explicit CpuEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace draftfeed
