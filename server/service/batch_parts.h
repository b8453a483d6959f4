// Joins the parts of a batch that ran in several forwards (chunked prefill)
// into what one forward would have delivered: BatchDone's checksum over the
// whole payload, the batch's token count and its timings.
#pragma once

#include <cstdint>
#include <optional>

#include "common/payload_checksum.h"
#include "server/service/scheduler.h"

namespace draftfeed {

class BatchParts {
 public:
  // Takes the batch's next part (in token order) and returns the whole
  // payload's checksum once `part` is the last, which then carries the
  // batch's totals (whole_tokens, queue_ms of the first part, forward_ms
  // summed); nullopt before. A batch of one part keeps a checksum the
  // device computed; parts are hashed here (a part's own checksum is of the
  // part alone).
  std::optional<uint64_t> Add(ForwardResult& part);

  // Set once a part failed: later parts are dropped, not sent.
  bool failed = false;

 private:
  v1::PayloadHasher hasher_;
  int64_t tokens_ = 0;
  double queue_ms_ = 0;
  double forward_ms_ = 0;
};

}  // namespace draftfeed
