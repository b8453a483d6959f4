// A feed's streams: one per (target address, connection). Connecting (with
// backoff), opening (model check, transport negotiation), the reader and
// writer threads, and what a stream's end does to the batches it held.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/src/chunk_reader.h"
#include "client/src/feed_impl.h"
#include "client/src/target_info.h"
#include "common/thread_name.h"

namespace draftfeed {

// One Target per (address, connection): with connections_per_target > 1
// each connection is its own stream, TCP connection and credits, and the
// dispatcher spreads batches over them like over separate targets.
void Feed::Impl::AddTargetLocked(const std::string& address, const std::string& dns_name) {
  for (auto& t : targets) {
    if (t->address == address) return;
  }
  for (int32_t i = 0; i < options.connections_per_target; ++i) {
    auto t = std::make_unique<Target>();
    t->address = address;
    t->stats.address = i == 0 ? address : absl::StrCat(address, " #", i + 1);
    // Local subchannel pool: a connection of its own.
    t->channel = MakeChannel(address, *credentials, dns_name);
    t->stub = v1::TargetService::NewStub(t->channel);
    t->backoff_s = options.reconnect_backoff_min_s;
    t->joined_s = SinceOpen();
    t->window = TargetWindow(options.stats_window_s, t->joined_s);
    Target* raw = t.get();
    targets.push_back(std::move(t));
    raw->connector = std::thread([this, raw] {
      NameThisThread("df-connect");
      ConnectLoop(raw);
    });
  }
}

void Feed::Impl::ConnectLoop(Target* t) {
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    if (closing) return;
    if (t->state == State::kLive || t->state == State::kRefused) {
      cv.wait(lock);
      continue;
    }
    if (Clock::now() < t->next_attempt) {
      cv.wait_until(lock, t->next_attempt);
      continue;
    }
    const bool first = t->attempts++ == 0;
    lock.unlock();
    absl::Status s = ConnectOnce(t, first);
    lock.lock();
    if (s.ok() || closing) continue;
    t->stats.last_error = std::string(s.message());
    if (s.code() == absl::StatusCode::kFailedPrecondition ||
        s.code() == absl::StatusCode::kInvalidArgument) {
      t->state = State::kRefused;  // another model or a layer it lacks: never use it
      t->refusal = s;
    } else {
      t->state = State::kDown;
      t->next_attempt =
          Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(t->backoff_s * 1000));
      t->backoff_s = std::min(t->backoff_s * 2, options.reconnect_backoff_max_s);
    }
    cv.notify_all();
  }
}

absl::Status Feed::Impl::ConnectOnce(Target* t, bool first) {
  // Every attempt fails as soon as the connection does (a target not
  // listening yet is retried with backoff); the timeout bounds one that hangs.
  auto info = QueryInfo(
      t->stub.get(), t->address,
      first ? options.connect_timeout_s : std::min(options.connect_timeout_s, 5.0), *credentials);
  if (!info.ok()) return info.status();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (fingerprint.empty()) {
      fingerprint = info->fingerprint;
      fingerprint_source = absl::StrCat(t->address, " (", info->model_id, ")");
      hidden_size = info->hidden_size;
    }
    if (info->fingerprint != fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "target ", t->address, " serves ", info->model_id, " (fingerprint ", info->fingerprint,
          ") but the feed expects fingerprint ", fingerprint,
          fingerprint_source.empty() ? "" : absl::StrCat(", served by ", fingerprint_source),
          "; refusing it"));
    }
  }
  auto conn = std::make_shared<Conn>();
  conn->target = t;
  const std::string context = absl::StrCat("target ", t->address, ": open stream");
  if (!conn->stream.Start(t->channel, *credentials)) {
    return FromGrpc(conn->stream.Finish(), context);
  }
  v1::StreamRequest req;
  v1::Open* open = req.mutable_open();
  for (int32_t l : options.layers) open->add_layers(l);
  open->set_encoding(static_cast<v1::Encoding>(RequestedEncoding()));
  open->set_expected_fingerprint(info->fingerprint);
  open->set_max_inflight_batches(options.credits_per_target);
  open->set_client_name(options.client_name);
  if (!outputs.empty()) {
    v1::TargetOutputs* asked = open->mutable_target_outputs();
    asked->set_argmax(outputs.argmax);
    asked->set_top_k(outputs.top_k);
    asked->mutable_draft_vocab()->Add(outputs.draft_vocab.begin(), outputs.draft_vocab.end());
    asked->set_draft_probs_encoding(static_cast<v1::Encoding>(outputs.probs_encoding));
  }
  absl::StatusOr<std::unique_ptr<TransportOffer>> offer = transports->Offer(t->address, open);
  if (!offer.ok()) {
    conn->stream.TryCancel();
    conn->stream.Finish();
    return offer.status();
  }
  auto abandon = [&conn](absl::Status why) {
    conn->stream.TryCancel();
    conn->stream.Finish();
    return why;
  };
  if (!conn->stream.Write(ToBuffer(req))) return FromGrpc(conn->stream.Finish(), context);
  if (absl::Status sent = (*offer)->Sent(); !sent.ok()) return abandon(sent);
  grpc::ByteBuffer raw;
  if (!conn->stream.Read(&raw)) return FromGrpc(conn->stream.Finish(), context);
  v1::StreamResponse resp;
  if (!ParseBuffer(raw, &resp) || resp.msg_case() != v1::StreamResponse::kOpened) {
    return abandon(absl::InternalError(absl::StrCat("target ", t->address, ": expected Opened")));
  }
  const v1::Opened& opened = resp.opened();
  // What the target sends is what Opened says, not what was asked.
  const int wire =
      opened.encoding() == v1::ENCODING_UNSPECIFIED ? v1::ENCODING_BF16 : opened.encoding();
  const std::optional<CaptureEncoding> encoding = EncodingFromWire(wire);
  if (!encoding.has_value()) {
    return abandon(absl::FailedPreconditionError(
        absl::StrCat("target ", t->address, " sends its capture as ",
                     v1::Encoding_Name(opened.encoding()), ", which this client cannot read")));
  }
  if (opened.layers_size() != K()) {
    return abandon(absl::FailedPreconditionError(absl::StrCat("target ", t->address, " opened ",
                                                              opened.layers_size(),
                                                              " layers of the ", K(), " asked")));
  }
  // A target of before target outputs ignores the field it does not know and
  // would send rows without them.
  if (opened.target_outputs_bytes() != outputs_layout.bytes) {
    return abandon(absl::FailedPreconditionError(absl::StrCat(
        "target ", t->address, " (version ", opened.info().server_version(), ") answers with ",
        opened.target_outputs_bytes(), " bytes of target outputs per token where ",
        outputs_layout.bytes, " were asked",
        outputs_layout.bytes > 0 && opened.target_outputs_bytes() == 0
            ? ": it does not serve target outputs (argmax, top_k, draft_vocab); upgrade it"
            : "")));
  }
  const int64_t hidden_bytes_per_token =
      CaptureBytesPerToken(*encoding, opened.layers_size(), opened.info().hidden_size());
  const int64_t bytes_per_token = hidden_bytes_per_token + outputs_layout.bytes;
  absl::StatusOr<std::unique_ptr<StreamTransport>> transport =
      (*offer)->Accept(opened, StreamSlot{this, conn.get(), t->address, bytes_per_token});
  if (!transport.ok()) return abandon(transport.status());
  conn->transport = *std::move(transport);
  std::lock_guard<std::mutex> lock(mu);
  if (closing) return abandon(absl::CancelledError("feed closing"));
  t->info = *std::move(info);
  t->credits = std::max(1, opened.max_inflight_batches());
  t->encoding = *encoding;
  t->bytes_per_token = bytes_per_token;
  t->hidden_bytes_per_token = hidden_bytes_per_token;
  t->conn = conn;
  t->state = State::kLive;
  t->backoff_s = options.reconnect_backoff_min_s;
  t->stats.last_error.clear();
  t->stats.transport = std::string(conn->transport->name());
  t->stats.transport_note = opened.transport_note();
  Conn* c = conn.get();
  c->writer = std::thread([c] {
    NameThisThread("df-write");
    WriteLoop(c);
  });
  c->reader = std::thread([this, conn] {
    NameThisThread("df-read");
    ReadLoop(conn);
  });
  cv.notify_all();
  return absl::OkStatus();
}

void Feed::Impl::WriteLoop(Conn* c) {
  std::unique_lock<std::mutex> lock(c->wmu);
  for (;;) {
    c->wcv.wait(lock, [&] { return c->wclosed || !c->wq.empty(); });
    if (c->wq.empty()) break;  // closed and drained
    grpc::ByteBuffer req = std::move(c->wq.front());
    c->wq.pop_front();
    lock.unlock();
    const bool ok = c->stream.Write(req);
    lock.lock();
    if (!ok) {
      c->wq.clear();
      return;  // the reader sees the stream end and re-sends the batches
    }
  }
  lock.unlock();
  c->stream.WritesDone();
}

void Feed::Impl::StopWriter(Conn* c, bool drop_queued) {
  {
    std::lock_guard<std::mutex> lock(c->wmu);
    c->wclosed = true;
    if (drop_queued) c->wq.clear();
  }
  c->wcv.notify_all();
}

// One message from the target; false when the stream must end (the target
// sent garbage, or its transport broke: the target is lost). Chunks go to the
// stream's transport, read in place where the envelope decoder can.
bool Feed::Impl::Process(Conn* conn, grpc::ByteBuffer& raw, v1::StreamResponse& resp) {
  if (std::optional<Chunk> chunk = ReadChunk(raw)) return conn->transport->OnChunk(*chunk);
  if (!ParseBuffer(raw, &resp)) return false;
  if (resp.msg_case() == v1::StreamResponse::kChunk) {
    return conn->transport->OnChunk(ChunkOf(resp.chunk()));
  }
  HandleResponse(conn->target, conn, resp);
  return true;
}

namespace {

// Messages read but not yet processed, between a connection's reader and
// its processor. Bounded, so a slow trainer still pushes back on the target.
class Handoff {
 public:
  explicit Handoff(size_t capacity) : capacity_(capacity) {}
  // False once the processor quit.
  bool Push(grpc::ByteBuffer&& raw) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return quit_ || q_.size() < capacity_; });
    if (quit_) return false;
    q_.push_back(std::move(raw));
    cv_.notify_all();
    return true;
  }
  // False once the reader is done and everything was taken.
  bool Pop(grpc::ByteBuffer* raw) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return ended_ || !q_.empty(); });
    if (q_.empty()) return false;
    *raw = std::move(q_.front());
    q_.pop_front();
    cv_.notify_all();
    return true;
  }
  void End() {  // the reader: no more messages
    std::lock_guard<std::mutex> lock(mu_);
    ended_ = true;
    cv_.notify_all();
  }
  void Quit() {  // the processor: take no more
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
    q_.clear();
    cv_.notify_all();
  }

 private:
  const size_t capacity_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<grpc::ByteBuffer> q_;
  bool ended_ = false, quit_ = false;
};

}  // namespace

void Feed::Impl::ReadLoop(std::shared_ptr<Conn> conn) {
  v1::StreamResponse resp;
  grpc::ByteBuffer raw;
  if (!conn->transport->payload_in_stream() || !read_handoff) {
    // One thread reads and processes (small messages, or few cores).
    while (conn->stream.Read(&raw)) {
      if (!Process(conn.get(), raw, resp)) {
        conn->stream.TryCancel();  // a target that sends garbage is treated as lost
        break;
      }
    }
  } else {
    // This thread only reads, and a second one copies (and hashes) each
    // chunk into its batch: gRPC reopens its flow-control window as each
    // message is read, so the next chunk arrives while the last is copied.
    Handoff handoff(kReadAheadMessages);
    std::thread processor([&, conn] {
      NameThisThread("df-copy");
      grpc::ByteBuffer msg;
      v1::StreamResponse parsed;
      while (handoff.Pop(&msg)) {
        if (!Process(conn.get(), msg, parsed)) {
          conn->stream.TryCancel();  // a target that sends garbage is treated as lost
          handoff.Quit();
          return;
        }
      }
    });
    while (conn->stream.Read(&raw)) {
      if (!handoff.Push(std::move(raw))) break;
      raw = grpc::ByteBuffer();
    }
    handoff.End();  // the processor finishes what was read (a last BatchDone)
    processor.join();
  }
  // Finish must not race a Write: stop the writer first.
  StopWriter(conn.get(), /*drop_queued=*/true);
  if (conn->writer.joinable()) conn->writer.join();
  const grpc::Status status = conn->stream.Finish();
  conn->transport->Abort();
  std::lock_guard<std::mutex> lock(mu);
  OnConnEnd(conn->target, conn, status);
  conn->finished = true;
  dead_conns.push_back(conn);
  cv.notify_all();
}

void Feed::Impl::OnConnEnd(Target* t, const std::shared_ptr<Conn>& conn,
                           const grpc::Status& status) {
  if (t->conn == conn) {
    t->conn = nullptr;
    if (t->state == State::kLive) t->state = State::kDown;
    t->next_attempt =
        Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(t->backoff_s * 1000));
    if (conn->cancelled_by_client) {
      t->next_attempt = Clock::now();  // nothing went wrong: reconnect now
    } else if (!closing) {
      ++t->stats.failures;
      if (t->stats.last_error.empty()) {
        t->stats.last_error = status.ok()
                                  ? "stream ended"
                                  : absl::StrCat(status.error_code(), ": ", status.error_message());
      }
    }
  }
  // Whatever this stream still owed goes back to the queue for another target.
  for (auto& [id, p] : pending) {
    if (p.conn == conn.get() && !p.complete) {
      Unassign(p);
      unassigned.insert(id);
      ++stats.resent;
    }
  }
}

}  // namespace draftfeed
