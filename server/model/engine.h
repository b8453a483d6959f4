// The Engine turns a packed token batch into captured hidden states. Backends:
// CPU reference (fp32 maths) and, later, CUDA. Nothing here knows of RPC.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "server/model/model.h"

namespace draftfeed {

// Layer id -1 is the post-final-norm state; 0..L-1 the raw output of decoder
// layer i (transformers' hidden_states[i+1] for i < L-1).
inline constexpr int32_t kFinalLayerId = -1;

struct ForwardInput {
  std::span<const int32_t> token_ids;  // [T]
  std::span<const int32_t> seq_lens;   // sum == T, every entry >= 1
  std::span<const int32_t> layers;     // K capture ids, in output order
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual const Model& model() const = 0;
  virtual std::string device_name() const = 0;
  // Writes bf16 [T, K, H] into `out` (T*K*H elements). Input errors are
  // INVALID_ARGUMENT naming the bad field; `out` is then untouched.
  virtual absl::Status Forward(const ForwardInput& in, std::span<uint16_t> out) = 0;

  // The capture while it is still in device memory, for transports that move
  // it GPU to GPU (NCCL). Valid only during the sink call; `stream` is the
  // cudaStream_t the forward ran on (the sink orders its work after it and
  // must finish before returning, since the next forward reuses the buffer).
  struct DeviceView {
    const void* data = nullptr;  // bf16 [T, K, H]
    size_t bytes = 0;
    int device = 0;
    void* stream = nullptr;
  };
  using DeviceSink = std::function<absl::Status(const DeviceView&)>;
  // Runs the forward and hands the device-resident capture to `sink`.
  // Engines without device memory (CPU) return UNIMPLEMENTED.
  virtual absl::Status ForwardToDevice(const ForwardInput& in, const DeviceSink& sink) {
    return absl::UnimplementedError(device_name() + " has no device-resident capture");
  }
  virtual bool has_device_capture() const { return false; }
};

// Validates a ForwardInput against a model (token ids < vocab, lengths, layer
// ids). Shared by every backend and by the service before it queues a batch.
absl::Status ValidateForwardInput(const ModelConfig& config, const ForwardInput& in,
                                  int64_t max_tokens);

}  // namespace draftfeed
