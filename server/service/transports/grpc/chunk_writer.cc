#include "server/service/transports/grpc/chunk_writer.h"

#include <algorithm>
#include <utility>

#include "common/chunk_envelope.h"
#include "server/service/elapsed.h"

namespace draftfeed {

namespace {

grpc::ByteBuffer ChunkBuffer(const ChunkHeader& header,
                             const std::shared_ptr<ForwardResult>& result, const void* data,
                             size_t bytes) {
  uint8_t head[kMaxChunkEnvelopeBytes];
  const size_t n = EncodeChunkEnvelope(header, bytes, head);
  grpc::Slice slices[2] = {
      grpc::Slice(head, n),
      // gRPC releases the payload slice when the bytes are on the wire; the
      // result buffer lives until then.
      grpc::Slice(
          const_cast<void*>(data), bytes,
          [](void* keep) { delete static_cast<std::shared_ptr<ForwardResult>*>(keep); },
          new std::shared_ptr<ForwardResult>(result))};
  return grpc::ByteBuffer(slices, 2);
}

}  // namespace

ChunkWriter::ChunkWriter(uint64_t batch_id, std::shared_ptr<ForwardResult> result,
                         int64_t chunk_bytes)
    : batch_id_(batch_id),
      result_(std::move(result)),
      bytes_per_token_(result_->bytes_per_token),
      tokens_per_chunk_(
          std::max<int64_t>(1, chunk_bytes / std::max<int64_t>(1, bytes_per_token_))) {}

bool ChunkWriter::Next(grpc::ByteBuffer* out) {
  if (!started_) {
    started_ = true;
    start_ = std::chrono::steady_clock::now();
  }
  ForwardResult& r = *result_;
  if (next_token_ >= r.tokens) {
    r.send_ms = MsSince(start_);
    return false;
  }
  const int64_t count = std::min(tokens_per_chunk_, r.tokens - next_token_);
  const std::byte* base = r.capture.get();
  // A part of a batch run in several forwards starts at its own offset.
  *out = ChunkBuffer({.batch_id = batch_id_,
                      .token_offset = r.token_offset + next_token_,
                      .token_count = count},
                     result_, base + next_token_ * bytes_per_token_,
                     static_cast<size_t>(count * bytes_per_token_));
  next_token_ += count;
  return true;
}

}  // namespace draftfeed
