// The Engine turns a packed token batch into captured hidden states. Backends:
// the CPU reference (fp32 maths) and CUDA. Nothing here knows of RPC.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/capture_encoding.h"
#include "common/status_macros.h"
#include "common/target_outputs.h"
#include "server/model/model.h"

namespace draftfeed {

// Layer id -1 is the post-final-norm state; 0..L-1 the raw output of decoder
// layer i (transformers' hidden_states[i+1] for i < L-1).
inline constexpr int32_t kFinalLayerId = -1;

struct ForwardInput {
  std::span<const int32_t> token_ids;  // [T]
  std::span<const int32_t> seq_lens;   // sum == T, every entry >= 1
  std::span<const int32_t> layers;     // K capture ids, in output order
  // How the capture is written; an engine refuses one it does not serve.
  CaptureEncoding encoding = CaptureEncoding::kBf16;
  // What the batch asks of lm_head (common/target_outputs.h); null or empty:
  // hidden states only. Each token's outputs follow its K layers in its row.
  // `layers` may then be empty.
  const TargetOutputs* outputs = nullptr;
  bool wants_outputs() const { return outputs != nullptr && !outputs->empty(); }
  // Chunked prefill: a sequence too long for one forward runs over several,
  // in order on one engine, which carries its state (the attention layers'
  // K/V, the GDN recurrent states and conv tails) from one to the next.
  // resume_tokens > 0: the first sequence continues the one this engine
  // carried out of its previous forward, that many tokens in (its positions
  // start there); 0: it starts here.
  int64_t resume_tokens = 0;
  // The last sequence goes on in the next forward: the engine keeps its state.
  bool carry_last = false;
  bool chunked() const { return resume_tokens > 0 || carry_last; }
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual const Model& model() const = 0;
  virtual std::string device_name() const = 0;
  // The capture encodings this engine writes.
  virtual std::vector<CaptureEncoding> encodings() const { return {CaptureEncoding::kBf16}; }
  // Writes the [T, K, H] capture in `in.encoding`, each token's target
  // outputs after its K layers (when asked), into `out`, which must be
  // exactly CaptureBytes(model().config, in) bytes. Input errors are
  // INVALID_ARGUMENT naming the bad field; `out` is then untouched.
  virtual absl::Status Forward(const ForwardInput& in, std::span<std::byte> out) = 0;

  // Forward whose copy to `out` may still be running when it returns, so the
  // caller can start the next batch while this one's capture travels to the
  // host. Returns once the forward itself is done. On OK, `on_copied` runs
  // exactly once, possibly before the return and possibly on another thread,
  // when `out` holds the capture (OK) or the copy failed; `out` must stay
  // valid until then, and `on_copied` must be quick (the engine's next copy
  // waits for it). On an error return `on_copied` is never called. Copies
  // complete in call order. The default is Forward, then `on_copied`.
  struct Copied {
    absl::Status status;
    // The payload's v1::PayloadChecksum when the engine computed it where the
    // capture was (a GPU engine, as part of the copy), so that no host pass
    // over the payload is needed; empty otherwise.
    std::optional<uint64_t> checksum;
  };
  using CopiedCallback = std::function<void(Copied)>;
  virtual absl::Status ForwardAsync(const ForwardInput& in, std::span<std::byte> out,
                                    CopiedCallback on_copied) {
    DF_RETURN_IF_ERROR(Forward(in, out));
    on_copied(Copied{});
    return absl::OkStatus();
  }

  // Most layers one batch may capture (its capture slots); 0 = no limit.
  virtual int64_t max_capture_layers() const { return 0; }

  // Chunked prefill (ForwardInput::resume_tokens, carry_last). The longest
  // sequence the engine can carry: 0 until ReserveCarry, and for engines that
  // cannot (they refuse chunked input with FAILED_PRECONDITION).
  virtual int64_t max_carry_tokens() const { return 0; }
  // Bytes ReserveCarry(tokens) takes: the attention layers' K/V for `tokens`
  // tokens and the GDN layers' states, on the engine's device (host for CPU).
  virtual int64_t CarryBytes(int64_t tokens) const { return 0; }
  // Makes room to carry one sequence of up to `tokens` tokens (a GPU engine
  // allocates it now, so the memory plan holds at start-up);
  // RESOURCE_EXHAUSTED naming the bytes where it cannot.
  virtual absl::Status ReserveCarry(int64_t tokens) {
    return absl::UnimplementedError(device_name() + " cannot carry a sequence across forwards");
  }
  // Forgets the carried sequence (its stream went away mid-sequence); the
  // next chunked input must start afresh. Host memory it held is freed.
  virtual void DropCarry() {}

  // Whether the engine computes target outputs (ForwardInput::outputs): it
  // holds lm_head (a checkpoint's, or the embedding where tied). An engine
  // that cannot refuses a batch asking for them with FAILED_PRECONDITION.
  virtual bool serves_target_outputs() const { return false; }

  // Whether a sequence's rows are the same bits whatever else its batch
  // holds, wherever it sits there, and on every run and restart (TargetInfo.
  // batch_invariant). The CUDA engine's GEMMs, for one, choose no algorithm
  // by the batch's size (tests/server/model/cuda_batch_invariance_test.cc).
  virtual bool batch_invariant() const { return false; }
  // What a row's bits follow beyond the model and the batch (the device kind
  // and the kernels chosen for it): replicas whose strings are equal compute
  // the same bits, so a batch gets the same result whichever runs it.
  virtual std::string numerics() const { return device_name(); }

  // How the engine holds one model instance: over how many ranks (1: the
  // whole model on one device), the MoE strategy of a sharded MoE model ("ep"
  // or "split", else empty), and the decoder weight bytes one rank holds (0:
  // the whole model's, which the service reports from the model).
  struct ParallelLayout {
    int tp = 1;
    std::string moe_parallel;
    int64_t rank_weight_bytes = 0;
  };
  virtual ParallelLayout layout() const { return {}; }

  // The capture while it is still in device memory, for transports that move
  // it GPU to GPU (NCCL). `stream` (a cudaStream_t of the engine's, not the
  // forward's) is ordered after the forward: the sink enqueues its work there
  // and returns at once with a `DeviceWait` that blocks until that work is
  // done. The forward may still be running when the sink is called; the
  // sink must not read the capture from the host side.
  struct DeviceView {
    const void* data = nullptr;  // T rows: [K, H] in `encoding`, then any target outputs
    size_t bytes = 0;            // T * bytes_per_token
    CaptureEncoding encoding = CaptureEncoding::kBf16;
    int64_t bytes_per_token = 0;
    int device = 0;
    void* stream = nullptr;
  };
  // Waits for what the sink enqueued (an NCCL send); its Copied says how that
  // went, with the payload's checksum when the sink took one.
  using DeviceWait = std::function<Copied()>;
  using DeviceSink = std::function<absl::StatusOr<DeviceWait>(const DeviceView&)>;
  // Runs the forward and hands the device-resident capture to `sink`, like
  // ForwardAsync: it returns once the forward is done, while the sink's work
  // (the send) may still be running beside the next forward, which writes
  // the other capture buffer. On OK, `on_sent` runs exactly once, on another
  // thread, after the sink's DeviceWait returned (its Copied, or the
  // forward's error); on an error return nothing was left running and
  // `on_sent` is never called. Engines without device memory (CPU) return
  // UNIMPLEMENTED.
  virtual absl::Status ForwardToDevice(const ForwardInput& in, const DeviceSink& sink,
                                       CopiedCallback on_sent) {
    return absl::UnimplementedError(device_name() + " has no device-resident capture");
  }
  virtual bool has_device_capture() const { return false; }
};

// Validates a ForwardInput against a model (token ids < vocab, lengths, layer
// ids). Shared by every backend and by the service before it queues a batch.
absl::Status ValidateForwardInput(const ModelConfig& config, const ForwardInput& in,
                                  int64_t max_tokens);

// FAILED_PRECONDITION unless `in`'s chunking (resume_tokens, carry_last) fits
// what an engine carries: chunked input at all (max_tokens > 0), a resume at
// exactly the carried length, and the resumed sequence at most max_tokens.
absl::Status CheckCarriedInput(const ForwardInput& in, int64_t carried_tokens, int64_t max_tokens,
                               const std::string& device);
// Tokens an engine carries after a forward of `in`: the last sequence's,
// counting what it resumed when it is the first too; 0 without carry_last.
int64_t TokensCarriedAfter(const ForwardInput& in);

// Bytes of one token's row: CaptureBytesPerToken(in.encoding, K, H), plus its
// target outputs' bytes when asked.
int64_t RowBytesPerToken(const ModelConfig& config, const ForwardInput& in);
// Bytes of `in`'s capture: T * RowBytesPerToken(config, in).
size_t CaptureBytes(const ModelConfig& config, const ForwardInput& in);

// FAILED_PRECONDITION unless `engine` serves the target outputs `in` asks
// for; OK when it asks none.
absl::Status CheckOutputsServed(const Engine& engine, const ForwardInput& in);

// INVALID_ARGUMENT naming the encoding when `engine` does not serve it.
absl::Status CheckEncodingServed(const Engine& engine, CaptureEncoding encoding);

// CheckEncodingServed, then INVALID_ARGUMENT naming both sizes unless
// `out_bytes` is the capture's size.
absl::Status CheckCaptureOutput(const Engine& engine, const ForwardInput& in, size_t out_bytes);

}  // namespace draftfeed
