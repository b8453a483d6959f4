// The server side of a transport: what carries one stream's captures to its
// trainer. The gRPC transport sends them as HiddenChunk messages on the stream
// itself; the NCCL transport sends them GPU to GPU and puts only an
// announcement on the stream. The stream's reactor holds one StreamTransport,
// made by OpenStreamTransport (transport_registry.h), and never asks which.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/nccl_hosts.h"
#include "draftfeed/v1/draftfeed.pb.h"
#include "server/model/engine.h"
#include "server/service/scheduler.h"

namespace draftfeed {

// What a stream's Opened says about its transport.
struct TransportOpened {
  v1::Transport transport = v1::TRANSPORT_GRPC;  // Opened.transport
  std::string note;                              // Opened.transport_note
  bool ready = true;          // false: batches wait until the transport reports Ready
  bool across_hosts = false;  // Opened.nccl_across_hosts
};

// How a transport reports to its stream from its own threads (setup, the
// scheduler's sink and completion callbacks). It outlives the stream's
// reactor: once the stream has ended, reports are dropped.
class StreamLink {
 public:
  virtual ~StreamLink() = default;
  // True once the stream has ended or its client went away: waits give up.
  virtual bool cancelled() const = 0;
  // Opened goes out; batches are read once `opened.ready` or Ready().
  virtual void Opened(TransportOpened opened) = 0;
  virtual void Ready() = 0;
  // Queues `msg` on the stream; false when the stream is gone.
  virtual bool Send(v1::StreamResponse msg) = 0;
  // Ends the stream with `status` once what is queued has been sent.
  virtual void Fail(absl::Status status) = 0;
};

// Writes one delivered capture onto the stream, one message per call.
class PayloadWriter {
 public:
  virtual ~PayloadWriter() = default;
  // The next message into `out`; false when the payload is all written, and
  // then `result.send_ms` holds the time it took (BatchDone follows).
  virtual bool Next(grpc::ByteBuffer* out) = 0;
  // True once Next has handed out the last message (a part of a batch in
  // several forwards is done then: no empty Next call follows it).
  virtual bool exhausted() const { return false; }
};

// One stream's transport. Start, Post and WritePayload are called by the
// stream's reactor under its lock, so none may call back into the link
// before returning. The destructor ends whatever the transport still runs
// (joins its threads); the link is cancelled by then.
class StreamTransport {
 public:
  virtual ~StreamTransport() = default;

  // Opens the transport: returns what Opened says when it is open now, or
  // nullopt when it reports through the link later (Opened, then Ready; or
  // Fail).
  virtual std::optional<TransportOpened> Start() = 0;

  // Readies `item`, batch `batch_id` of the stream, to carry its capture by
  // this transport. `item.done` is set (it delivers to the stream); a
  // transport may wrap it.
  virtual void Post(uint64_t batch_id, WorkItem& item) = 0;

  // What goes on the stream for a delivered batch before its BatchDone, or
  // null when nothing does (the capture travelled another way).
  virtual std::unique_ptr<PayloadWriter> WritePayload(uint64_t batch_id,
                                                      std::shared_ptr<ForwardResult> result) = 0;
};

// What transports need of their target.
struct TransportEnv {
  std::span<Engine* const> engines;  // replicas of one model
  int64_t chunk_bytes = 4 << 20;     // payload per HiddenChunk (whole tokens)
  bool enable_nccl = true;
  double nccl_timeout_s = 120.0;       // each batch's send
  double nccl_setup_timeout_s = 60.0;  // a stream's NCCL set-up and handshake
  bool nccl_across_hosts = true;       // NCCL for trainers on other hosts too
  HostIdentity host;                   // this target's, compared with Open.host_id
};

}  // namespace draftfeed
