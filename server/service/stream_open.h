// What a stream's Open asks, checked against the target once: the model it
// expects, the encoding, the transport value, the layers and the credits.
// A refusal ends that stream only; the target keeps serving.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "common/capture_encoding.h"
#include "common/target_outputs.h"
#include "draftfeed/v1/draftfeed.pb.h"
#include "server/service/stream_context.h"

namespace draftfeed {

// The longest Open.client_name a stream may give.
inline constexpr size_t kMaxClientNameBytes = 128;

struct StreamPlan {
  std::vector<int32_t> layers;  // the stream's default capture layers
  CaptureEncoding encoding = CaptureEncoding::kBf16;
  // What the stream asks of lm_head, checked; null when nothing. Shared by
  // every batch of the stream (a draft vocabulary is up to 256 KiB).
  std::shared_ptr<const TargetOutputs> outputs;
  int32_t credits = 0;  // batches in flight at once
};

// INVALID_ARGUMENT: a client_name over kMaxClientNameBytes or holding a
// control character; FAILED_PRECONDITION: another model, or target outputs asked of a target
// without lm_head; INVALID_ARGUMENT: an encoding the target does not serve,
// bad layers or bad target outputs (naming the field); UNIMPLEMENTED: an
// unknown transport.
absl::StatusOr<StreamPlan> PlanStream(const StreamContext& target, const v1::Open& open);

// What one Batch on a stream of `stream_layers` and `encoding` asks the engine: its tokens,
// lengths and layers (the stream's when the batch names none), checked
// against the model, the token budget and the capture-layer limit. Errors
// are the batch's alone ("batch 7: ..."), INVALID_ARGUMENT naming the field.
struct BatchPlan {
  std::vector<int32_t> token_ids;
  std::vector<int32_t> seq_lens;
  std::vector<int32_t> layers;
  CaptureEncoding encoding = CaptureEncoding::kBf16;
  std::shared_ptr<const TargetOutputs> outputs;
};
absl::StatusOr<BatchPlan> PlanBatch(const StreamContext& target, const StreamPlan& stream,
                                    const v1::Batch& batch);

}  // namespace draftfeed
