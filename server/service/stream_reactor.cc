#include "server/service/stream_reactor.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <utility>

#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/strings/str_cat.h"
#include "common/payload_checksum.h"
#include "server/service/batch_parts.h"
#include "server/service/call_auth.h"
#include "server/service/status_util.h"
#include "server/model/model.h"
#include "server/service/service_options.h"
#include "server/service/stream_open.h"
#include "server/service/transport_registry.h"

namespace draftfeed {

using v1::StreamRequest;
using v1::StreamResponse;

// Lets scheduler callbacks and the transport reach a reactor that may already
// be gone: OnDone clears `reactor` under `mu` before the reactor deletes itself.
class ReactorLink final : public StreamLink {
 public:
  explicit ReactorLink(StreamReactor* r) : reactor(r) {}

  bool cancelled() const override { return cancelled_flag.load(); }
  void Opened(TransportOpened opened) override {
    std::lock_guard<std::mutex> lock(mu);
    if (reactor != nullptr) reactor->OnTransportOpened(std::move(opened));
  }
  void Ready() override {
    std::lock_guard<std::mutex> lock(mu);
    if (reactor != nullptr) reactor->OnTransportReady();
  }
  bool Send(StreamResponse msg) override {
    std::lock_guard<std::mutex> lock(mu);
    if (reactor == nullptr) return false;
    reactor->OnSend(std::move(msg));
    return true;
  }
  void Fail(absl::Status status) override {
    std::lock_guard<std::mutex> lock(mu);
    if (reactor != nullptr) reactor->OnTransportFailed(std::move(status));
  }

  // Called on the scheduler's completion thread (the engine has moved on to
  // the next batch), once per part of the batch (BatchParts). A GPU engine
  // has already checksummed a batch of one forward on the device; otherwise
  // (a CPU engine, a batch in parts) the pass over it runs here.
  void Deliver(uint64_t batch_id, int64_t charged, absl::StatusOr<ForwardResult> result,
               BatchParts& parts) {
    if (parts.failed) return;  // the batch's error has gone out
    uint64_t checksum = 0;
    if (!result.ok()) {
      parts.failed = true;
    } else if (std::optional<uint64_t> whole = parts.Add(*result); whole.has_value()) {
      checksum = *whole;
    }
    std::lock_guard<std::mutex> lock(mu);
    if (reactor == nullptr) return;
    reactor->OnResult(batch_id, charged, std::move(result), checksum);
  }

  std::mutex mu;
  StreamReactor* reactor = nullptr;
  std::atomic<bool> cancelled_flag{false};
};

namespace {

grpc::ByteBuffer Serialize(const StreamResponse& msg) {
  const std::string bytes = msg.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

StreamResponse DoneMessage(uint64_t batch_id, const ForwardResult& r, uint64_t checksum) {
  StreamResponse msg;
  v1::BatchDone* done = msg.mutable_done();
  done->set_batch_id(batch_id);
  done->set_tokens(r.batch_tokens());
  done->set_checksum(checksum);
  done->mutable_timings()->set_queue_ms(r.queue_ms);
  done->mutable_timings()->set_forward_ms(r.forward_ms);
  done->mutable_timings()->set_send_ms(r.send_ms);
  return msg;
}

}  // namespace

StreamReactor::StreamReactor(const StreamContext& target, grpc::CallbackServerContext* ctx,
                             std::string token_name)
    : target_(target),
      ctx_(ctx),
      token_name_(std::move(token_name)),
      peer_(ctx->peer()),
      started_(std::chrono::steady_clock::now()),
      link_(std::make_shared<ReactorLink>(this)),
      sched_stream_(target.scheduler.AddStream(target.options.max_stream_pending_bytes)),
      last_activity_(std::chrono::steady_clock::now()) {
  target_.streams.Register(this);
  std::lock_guard<std::mutex> lock(mu_);
  Pump();
}

void StreamReactor::OnReadDone(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  read_pending_ = false;
  last_activity_ = std::chrono::steady_clock::now();
  if (idle_ended_at_.has_value()) {  // ended while the read was pending: nothing more is read
    Pump();
    return;
  }
  if (ok) {
    grpc::ProtoBufferReader reader(&raw_req_);
    req_.Clear();
    if (!req_.ParseFromZeroCopyStream(&reader)) {
      FailStream(absl::InvalidArgumentError("malformed StreamRequest (protobuf parse failed)"));
      Pump();
      return;
    }
  }
  if (!ok) {
    reads_done_ = true;
  } else if (!opened_) {
    HandleOpen();
  } else {
    HandleRequest();
  }
  Pump();
}

void StreamReactor::OnWriteDone(bool ok) {
  std::lock_guard<std::mutex> lock(mu_);
  write_pending_ = false;
  last_activity_ = std::chrono::steady_clock::now();
  if (!ok) {
    // The client is gone; nothing more can be sent. Queued batches skip.
    broken_ = true;
    link_->cancelled_flag = true;
    outbox_.clear();
  }
  Pump();
}

void StreamReactor::OnCancel() {
  std::lock_guard<std::mutex> lock(mu_);
  broken_ = true;
  link_->cancelled_flag = true;
  outbox_.clear();
  Pump();
}

void StreamReactor::OnDone() {
  {
    // No callback runs after this one: the members are final.
    std::lock_guard<std::mutex> lock(mu_);
    StreamSummary s{
        .peer = peer_,
        .client_name = client_name_,
        .token_name = token_name_,
        .refused = !opened_ && !broken_ && !finish_status_.ok(),
        .transport = transport_kind_,
        .layers = plan_.layers,
        .encoding = static_cast<v1::Encoding>(plan_.encoding),
        .batches = batches_served_,
        .tokens = tokens_served_,
        .payload_bytes = payload_bytes_,
        .batch_errors = batch_errors_,
        .seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count()};
    if (idle_ended_at_.has_value()) {
      s.status = finish_status_;  // cut as idle, even when the call was cancelled for it
    } else if (broken_) {
      s.status = absl::CancelledError("client went away");
    } else if (!finish_status_.ok()) {
      s.status = finish_status_;
    } else if ((draining_ || target_.draining.load()) && !reads_done_) {
      s.status = absl::UnavailableError("target is shutting down");
    }
    if (s.refused) {
      target_.metrics.CountStreamRefused(s.status.code());
      target_.streams.LogRefusedStream(StreamClosedLine(s));
    } else {
      target_.metrics.CountStreamClosed(s.status.code());
      std::fprintf(stderr, "%s\n", StreamClosedLine(s).c_str());
    }
  }
  {
    std::lock_guard<std::mutex> lock(link_->mu);
    link_->reactor = nullptr;
    link_->cancelled_flag = true;
  }
  target_.streams.Unregister(this);
  target_.scheduler.RemoveStream(sched_stream_);
  delete this;  // the transport's destructor joins its threads
}

void StreamReactor::Drain() {
  std::lock_guard<std::mutex> lock(mu_);
  draining_ = true;
  Pump();
}

void StreamReactor::OnResult(uint64_t batch_id, int64_t charged,
                             absl::StatusOr<ForwardResult> result, uint64_t checksum) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_ || broken_ || idle_ended_at_.has_value()) return;
  last_activity_ = std::chrono::steady_clock::now();
  if (!result.ok()) {
    --scheduled_;
    PushError(batch_id, result.status(), charged);
  } else {
    // A part before the batch's last (chunked prefill) goes out as its
    // chunks alone; the last brings BatchDone, the credit and the charge.
    const bool last = result->last_part;
    if (last) --scheduled_;
    Outgoing out;
    out.batch_id = batch_id;
    out.result = std::make_shared<ForwardResult>(*std::move(result));
    out.payload = transport_->WritePayload(batch_id, out.result);
    out.checksum = checksum;
    out.last_part = last;
    out.releases_credit = last;
    out.pending_bytes = last ? charged : 0;
    Enqueue(std::move(out));
  }
  Pump();
}

void StreamReactor::OnTransportOpened(TransportOpened opened) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_ || broken_) {
    opening_ = false;
    Pump();
    return;
  }
  SendOpened(opened);
  opening_ = !opened.ready;
  Pump();
}

void StreamReactor::OnTransportReady() {
  std::lock_guard<std::mutex> lock(mu_);
  opening_ = false;
  Pump();
}

void StreamReactor::OnTransportFailed(absl::Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  opening_ = false;
  FailStream(std::move(status));
  Pump();
}

void StreamReactor::OnSend(StreamResponse msg) {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_ || broken_ || idle_ended_at_.has_value()) return;
  Enqueue(Outgoing{.message = std::move(msg)});
  Pump();
}

void StreamReactor::HandleOpen() {
  if (req_.msg_case() != StreamRequest::kOpen) {
    FailStream(absl::InvalidArgumentError(
        "the first message of StreamHiddenStates must be Open (layers, encoding, transport)"));
    return;
  }
  const v1::Open& open = req_.open();
  absl::StatusOr<StreamPlan> plan = PlanStream(target_, open);
  if (!plan.ok()) {
    FailStream(plan.status());
    return;
  }
  // The stream counts against --max_streams (and its client's share) from
  // here: one that never sends Open holds no slot.
  if (absl::Status admitted = target_.streams.Admit(this, ClientKey()); !admitted.ok()) {
    FailStream(std::move(admitted));
    return;
  }
  credits_ = plan->credits;
  plan_ = *std::move(plan);
  absl::StatusOr<std::unique_ptr<StreamTransport>> transport =
      OpenStreamTransport(target_.transport_env, open, link_);
  if (!transport.ok()) {
    FailStream(transport.status());
    return;
  }
  transport_ = *std::move(transport);
  std::optional<TransportOpened> opened = transport_->Start();
  if (opened.has_value()) {
    SendOpened(*opened);
  } else {
    opening_ = true;  // Opened follows from the transport (OnTransportOpened)
  }
}

void StreamReactor::SendOpened(const TransportOpened& transport) {
  const ServiceOptions& opt = target_.options;
  opened_ = true;
  StreamResponse resp;
  v1::Opened* opened = resp.mutable_opened();
  *opened->mutable_info() = target_.info;
  for (int32_t l : plan_.layers) opened->add_layers(l);
  opened->set_encoding(static_cast<v1::Encoding>(plan_.encoding));
  if (plan_.outputs != nullptr) {
    const TargetOutputs& o = *plan_.outputs;
    v1::TargetOutputs* granted = opened->mutable_target_outputs();
    granted->set_argmax(o.argmax);
    granted->set_top_k(o.top_k);
    granted->mutable_draft_vocab()->Add(o.draft_vocab.begin(), o.draft_vocab.end());
    granted->set_draft_probs_encoding(static_cast<v1::Encoding>(o.probs_encoding));
    opened->set_target_outputs_bytes(LayoutOf(o).bytes);
  }
  opened->set_transport(transport.transport);
  opened->set_max_inflight_batches(credits_);
  opened->set_chunk_bytes(opt.chunk_bytes);
  opened->set_transport_note(transport.note);
  opened->set_nccl_across_hosts(transport.across_hosts);
  Enqueue(Outgoing{.message = std::move(resp)});
  LogStreamOpened(*ctx_, token_name_, req_.open(), *opened);
  client_name_ = req_.open().client_name();
  transport_kind_ = transport.transport;
  target_.metrics.CountStreamOpened();
}

void StreamReactor::HandleRequest() {
  if (req_.msg_case() == StreamRequest::kOpen) {
    FailStream(absl::InvalidArgumentError("Open was sent twice on one stream"));
    return;
  }
  if (req_.msg_case() != StreamRequest::kBatch) {
    FailStream(absl::InvalidArgumentError("empty StreamRequest (neither open nor batch)"));
    return;
  }
  v1::Batch* batch = req_.mutable_batch();
  const uint64_t batch_id = batch->batch_id();
  if (draining_ || target_.draining.load()) {
    RejectBatch(batch_id,
                absl::UnavailableError("target is shutting down; send this batch elsewhere"));
    return;
  }
  absl::StatusOr<BatchPlan> planned = PlanBatch(target_, plan_, *batch);
  const int64_t forward_tokens = target_.options.max_batch_tokens;
  if (planned.ok() && transport_kind_ == v1::TRANSPORT_NCCL &&
      static_cast<int64_t>(planned->token_ids.size()) > forward_tokens) {
    // The NCCL transport sends one device capture per batch.
    planned = absl::InvalidArgumentError(absl::StrCat(
        "batch ", batch_id, " has ", planned->token_ids.size(), " tokens, over --max_batch_tokens ",
        "of ", forward_tokens, ": a batch run in several forwards is served over gRPC only; "
        "send long sequences on a gRPC stream"));
  }
  if (!planned.ok()) {
    RejectBatch(batch_id, planned.status());
    return;
  }
  WorkItem item;
  item.token_ids = std::move(planned->token_ids);
  item.seq_lens = std::move(planned->seq_lens);
  item.layers = std::move(planned->layers);
  item.encoding = planned->encoding;
  item.outputs = std::move(planned->outputs);
  item.stream = sched_stream_;
  ForwardInput shape{item.token_ids, item.seq_lens, item.layers, item.encoding};
  shape.outputs = item.outputs.get();
  item.result_bytes = static_cast<int64_t>(CaptureBytes(target_.model.config, shape));
  std::shared_ptr<ReactorLink> link = link_;
  item.cancelled = [link] { return link->cancelled(); };
  item.max_forward_tokens = target_.options.max_batch_tokens;
  item.done = [link, batch_id, charged = item.result_bytes,
               parts = std::make_shared<BatchParts>()](absl::StatusOr<ForwardResult> r) {
    link->Deliver(batch_id, charged, std::move(r), *parts);
  };
  transport_->Post(batch_id, item);
  if (absl::Status s = target_.scheduler.Submit(std::move(item)); !s.ok()) {
    RejectBatch(batch_id, s);
    return;
  }
  ++inflight_;
  ++scheduled_;
}

void StreamReactor::RejectBatch(uint64_t batch_id, const absl::Status& status) {
  // The error takes the batch's credit until it is written: otherwise a client
  // that sends invalid batches and never reads would have the stream read on
  // and queue errors without bound.
  // Its bytes count against the stream's pending cap too, as a result would.
  ++inflight_;
  if (target_.options.max_rejects_per_s > 0) {
    RefillRejects(std::chrono::steady_clock::now());
    reject_tokens_ -= 1;
    if (reject_tokens_ < 1 && !reject_paused_) {
      reject_paused_ = true;  // Pump reads no further until ResumeIfThrottled
      ++reject_pauses_;
    }
  }
  const int64_t bytes = static_cast<int64_t>(sizeof(StreamResponse)) + status.message().size();
  target_.scheduler.ChargePending(sched_stream_, bytes);
  PushError(batch_id, status, bytes);
}

void StreamReactor::PushError(uint64_t batch_id, const absl::Status& status,
                              int64_t pending_bytes) {
  StreamResponse resp;
  v1::BatchError* err = resp.mutable_error();
  err->set_batch_id(batch_id);
  err->set_code(static_cast<int32_t>(status.code()));
  err->set_message(std::string(status.message()));
  ++batch_errors_;
  target_.metrics.CountBatchError(status.code());
  Enqueue(Outgoing{
      .message = std::move(resp), .releases_credit = true, .pending_bytes = pending_bytes});
}

void StreamReactor::Enqueue(Outgoing out) {
  outbox_.push_back(std::move(out));
  target_.streams.NoteQueuedResponses(static_cast<int64_t>(outbox_.size()));
}

void StreamReactor::FailStream(absl::Status status) {
  if (finish_status_.ok()) finish_status_ = std::move(status);
  reads_done_ = true;
}

void StreamReactor::Settle(const Outgoing& out) {
  if (out.releases_credit) --inflight_;
  if (out.pending_bytes > 0) target_.scheduler.ReleasePending(sched_stream_, out.pending_bytes);
}

void StreamReactor::NextMessage() {
  Outgoing& out = outbox_.front();
  if (out.message.has_value()) {
    raw_resp_ = Serialize(*out.message);
    Settle(out);
    outbox_.pop_front();
    return;
  }
  const auto now = std::chrono::steady_clock::now();
  if (out.payload != nullptr && out.payload->Next(&raw_resp_)) {
    if (!out.first_sent.has_value()) out.first_sent = now;
    // An earlier part's last chunk: the next part (or BatchDone) follows.
    if (!out.last_part && out.payload->exhausted()) outbox_.pop_front();
    return;
  }
  // Every payload message has been written (one write at a time): the batch
  // is served.
  const ForwardResult& r = *out.result;
  const int64_t payload = r.batch_tokens() * r.bytes_per_token;
  const double send_s = transport_kind_ == v1::TRANSPORT_NCCL || !out.first_sent.has_value()
                            ? r.send_ms / 1e3
                            : std::chrono::duration<double>(now - *out.first_sent).count();
  target_.metrics.CountBatchServed(transport_kind_, r.batch_tokens(), payload, r.queue_ms / 1e3,
                                       r.forward_ms / 1e3, send_s);
  ++batches_served_;
  tokens_served_ += r.batch_tokens();
  payload_bytes_ += payload;
  raw_resp_ = Serialize(DoneMessage(out.batch_id, *out.result, out.checksum));
  Settle(out);
  outbox_.pop_front();
}

StreamLoad StreamReactor::Load() {
  std::lock_guard<std::mutex> lock(mu_);
  return StreamLoad{.id = sched_stream_,
                    .client_name = client_name_,
                    .credits = opened_ ? credits_ : 0,
                    .inflight = inflight_,
                    .pending_bytes = target_.scheduler.pending_bytes(sched_stream_),
                    .reject_pauses = reject_pauses_};
}

void StreamReactor::RefillRejects(std::chrono::steady_clock::time_point now) {
  const double rate = target_.options.max_rejects_per_s;
  const double elapsed = std::chrono::duration<double>(now - reject_refilled_at_).count();
  reject_tokens_ = std::min(kRejectBurst, reject_tokens_ + elapsed * rate);
  reject_refilled_at_ = now;
}

void StreamReactor::ResumeIfThrottled(std::chrono::steady_clock::time_point now) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!reject_paused_ || finished_) return;
  RefillRejects(now);
  if (reject_tokens_ < 1) return;
  reject_paused_ = false;
  Pump();
}

std::string StreamReactor::ClientKey() const {
  if (!token_name_.empty()) return absl::StrCat("token ", token_name_);
  // "ipv4:10.0.0.2:5000" -> "ipv4:10.0.0.2": the host, whatever its port.
  const size_t colon = peer_.rfind(':');
  return colon == std::string::npos || colon < 5 ? peer_ : peer_.substr(0, colon);
}

void StreamReactor::EndIfNotOpened(std::chrono::steady_clock::time_point now,
                                   std::chrono::steady_clock::duration timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  if (opened_ || opening_ || reads_done_ || finished_ || broken_) return;
  if (now - started_ < timeout) return;
  const double seconds = std::chrono::duration<double>(timeout).count();
  FailStream(absl::DeadlineExceededError(absl::StrCat(
      "no Open within ", seconds, " s of the stream's start (--open_timeout_s=", seconds,
      "); send Open first")));
  Pump();
}

bool StreamReactor::EndIfIdle(std::chrono::steady_clock::time_point now,
                              std::chrono::steady_clock::duration timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  if (idle_ended_at_.has_value()) return !finished_ && write_pending_;
  if (finished_ || broken_ || opening_) return false;
  if (scheduled_ > 0 && outbox_.empty() && !write_pending_) return false;  // the engine's turn
  // A write pending means the client's HTTP/2 window is full: it holds
  // messages it has not read, and reads them without the target seeing, for
  // gRPC hands window back only once half of it has been read. A client
  // reading slowly but steadily takes writes in bursts, seconds apart, so
  // the clock for a stream held back by its client runs kPendingWriteTimeouts
  // times as long.
  const auto limit = write_pending_ ? timeout * kPendingWriteTimeouts : timeout;
  if (now - last_activity_ < limit) return false;
  idle_ended_at_ = now;
  const double seconds = std::chrono::duration<double>(timeout).count();
  FailStream(absl::DeadlineExceededError(
      write_pending_
          ? absl::StrCat("stream idle: for ", seconds * kPendingWriteTimeouts, " s (",
                         kPendingWriteTimeouts, " x --stream_idle_timeout_s=", seconds,
                         ") its client took no write and sent no message; read the stream or "
                         "close it")
          : absl::StrCat("stream idle for ", seconds,
                         " s: no message from the client, no write taken and no batch of it "
                         "running (--stream_idle_timeout_s=",
                         seconds, "); open a new stream")));
  // Nothing more is read or run for it, and what it held goes back now.
  link_->cancelled_flag = true;
  outbox_.clear();
  inflight_ = 0;
  target_.scheduler.RemoveStream(sched_stream_);
  Pump();
  // With no write pending the status goes out now (Pump has finished the
  // stream). With one, the client has taken nothing for that long: not even
  // the status would reach it, so the caller cancels the call.
  return write_pending_;
}

void StreamReactor::Pump() {
  if (finished_) return;
  if (broken_) {
    if (!write_pending_) {
      finished_ = true;
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "client went away"));
    }
    return;
  }
  if (!write_pending_ && !outbox_.empty()) {
    NextMessage();
    write_pending_ = true;
    StartWrite(&raw_resp_);
  }
  const bool draining = draining_ || target_.draining.load();
  if (!read_pending_ && !reads_done_ && !draining && !opening_ && !reject_paused_ &&
      (!opened_ || inflight_ < credits_)) {
    read_pending_ = true;
    StartRead(&raw_req_);
  }
  const bool input_over = reads_done_ || draining;
  if (input_over && inflight_ == 0 && outbox_.empty() && !write_pending_) {
    finished_ = true;
    if (!finish_status_.ok()) {
      Finish(ToGrpcStatus(finish_status_));
    } else if (draining && !reads_done_) {
      Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "target is shutting down; every accepted batch was sent, "
                          "send further batches to another target"));
    } else {
      Finish(grpc::Status::OK);
    }
  }
}

}  // namespace draftfeed
