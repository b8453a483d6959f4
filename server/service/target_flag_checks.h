// draftfeed-target's numeric and named flag values, checked before anything
// loads: a value that would make every batch fail, overflow a clock or a byte
// count, or that means nothing, stops start-up naming the flag and its limit.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace draftfeed {

absl::Status CheckTargetFlags();

// --device / --devices: the GPUs to serve on (empty: the CPU engine); a
// malformed value, or a GPU asked of a build without CUDA, fails naming it.
absl::StatusOr<std::vector<int>> GpusFromFlags();

}  // namespace draftfeed
