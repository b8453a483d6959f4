// The client's side of target outputs (common/target_outputs.h): the options
// checked and turned into the wire's spec, and the offsets a HiddenBatch
// reads them at.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/target_outputs.h"
#include "draftfeed/client.h"

namespace draftfeed {

// INVALID_ARGUMENT naming the FeedOptions field for what no target could
// serve (top_k outside [0, 256], more than 65,536 draft ids, an id below 0 or
// listed twice, a probs encoding other than bf16 / fp8_e4m3). The vocabulary
// bound is the target's to check.
absl::StatusOr<TargetOutputs> CheckedTargetOutputs(const TargetOutputOptions& options);

// The public offsets of `layout` within a row whose hidden states take
// `hidden_bytes` bytes.
TargetOutputOffsets RowOffsets(const TargetOutputs& outputs, const TargetOutputsLayout& layout,
                               int64_t hidden_bytes);

}  // namespace draftfeed
