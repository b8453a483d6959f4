// One StreamHiddenStates stream: reads Open, then Batches (at most its
// credits in flight), hands them to the scheduler, and writes each result
// (through the stream's transport), BatchDone and BatchError in order.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/capture_encoding.h"
#include "draftfeed/v1/draftfeed.pb.h"
#include "server/service/scheduler.h"
#include "server/service/stream_context.h"
#include "server/service/stream_open.h"
#include "server/service/stream_registry.h"
#include "server/service/stream_transport.h"
#include "server/service/target_metrics.h"

namespace draftfeed {

class ReactorLink;

class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                            public RegisteredStream {
 public:
  // `target`: what the stream needs of its target, which outlives it.
  // `token_name`: the name of the bearer token the call carried ("" when the
  // target checks none), shown in the stream's log line.
  StreamReactor(const StreamContext& target, grpc::CallbackServerContext* ctx,
                std::string token_name);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

  // The target drains: no more batches are read.
  void Drain() override;

  // Ends the stream if it has been idle for `timeout` at `now`. Idle: since
  // the later of its last message read, its last write completed and its
  // last result from the scheduler, none has happened; a stream waiting for
  // the engine (batches in the scheduler, nothing of it waiting to be
  // written) or for its transport to open is never idle, and one with a
  // write pending (its client's window is full: it reads what it holds
  // unseen) is idle only after kPendingWriteTimeouts x `timeout`. An idle
  // stream is ended with DEADLINE_EXCEEDED naming --stream_idle_timeout_s,
  // its unsent results dropped and its queued batches cancelled. True when
  // the caller should cancel the call outright: the stream was ended with a
  // write still pending, so not even the status can reach its client.
  bool EndIfIdle(std::chrono::steady_clock::time_point now,
                 std::chrono::steady_clock::duration timeout) override;
  void Cancel() override { ctx_->TryCancel(); }
  // Ends the stream (DEADLINE_EXCEEDED naming --open_timeout_s) if it has
  // sent no Open for `timeout` since it started.
  void EndIfNotOpened(std::chrono::steady_clock::time_point now,
                      std::chrono::steady_clock::duration timeout) override;

  const std::string& token_name() const { return token_name_; }
  // Its credits and waiting result bytes now, for /metrics.
  StreamLoad Load() override;
  // Resumes reading a stream whose refused batches were throttled, once its
  // budget has refilled. Called by the service's housekeeping thread.
  void ResumeIfThrottled(std::chrono::steady_clock::time_point now) override;
  static constexpr double kRejectBurst = 32;
  // How many idle timeouts a stream whose write is pending may go without a
  // completed write (EndIfIdle).
  static constexpr int kPendingWriteTimeouts = 4;

 private:
  friend class ReactorLink;

  // One thing to send: a ready message, or a batch result sent as its
  // payload then BatchDone. `releases_credit` marks the last message of a
  // batch (accepted or rejected).
  struct Outgoing {
    std::optional<v1::StreamResponse> message;
    uint64_t batch_id = 0;
    std::shared_ptr<ForwardResult> result;
    std::unique_ptr<PayloadWriter> payload;
    uint64_t checksum = 0;
    bool releases_credit = false;
    // False for a part of a batch run in several forwards, but its last:
    // its chunks go out with no BatchDone.
    bool last_part = true;
    // Given back to the scheduler's count of the stream's pending bytes once
    // the last message is written.
    int64_t pending_bytes = 0;
    // When the payload's first message was handed to gRPC (send time).
    std::optional<std::chrono::steady_clock::time_point> first_sent;
  };

  // From the link (the scheduler's completion thread, the transport's).
  void OnResult(uint64_t batch_id, int64_t charged, absl::StatusOr<ForwardResult> result,
                uint64_t checksum);
  void OnTransportOpened(TransportOpened opened);
  void OnTransportReady();
  void OnTransportFailed(absl::Status status);
  void OnSend(v1::StreamResponse msg);

  void HandleOpen();
  // Whose share of the streams this one counts against: its token's name
  // when tokens are checked, else the peer's address without the port.
  std::string ClientKey() const;
  void SendOpened(const TransportOpened& opened);
  void HandleRequest();
  // Queues `out` behind what is already waiting to be written.
  void Enqueue(Outgoing out);
  // Queues the BatchError that ends a batch holding a credit and
  // `pending_bytes` of the stream's pending bytes.
  void PushError(uint64_t batch_id, const absl::Status& status, int64_t pending_bytes);
  // Answers a batch that is not run with a BatchError, which holds a credit
  // until it is written.
  void RejectBatch(uint64_t batch_id, const absl::Status& status);
  // Ends the stream with `status` once what is already queued has been sent.
  void FailStream(absl::Status status);
  // Fills raw_resp_ with the next message of the outbox front.
  void NextMessage();
  // The outbox front's last message is written: its credit and pending
  // bytes come back.
  void Settle(const Outgoing& out);
  // Advances the stream: next write, next read, or Finish. Called with mu_ held.
  void Pump();

  const StreamContext& target_;
  grpc::CallbackServerContext* const ctx_;
  const std::string token_name_;
  const std::string peer_;
  const std::chrono::steady_clock::time_point started_;
  const std::shared_ptr<ReactorLink> link_;
  std::unique_ptr<StreamTransport> transport_;  // from Open on
  bool opening_ = false;                        // the transport is not ready yet: no batch is read

  std::mutex mu_;
  grpc::ByteBuffer raw_req_;
  grpc::ByteBuffer raw_resp_;
  v1::StreamRequest req_;
  std::deque<Outgoing> outbox_;
  StreamPlan plan_;  // layers, encoding and target outputs, from Open
  absl::Status finish_status_;
  int32_t credits_ = 0;
  int64_t inflight_ = 0;   // batches (accepted or rejected) whose last message is not yet written
  int64_t scheduled_ = 0;  // batches in the scheduler whose result has not come back
  uint64_t sched_stream_ = 0;  // this stream's queue in the scheduler
  std::chrono::steady_clock::time_point last_activity_;
  // Refused batches: a token bucket of kRejectBurst refilled at
  // max_rejects_per_s; empty, the stream is not read until the service's
  // housekeeping thread finds it refilled (ResumeIfThrottled).
  double reject_tokens_ = kRejectBurst;
  std::chrono::steady_clock::time_point reject_refilled_at_ = std::chrono::steady_clock::now();
  bool reject_paused_ = false;
  int64_t reject_pauses_ = 0;
  void RefillRejects(std::chrono::steady_clock::time_point now);
  std::optional<std::chrono::steady_clock::time_point> idle_ended_at_;
  bool opened_ = false;
  bool read_pending_ = false;
  bool write_pending_ = false;
  bool reads_done_ = false;
  bool draining_ = false;
  bool broken_ = false;
  bool finished_ = false;
  // For the closing log line (from Opened on).
  std::string client_name_;
  v1::Transport transport_kind_ = v1::TRANSPORT_GRPC;
  int64_t batches_served_ = 0;
  int64_t tokens_served_ = 0;
  int64_t payload_bytes_ = 0;
  int64_t batch_errors_ = 0;
};

}  // namespace draftfeed
