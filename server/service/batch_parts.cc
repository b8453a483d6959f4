#include "server/service/batch_parts.h"

namespace draftfeed {

std::optional<uint64_t> BatchParts::Add(ForwardResult& part) {
  if (part.token_offset == 0 && part.last_part) {  // the batch in one forward
    return part.checksum.has_value() ? *part.checksum
                                     : v1::PayloadChecksum(part.capture.get(), part.bytes);
  }
  if (tokens_ == 0) queue_ms_ = part.queue_ms;
  hasher_.Update(part.capture.get(), part.bytes);
  tokens_ += part.tokens;
  forward_ms_ += part.forward_ms;
  if (!part.last_part) return std::nullopt;
  part.whole_tokens = tokens_;
  part.queue_ms = queue_ms_;
  part.forward_ms = forward_ms_;
  return hasher_.Finish();
}

}  // namespace draftfeed
