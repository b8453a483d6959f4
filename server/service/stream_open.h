// What a stream's Open asks, checked against the target once: the model it
// expects, the encoding, the transport value, the layers and the credits.
// A refusal ends that stream only; the target keeps serving.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/capture_encoding.h"
#include "draftfeed/v1/draftfeed.pb.h"

namespace draftfeed {

class TargetService;

struct StreamPlan {
  std::vector<int32_t> layers;  // the stream's default capture layers
  CaptureEncoding encoding = CaptureEncoding::kBf16;
  int32_t credits = 0;  // batches in flight at once
};

// FAILED_PRECONDITION: another model; INVALID_ARGUMENT: an encoding the
// target does not serve, or bad layers; UNIMPLEMENTED: an unknown transport.
absl::StatusOr<StreamPlan> PlanStream(const TargetService& service, const v1::Open& open);

}  // namespace draftfeed
