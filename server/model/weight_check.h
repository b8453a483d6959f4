// --check_weights: a pass over every weight of a loaded model that refuses
// NaN and infinities, which would otherwise load fine and serve NaN states,
// and for FP8 weights NaN codes (0x7f, 0xff) and block scales that are not
// finite and positive.
#pragma once

#include "absl/status/status.h"
#include "server/model/model.h"

namespace draftfeed {

// Scans every decoder tensor and lm_head in canonical order; the first
// non-finite value fails with INVALID_ARGUMENT naming the model, the tensor,
// the element and the value. Tensors without host data (absent lm_head,
// weights made on the device) are skipped.
absl::Status CheckWeightsFinite(const Model& model);

}  // namespace draftfeed
