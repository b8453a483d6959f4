// The client's transport boundary: how a batch's payload gets from its target
// into the trainer's memory. The stream (gRPC, the control plane) always
// carries Open, the batches, the chunks' envelopes, BatchDone and errors; a
// transport decides where the payload travels and where it lands.
//
// A transport is two objects: ClientTransports, one per feed, offers it in
// each stream's Open; from the target's Opened, the offer makes the stream's
// StreamTransport, which lands each announced chunk through the feed's
// BatchSink. MakeClientTransports (transports.cc) is the one place that picks
// them from FeedOptions::transport. A new transport (CUDA IPC, RDMA) is a
// <name>_transport.{h,cc} pair implementing the three classes below, a case
// in MakeClientTransports and a Transport enumerator in draftfeed/client.h;
// the feed itself does not change.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/src/chunk_reader.h"
#include "common/payload_checksum.h"
#include "draftfeed/client.h"
#include "draftfeed/v1/draftfeed.pb.h"

namespace draftfeed {

class HostBufferPool;

// The feed, as a stream's transport sees it. Thread-safe: each call takes the
// feed's lock itself. `stream` is the key the feed gave the transport.
class BatchSink {
 public:
  virtual ~BatchSink() = default;

  // Where a claimed chunk's bytes go. Held while they land outside the feed's
  // lock, so the streams of one feed receive in parallel.
  struct Landing {
    std::shared_ptr<std::byte> buffer;  // the batch's, kept alive meanwhile
    std::byte* dst = nullptr;           // the chunk's first byte
    uint64_t epoch = 0;                 // the batch's assignment when claimed
    // In order: hash the bytes as they are copied, into `hasher` (a copy of
    // the batch's, stored back by Landed).
    bool hash = false;
    v1::PayloadHasher hasher;
  };
  // Allocates a batch's buffer (`bytes`, in the transport's memory).
  using Acquire = std::function<std::shared_ptr<std::byte>(size_t bytes)>;

  // Claims the tokens of `chunk` (`payload_bytes` long) of a batch on
  // `stream`; the batch's buffer, in `device`'s memory (-1: host), comes from
  // `acquire` on its first claim. nullopt: drop the bytes (the batch is no
  // longer this stream's, or the chunk does not fit it and the batch failed).
  // Until Landed, a BatchDone for the batch waits for the bytes.
  virtual std::optional<Landing> Claim(const void* stream, const ChunkHeader& chunk,
                                       size_t payload_bytes, int device,
                                       const Acquire& acquire) = 0;
  // The claimed bytes are in place (`ok`) or never came (the batch fails as
  // malformed). `landing` null: bytes that were not claimed (only counted).
  // `checksum`: the payload's, when the transport computed it for the whole
  // batch (on the GPU); `recv_ms`: the transfer's own time, 0 if unknown.
  virtual void Landed(const void* stream, const ChunkHeader& chunk, size_t payload_bytes,
                      Landing* landing, bool ok, std::optional<uint64_t> checksum,
                      double recv_ms) = 0;
  // Fails batch `id` with `why` if it is still this stream's.
  virtual void FailBatch(const void* stream, uint64_t id, absl::Status why) = 0;
  // Records why the stream is lost; `cancel`: also end it (its batches go to
  // other targets).
  virtual void StreamBroken(const void* stream, std::string why, bool cancel) = 0;
  virtual bool Closing() const = 0;
};

// What a stream's transport knows of its stream.
struct StreamSlot {
  BatchSink* sink = nullptr;
  const void* stream = nullptr;
  std::string address;          // the target's, for messages
  int64_t bytes_per_token = 0;  // of the capture, from Opened
};

// One stream's data plane, from Opened to the stream's end.
class StreamTransport {
 public:
  virtual ~StreamTransport() = default;
  virtual std::string_view name() const = 0;  // "grpc", "nccl": TargetStats::transport
  // True when the payload's bytes travel in the stream's own messages: the
  // feed then copies them on a thread of its own (FeedOptions::read_handoff).
  virtual bool payload_in_stream() const = 0;
  // A HiddenChunk arrived, in stream order. False: the stream must end.
  virtual bool OnChunk(const Chunk& chunk) = 0;
  // The stream is over: whatever is in flight is dropped and unblocked.
  // Called once, on the stream's reader thread, after its last OnChunk.
  virtual void Abort() = 0;
};

// A transport offered in one stream's Open.
class TransportOffer {
 public:
  virtual ~TransportOffer() = default;
  // Open was sent; the target answers Opened next. (NCCL joins its
  // communicator now: the target joins before it answers.)
  virtual absl::Status Sent() = 0;
  // The target's Opened chose `opened.transport()`: the stream's transport,
  // or why the stream cannot go on.
  virtual absl::StatusOr<std::unique_ptr<StreamTransport>> Accept(const v1::Opened& opened,
                                                                  StreamSlot slot) = 0;
};

// The feed's transports, for every stream it opens.
class ClientTransports {
 public:
  virtual ~ClientTransports() = default;
  // Fills `open`'s transport fields for a stream to `address`.
  virtual absl::StatusOr<std::unique_ptr<TransportOffer>> Offer(const std::string& address,
                                                                v1::Open* open) = 0;
  // Result buffers allocated fresh by the transports' own pools (GPU memory).
  virtual int64_t allocations() const = 0;
};

// The one place a transport is chosen. `host_pool` holds results that land in
// host memory (it outlives the transports).
absl::StatusOr<std::unique_ptr<ClientTransports>> MakeClientTransports(const FeedOptions& options,
                                                                       HostBufferPool* host_pool);

}  // namespace draftfeed
