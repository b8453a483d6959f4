// The gRPC transport's payload: a host capture sent as HiddenChunk messages
// of whole tokens, each its envelope plus a slice that points into the
// capture buffer (gRPC sends it from there; nothing copies the payload).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>

#include <grpcpp/support/byte_buffer.h>

#include "server/service/scheduler.h"
#include "server/service/stream_transport.h"

namespace draftfeed {

class ChunkWriter final : public PayloadWriter {
 public:
  // `chunk_bytes`: payload per chunk, rounded down to whole tokens (one at least).
  ChunkWriter(uint64_t batch_id, std::shared_ptr<ForwardResult> result, int64_t chunk_bytes);
  bool Next(grpc::ByteBuffer* out) override;
  bool exhausted() const override { return next_token_ >= result_->tokens; }

 private:
  const uint64_t batch_id_;
  const std::shared_ptr<ForwardResult> result_;
  const int64_t bytes_per_token_;
  const int64_t tokens_per_chunk_;
  int64_t next_token_ = 0;
  bool started_ = false;
  std::chrono::steady_clock::time_point start_{};
};

}  // namespace draftfeed
