// draftfeed-target's numeric and named flag values, checked before anything
// loads: a value that would make every batch fail, overflow a clock or a byte
// count, or that means nothing, stops start-up naming the flag and its limit.
#pragma once

#include "absl/status/status.h"

namespace draftfeed {

absl::Status CheckTargetFlags();

}  // namespace draftfeed
