#include "server/service/target_service.h"

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <chrono>
#include <deque>
#include <optional>
#include <utility>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/chunk_envelope.h"
#include "common/payload_checksum.h"
#include "common/thread_name.h"
#include "server/service/status_util.h"
#include "server/service/version.h"
#if DRAFTFEED_HAVE_NCCL
#include "common/nccl/nccl_peer.h"
#endif

namespace draftfeed {

namespace {

using v1::StreamRequest;
using v1::StreamResponse;

const char* EncodingName(v1::Encoding e) {
  switch (e) {
    case v1::ENCODING_UNSPECIFIED:
    case v1::ENCODING_BF16: return "bf16";
    case v1::ENCODING_FP8_E4M3: return "fp8_e4m3";
    case v1::ENCODING_BF16_ZSTD: return "bf16_zstd";
    default: return "unknown";
  }
}

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// What the NCCL sink of one batch hands to its done callback (the checksum
// travels in the engine's Copied).
struct NcclBatch {
  double send_ms = 0;  // the send's GPU time from the forward's end to the send's end
};

// Lets scheduler callbacks reach a reactor that may already be gone: OnDone
// clears `reactor` under `mu` before the reactor deletes itself.
struct ReactorLink {
  std::mutex mu;
  StreamReactor* reactor = nullptr;
  std::atomic<bool> cancelled{false};
};

grpc::ByteBuffer ChunkBuffer(uint64_t batch_id, int64_t token_offset, int64_t token_count,
                             const std::shared_ptr<ForwardResult>& result, const void* data,
                             size_t bytes) {
  uint8_t head[kMaxChunkEnvelopeBytes];
  const size_t n = EncodeChunkEnvelope(
      {.batch_id = batch_id, .token_offset = token_offset, .token_count = token_count}, bytes,
      head);
  grpc::Slice slices[2] = {
      grpc::Slice(head, n),
      // gRPC releases the payload slice when the bytes are on the wire; the
      // result buffer lives until then.
      grpc::Slice(const_cast<void*>(data), bytes,
                  [](void* keep) { delete static_cast<std::shared_ptr<ForwardResult>*>(keep); },
                  new std::shared_ptr<ForwardResult>(result))};
  return grpc::ByteBuffer(slices, 2);
}

grpc::ByteBuffer Serialize(const StreamResponse& msg) {
  const std::string bytes = msg.SerializeAsString();
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace

class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  StreamReactor(TargetService* service, grpc::CallbackServerContext* ctx)
      : service_(service), ctx_(ctx), link_(std::make_shared<ReactorLink>()) {
    link_->reactor = this;
    service_->Register(this);
    std::lock_guard<std::mutex> lock(mu_);
    Pump();
  }

  void OnReadDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    read_pending_ = false;
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

  void OnWriteDone(bool ok) override {
    std::lock_guard<std::mutex> lock(mu_);
    write_pending_ = false;
    if (!ok) {
      // The client is gone; nothing more can be sent. Queued batches skip.
      broken_ = true;
      link_->cancelled = true;
      outbox_.clear();
    }
    Pump();
  }

  void OnCancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = true;
    link_->cancelled = true;
    outbox_.clear();
    Pump();
  }

  void OnDone() override {
    {
      std::lock_guard<std::mutex> lock(link_->mu);
      link_->reactor = nullptr;
      link_->cancelled = true;
    }
    service_->Unregister(this);
    delete this;
  }

  void Drain() {
    std::lock_guard<std::mutex> lock(mu_);
    draining_ = true;
    Pump();
  }

  // Called on the scheduler's completion thread (the engine has moved on to
  // the next batch). A GPU engine has already checksummed the payload on the
  // device; otherwise (a CPU engine) the pass over it runs here.
  static void DeliverResult(const std::shared_ptr<ReactorLink>& link, uint64_t batch_id,
                            absl::StatusOr<ForwardResult> result) {
    uint64_t checksum = 0;
    if (result.ok()) {
      checksum = result->checksum.has_value()
                     ? *result->checksum
                     : v1::PayloadChecksum(result->hidden.get(), result->hidden_size * 2);
    }
    std::lock_guard<std::mutex> link_lock(link->mu);
    if (link->reactor == nullptr) return;
    link->reactor->OnResult(batch_id, std::move(result), checksum);
  }

 private:
  // One thing to send: a ready message, or a batch result sent as chunks then
  // BatchDone. `releases_credit` marks the last message of an accepted batch.
  struct Outgoing {
    std::optional<StreamResponse> message;
    uint64_t batch_id = 0;
    std::shared_ptr<ForwardResult> result;
    int64_t token_stride = 0;  // payload elements per token (K*H)
    int64_t next_token = 0;
    uint64_t checksum = 0;
    bool releases_credit = false;
    std::chrono::steady_clock::time_point send_start{};
  };

  void OnResult(uint64_t batch_id, absl::StatusOr<ForwardResult> result, uint64_t checksum) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_ || broken_) return;
    if (!result.ok()) {
      PushError(batch_id, result.status(), /*releases_credit=*/true);
    } else if (result->hidden == nullptr) {
      // The payload went by NCCL; only BatchDone follows the announcement.
      outbox_.push_back(Outgoing{.message = DoneMessage(batch_id, *result, checksum, result->send_ms),
                                 .releases_credit = true});
    } else {
      Outgoing out;
      out.batch_id = batch_id;
      out.token_stride = result->tokens > 0
                             ? static_cast<int64_t>(result->hidden_size) / result->tokens
                             : 0;
      out.result = std::make_shared<ForwardResult>(*std::move(result));
      out.checksum = checksum;
      out.releases_credit = true;
      outbox_.push_back(std::move(out));
    }
    Pump();
  }

  void HandleOpen() {
    if (req_.msg_case() != StreamRequest::kOpen) {
      FailStream(absl::InvalidArgumentError(
          "the first message of StreamHiddenStates must be Open (layers, encoding, transport)"));
      return;
    }
    const v1::Open& open = req_.open();
    const ModelConfig& config = service_->model().config;
    if (!open.expected_fingerprint().empty() &&
        open.expected_fingerprint() != service_->model().fingerprint) {
      FailStream(absl::FailedPreconditionError(absl::StrCat(
          "model fingerprint mismatch: the client expects ", open.expected_fingerprint(),
          " but this target serves ", service_->model().id, " with fingerprint ",
          service_->model().fingerprint)));
      return;
    }
    if (open.encoding() != v1::ENCODING_UNSPECIFIED && open.encoding() != v1::ENCODING_BF16) {
      FailStream(absl::UnimplementedError(
          absl::StrCat("encoding ", EncodingName(open.encoding()),
                       " is not served by this target; offered: bf16")));
      return;
    }
    if (open.transport() != v1::TRANSPORT_UNSPECIFIED && open.transport() != v1::TRANSPORT_GRPC &&
        open.transport() != v1::TRANSPORT_AUTO && open.transport() != v1::TRANSPORT_NCCL) {
      FailStream(absl::UnimplementedError(absl::StrCat("unknown transport value ",
                                                       static_cast<int>(open.transport()))));
      return;
    }
    std::vector<int32_t> layers(open.layers().begin(), open.layers().end());
    if (absl::Status s = ValidateLayers(config, layers); !s.ok()) {
      FailStream(std::move(s));
      return;
    }
    if (absl::Status s = service_->CheckCaptureLayers(layers.size()); !s.ok()) {
      FailStream(std::move(s));
      return;
    }
    const ServiceOptions& opt = service_->options();
    credits_ = open.max_inflight_batches() <= 0
                   ? opt.default_credits
                   : std::min(open.max_inflight_batches(), opt.max_credits);
    layers_ = std::move(layers);

    if (open.transport() == v1::TRANSPORT_NCCL || open.transport() == v1::TRANSPORT_AUTO) {
      const bool asked_nccl = open.transport() == v1::TRANSPORT_NCCL;
      const std::string why_not = service_->NcclUnavailableReason(open);
      if (why_not.empty()) {
        StartNccl(open.nccl_unique_id(), asked_nccl);
        return;  // Opened follows once the communicator is up (OnNcclJoined)
      }
      if (asked_nccl) {
        FailStream(absl::FailedPreconditionError(absl::StrCat(
            "transport nccl refused: ", why_not, ". Use transport=auto to fall back to grpc.")));
        return;
      }
      transport_note_ = absl::StrCat("auto chose grpc: ", why_not);
    }
    SendOpened(v1::TRANSPORT_GRPC);
  }

  void SendOpened(v1::Transport transport) {
    const ServiceOptions& opt = service_->options();
    opened_ = true;
    StreamResponse resp;
    v1::Opened* opened = resp.mutable_opened();
    *opened->mutable_info() = service_->Info();
    for (int32_t l : layers_) opened->add_layers(l);
    opened->set_encoding(v1::ENCODING_BF16);
    opened->set_transport(transport);
    opened->set_max_inflight_batches(credits_);
    opened->set_chunk_bytes(opt.chunk_bytes);
    opened->set_transport_note(transport_note_);
    outbox_.push_back(Outgoing{.message = std::move(resp)});
  }

#if DRAFTFEED_HAVE_NCCL
  // Joins the trainer's communicator off the reactor thread; the stream reads
  // nothing more until the two sides have shaken hands. Opened goes out once
  // the communicator is up (or says why not), since the trainer joins the
  // handshake only after reading it.
  void StartNccl(const std::string& unique_id, bool asked_nccl) {
    opening_ = true;
    std::shared_ptr<ReactorLink> link = link_;
    const int device = service_->nccl_device();
    const double timeout_s = service_->options().nccl_timeout_s;
    std::thread([link, unique_id, device, timeout_s, asked_nccl] {
      NameThisThread("df-nccl-setup");
      auto cancelled = [link] { return link->cancelled.load(); };
      absl::StatusOr<std::unique_ptr<NcclPeer>> peer =
          NcclPeer::Start(unique_id, NcclPeer::kSenderRank, device);
      absl::Status status = peer.status();
      if (status.ok()) status = (*peer)->Wait(timeout_s, cancelled);
      std::shared_ptr<NcclPeer> joined;
      if (status.ok()) joined = *std::move(peer);
      {
        std::lock_guard<std::mutex> lock(link->mu);
        if (link->reactor == nullptr) return;
        link->reactor->OnNcclJoined(status, joined, asked_nccl);
      }
      if (!status.ok()) return;
      absl::Status shook = joined->Handshake(timeout_s, cancelled);
      std::lock_guard<std::mutex> lock(link->mu);
      if (link->reactor != nullptr) link->reactor->OnNcclHandshake(std::move(shook));
    }).detach();
  }

  void OnNcclJoined(const absl::Status& status, std::shared_ptr<NcclPeer> peer, bool asked_nccl) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_ || broken_) {
      opening_ = false;
      Pump();
      return;
    }
    if (status.ok()) {
      nccl_ = std::move(peer);
      SendOpened(v1::TRANSPORT_NCCL);  // still opening_: batches wait for the handshake
    } else if (asked_nccl) {
      opening_ = false;
      FailStream(absl::Status(status.code(),
                              absl::StrCat("transport nccl setup failed: ", status.message())));
    } else {
      opening_ = false;
      transport_note_ = absl::StrCat("auto fell back to grpc: nccl setup failed: ",
                                     status.message());
      SendOpened(v1::TRANSPORT_GRPC);
    }
    Pump();
  }

  void OnNcclHandshake(absl::Status status) {
    std::lock_guard<std::mutex> lock(mu_);
    opening_ = false;
    if (!status.ok()) {
      FailStream(absl::UnavailableError(
          absl::StrCat("transport nccl handshake failed: ", status.message())));
    }
    Pump();
  }

  // Runs on the scheduler worker while the batch's forward runs: posts the
  // send behind the forward (on the engine's send stream) and returns at
  // once, so the next forward starts while this capture travels.
  static absl::StatusOr<Engine::DeviceWait> PostOverNccl(const std::shared_ptr<ReactorLink>& link,
                                                        const std::shared_ptr<NcclPeer>& peer,
                                                        double timeout_s, uint64_t batch_id,
                                                        int64_t tokens,
                                                        const std::shared_ptr<NcclBatch>& state,
                                                        const Engine::DeviceView& view) {
    absl::StatusOr<NcclPeer::Op> op =
        peer->PostSend(view.data, view.bytes, view.stream, timeout_s,
                       [link] { return link->cancelled.load(); });
    if (!op.ok()) {
      NcclBroken(link, op.status());
      return op.status();
    }
    return Engine::DeviceWait([link, peer, timeout_s, batch_id, tokens, state, op = *op] {
      return FinishNcclSend(link, *peer, timeout_s, batch_id, tokens, *state, op);
    });
  }

  // On the engine's copy thread: once the forward has ended, announce the
  // batch (the trainer posts its receive when it reads this, so no receive
  // sits on the trainer's GPU through the forward), then wait for the send.
  // send_ms is the send's GPU time from the forward's end: the announcement's
  // round trip plus the transfer.
  static Engine::Copied FinishNcclSend(const std::shared_ptr<ReactorLink>& link, NcclPeer& peer,
                                       double timeout_s, uint64_t batch_id, int64_t tokens,
                                       NcclBatch& state, const NcclPeer::Op& op) {
    auto cancelled = [link] { return link->cancelled.load(); };
    absl::Status ready = peer.WaitReady(op, timeout_s, cancelled);
    bool announced = false;
    if (ready.ok()) {
      std::lock_guard<std::mutex> lock(link->mu);
      if (link->reactor != nullptr) {
        link->reactor->Announce(batch_id, tokens);
        announced = true;
      }
    }
    if (ready.ok() && !announced) {
      // No receive will ever match this send.
      peer.Abort();
      ready = absl::CancelledError("stream closed before the batch was announced");
    }
    double gpu_ms = 0;
    absl::StatusOr<uint64_t> sum =
        ready.ok() ? peer.WaitOp(op, timeout_s, cancelled, &gpu_ms) : absl::StatusOr<uint64_t>(ready);
    state.send_ms = gpu_ms;
    if (!sum.ok()) {
      // Whatever the trainer posted will never be matched: the stream's
      // communicator is out of step, so the stream ends (its batches are
      // re-sent by the client).
      NcclBroken(link, sum.status());
      return Engine::Copied{sum.status(), std::nullopt};
    }
    return Engine::Copied{absl::OkStatus(), *sum};
  }

  static void NcclBroken(const std::shared_ptr<ReactorLink>& link, const absl::Status& s) {
    std::lock_guard<std::mutex> lock(link->mu);
    if (link->reactor != nullptr) link->reactor->OnNcclBroken(s);
  }

  void Announce(uint64_t batch_id, int64_t tokens) {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_ || broken_) return;
    StreamResponse msg;
    v1::HiddenChunk* c = msg.mutable_chunk();
    c->set_batch_id(batch_id);
    c->set_token_offset(0);
    c->set_token_count(tokens);
    outbox_.push_back(Outgoing{.message = std::move(msg)});
    Pump();
  }

  // The trainer's side of the communicator is in an unknown state: end the
  // stream (UNAVAILABLE: the client re-sends its batches on a new stream).
  void OnNcclBroken(const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    FailStream(absl::UnavailableError(absl::StrCat("nccl transfer failed: ", s.message())));
    Pump();
  }
#else
  void StartNccl(const std::string&, bool) {}
#endif

  static absl::Status ValidateLayers(const ModelConfig& config, std::span<const int32_t> layers) {
    // Token checks need a batch; reuse the shared validator with one token.
    const int32_t token = 0;
    const int32_t len = 1;
    return ValidateForwardInput(config, ForwardInput{{&token, 1}, {&len, 1}, layers}, 1);
  }

  void HandleRequest() {
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
    if (draining_ || service_->draining()) {
      PushError(batch_id,
                absl::UnavailableError("target is shutting down; send this batch elsewhere"),
                false);
      return;
    }
    WorkItem item;
    item.token_ids.assign(batch->token_ids().begin(), batch->token_ids().end());
    item.seq_lens.assign(batch->seq_lens().begin(), batch->seq_lens().end());
    if (batch->layers_size() > 0) {
      item.layers.assign(batch->layers().begin(), batch->layers().end());
    } else {
      item.layers = layers_;
    }
    absl::Status valid =
        ValidateForwardInput(service_->model().config,
                             ForwardInput{item.token_ids, item.seq_lens, item.layers},
                             service_->options().max_batch_tokens);
    if (valid.ok()) valid = service_->CheckCaptureLayers(item.layers.size());
    if (!valid.ok()) {
      PushError(batch_id,
                absl::Status(valid.code(), absl::StrCat("batch ", batch_id, ": ", valid.message())),
                false);
      return;
    }
    std::shared_ptr<ReactorLink> link = link_;
    item.cancelled = [link] { return link->cancelled.load(); };
#if DRAFTFEED_HAVE_NCCL
    if (nccl_ != nullptr) {
      auto state = std::make_shared<NcclBatch>();
      const int64_t tokens = static_cast<int64_t>(item.token_ids.size());
      item.device_sink = [link, peer = nccl_, state, batch_id, tokens,
                          timeout_s = service_->options().nccl_timeout_s](
                             const Engine::DeviceView& view) {
        return PostOverNccl(link, peer, timeout_s, batch_id, tokens, state, view);
      };
      item.done = [link, batch_id, state](absl::StatusOr<ForwardResult> r) {
        if (r.ok()) r->send_ms = state->send_ms;  // r->checksum is the send's
        DeliverResult(link, batch_id, std::move(r));
      };
    }
#endif
    if (!item.done) {
      item.done = [link, batch_id](absl::StatusOr<ForwardResult> r) {
        DeliverResult(link, batch_id, std::move(r));
      };
    }
    ++inflight_;
    if (absl::Status s = service_->scheduler().Submit(std::move(item)); !s.ok()) {
      --inflight_;
      PushError(batch_id, s, false);
    }
  }

  void PushError(uint64_t batch_id, const absl::Status& status, bool releases_credit) {
    StreamResponse resp;
    v1::BatchError* err = resp.mutable_error();
    err->set_batch_id(batch_id);
    err->set_code(static_cast<int32_t>(status.code()));
    err->set_message(std::string(status.message()));
    outbox_.push_back(Outgoing{.message = std::move(resp), .releases_credit = releases_credit});
  }

  // Ends the stream with `status` once what is already queued has been sent.
  void FailStream(absl::Status status) {
    if (finish_status_.ok()) finish_status_ = std::move(status);
    reads_done_ = true;
  }

  // Fills raw_resp_ with the next message of the outbox front.
  void NextMessage() {
    Outgoing& out = outbox_.front();
    if (out.message.has_value()) {
      raw_resp_ = Serialize(*out.message);
      if (out.releases_credit) --inflight_;
      outbox_.pop_front();
      return;
    }
    ForwardResult& r = *out.result;
    if (out.next_token == 0) out.send_start = std::chrono::steady_clock::now();
    if (out.next_token < r.tokens) {
      const int64_t bytes_per_token = out.token_stride * 2;
      const int64_t per_chunk = std::max<int64_t>(
          1, service_->options().chunk_bytes / std::max<int64_t>(1, bytes_per_token));
      const int64_t count = std::min(per_chunk, r.tokens - out.next_token);
      raw_resp_ = ChunkBuffer(out.batch_id, out.next_token, count, out.result,
                              r.hidden.get() + out.next_token * out.token_stride,
                              static_cast<size_t>(count * bytes_per_token));
      out.next_token += count;
      return;
    }
    raw_resp_ = Serialize(DoneMessage(out.batch_id, r, out.checksum, MsSince(out.send_start)));
    if (out.releases_credit) --inflight_;
    outbox_.pop_front();
  }

  static StreamResponse DoneMessage(uint64_t batch_id, const ForwardResult& r, uint64_t checksum,
                                    double send_ms) {
    StreamResponse msg;
    v1::BatchDone* done = msg.mutable_done();
    done->set_batch_id(batch_id);
    done->set_tokens(r.tokens);
    done->set_checksum(checksum);
    done->mutable_timings()->set_queue_ms(r.queue_ms);
    done->mutable_timings()->set_forward_ms(r.forward_ms);
    done->mutable_timings()->set_send_ms(send_ms);
    return msg;
  }

  // Advances the stream: next write, next read, or Finish. Called with mu_ held.
  void Pump() {
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
    const bool draining = draining_ || service_->draining();
    if (!read_pending_ && !reads_done_ && !draining && !opening_ &&
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

  TargetService* const service_;
  grpc::CallbackServerContext* const ctx_;
  const std::shared_ptr<ReactorLink> link_;
#if DRAFTFEED_HAVE_NCCL
  std::shared_ptr<NcclPeer> nccl_;  // TRANSPORT_NCCL streams
#endif
  std::string transport_note_;
  bool opening_ = false;  // waiting for the NCCL communicator before Opened

  std::mutex mu_;
  grpc::ByteBuffer raw_req_;
  grpc::ByteBuffer raw_resp_;
  StreamRequest req_;
  std::deque<Outgoing> outbox_;
  std::vector<int32_t> layers_;
  absl::Status finish_status_;
  int32_t credits_ = 0;
  int64_t inflight_ = 0;  // accepted batches whose last message is not yet written
  bool opened_ = false;
  bool read_pending_ = false;
  bool write_pending_ = false;
  bool reads_done_ = false;
  bool draining_ = false;
  bool broken_ = false;
  bool finished_ = false;
};

TargetService::TargetService(std::vector<Engine*> engines, ServiceOptions options)
    : engines_(std::move(engines)),
      options_(options),
      scheduler_(engines_, options.max_queued_batches, options.throttle_tokens_per_s,
                 options.host_pool_bytes, options.host_allocator) {
  scheduler_.set_host_memory_cap(options.host_memory_cap_bytes);
}

TargetService::~TargetService() { scheduler_.Stop(); }

v1::TargetInfo TargetService::Info() const {
  const Model& m = model();
  v1::TargetInfo info;
  info.set_model_id(m.id);
  info.set_architecture(std::string(ArchName(m.config.arch)));
  info.set_num_layers(static_cast<int32_t>(m.config.num_layers));
  info.set_hidden_size(static_cast<int32_t>(m.config.hidden_size));
  info.set_vocab_size(static_cast<int32_t>(m.config.vocab_size));
  info.set_dtype("bf16");
  info.set_fingerprint(m.fingerprint);
  for (Engine* e : engines_) info.add_devices(e->device_name());
  info.set_max_batch_tokens(options_.max_batch_tokens);
  info.add_transports(v1::TRANSPORT_GRPC);
  if (nccl_device() >= 0) info.add_transports(v1::TRANSPORT_NCCL);
  info.add_encodings(v1::ENCODING_BF16);
  info.set_server_version(std::string(kDraftfeedVersion));
  for (LayerKind k : m.config.layer_types) {
    info.add_layer_types(k == LayerKind::kFullAttention ? "full_attention" : "linear_attention");
  }
  info.set_max_credits(options_.max_credits);
  info.set_max_capture_layers(static_cast<int32_t>(max_capture_layers()));
  return info;
}

int64_t TargetService::max_capture_layers() const {
  int64_t most = 0;
  for (Engine* e : engines_) {
    const int64_t m = e->max_capture_layers();
    if (m > 0) most = most == 0 ? m : std::min(most, m);
  }
  return most;
}

absl::Status TargetService::CheckCaptureLayers(size_t asked) const {
  const int64_t most = max_capture_layers();
  if (most == 0 || static_cast<int64_t>(asked) <= most) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      asked, " capture layers asked; this target captures at most ", most,
      " per batch (TargetInfo.max_capture_layers; start it with a larger "
      "--max_capture_layers)"));
}

grpc::ServerUnaryReactor* TargetService::GetTargetInfo(grpc::CallbackServerContext* ctx,
                                                       const v1::GetTargetInfoRequest*,
                                                       v1::TargetInfo* response) {
  *response = Info();
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* TargetService::StreamHiddenStates(
    grpc::CallbackServerContext* ctx) {
  return new StreamReactor(this, ctx);
}

void TargetService::Register(StreamReactor* r) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.insert(r);
}

void TargetService::Unregister(StreamReactor* r) {
  std::lock_guard<std::mutex> lock(mu_);
  streams_.erase(r);
}

void TargetService::BeginDrain() {
  draining_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  for (StreamReactor* r : streams_) r->Drain();
}

LoopbackServer ServeOnLoopback(grpc::Service* service) {
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  LoopbackServer out;
  out.server = builder.BuildAndStart();
  out.address = absl::StrCat("127.0.0.1:", port);
  return out;
}

int TargetService::nccl_device() const {
#if DRAFTFEED_HAVE_NCCL
  if (!options_.enable_nccl || engines_.size() != 1 || !engines_.front()->has_device_capture()) {
    return -1;
  }
  const std::string name = engines_.front()->device_name();  // "cuda:N"
  const size_t colon = name.find(':');
  return colon == std::string::npos ? 0 : std::atoi(name.c_str() + colon + 1);
#else
  return -1;
#endif
}

std::string TargetService::NcclUnavailableReason(const v1::Open& open) const {
#if DRAFTFEED_HAVE_NCCL
  if (!options_.enable_nccl) return "this target was started with --nccl=false";
  if (engines_.size() != 1 || !engines_.front()->has_device_capture()) {
    return absl::StrCat("this target runs on ", engines_.front()->device_name(),
                        engines_.size() > 1 ? " and other devices" : "",
                        "; NCCL needs a target with exactly one GPU");
  }
  if (open.nccl_unique_id().size() != 128) {
    return absl::StrCat("Open.nccl_unique_id has ", open.nccl_unique_id().size(),
                        " bytes, an ncclUniqueId has 128");
  }
  if (open.transport() == v1::TRANSPORT_AUTO && open.host_id() != LocalHostId()) {
    return "the trainer runs on another host (or did not say which)";
  }
  const int device = nccl_device();
  if (!open.gpu_uuid().empty() && open.gpu_uuid() == CudaDeviceUuid(device)) {
    return absl::StrCat("the trainer uses this target's own GPU (cuda:", device,
                        "); NCCL needs two GPUs");
  }
  return "";
#else
  return "this target was built without NCCL";
#endif
}

int64_t TargetService::open_streams() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(streams_.size());
}

}  // namespace draftfeed
