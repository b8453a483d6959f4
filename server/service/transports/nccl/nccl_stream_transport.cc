#include "server/service/transports/nccl/nccl_stream_transport.h"

#include <atomic>
#include <cstdlib>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/nccl/nccl_peer.h"
#include "common/nccl_hosts.h"
#include "common/thread_name.h"
#include "server/service/transports/nccl/nccl_hosts_rule.h"

namespace draftfeed {

namespace {

// The GPU that NCCL streams send from, or -1 when NCCL is not offered.
int NcclDevice(const TransportEnv& env) {
  if (!env.enable_nccl || env.engines.size() != 1 || !env.engines.front()->has_device_capture()) {
    return -1;
  }
  const std::string name = env.engines.front()->device_name();  // "cuda:N"
  const size_t colon = name.find(':');
  return colon == std::string::npos ? 0 : std::atoi(name.c_str() + colon + 1);
}

// What the NCCL sink of one batch hands to its done callback (the checksum
// travels in the engine's Copied).
struct NcclBatch {
  double send_ms = 0;  // the send's GPU time from the forward's end to the send's end
};

// The trainer's side of the communicator is in an unknown state: end the
// stream (UNAVAILABLE: the client re-sends its batches on a new stream).
void NcclBroken(StreamLink& link, const absl::Status& s) {
  link.Fail(absl::UnavailableError(absl::StrCat("nccl transfer failed: ", s.message())));
}

// On the engine's copy thread: once the forward has ended, announce the
// batch (the trainer posts its receive when it reads this, so no receive
// sits on the trainer's GPU through the forward), then wait for the send.
// send_ms is the send's GPU time from the forward's end: the announcement's
// round trip plus the transfer.
Engine::Copied FinishSend(const std::shared_ptr<StreamLink>& link, NcclPeer& peer, double timeout_s,
                          uint64_t batch_id, int64_t tokens, NcclBatch& state,
                          const NcclPeer::Op& op) {
  auto cancelled = [link] { return link->cancelled(); };
  absl::Status ready = peer.WaitReady(op, timeout_s, cancelled);
  if (ready.ok()) {
    v1::StreamResponse msg;
    v1::HiddenChunk* c = msg.mutable_chunk();
    c->set_batch_id(batch_id);
    c->set_token_offset(0);
    c->set_token_count(tokens);
    if (!link->Send(std::move(msg))) {
      // No receive will ever match this send.
      peer.Abort();
      ready = absl::CancelledError("stream closed before the batch was announced");
    }
  }
  double gpu_ms = 0;
  absl::StatusOr<uint64_t> sum =
      ready.ok() ? peer.WaitOp(op, timeout_s, cancelled, &gpu_ms) : absl::StatusOr<uint64_t>(ready);
  state.send_ms = gpu_ms;
  if (!sum.ok()) {
    // Whatever the trainer posted will never be matched: the stream's
    // communicator is out of step, so the stream ends (its batches are
    // re-sent by the client).
    NcclBroken(*link, sum.status());
    return Engine::Copied{sum.status(), std::nullopt};
  }
  return Engine::Copied{absl::OkStatus(), *sum};
}

// Runs on the scheduler worker while the batch's forward runs: posts the
// send behind the forward (on the engine's send stream) and returns at
// once, so the next forward starts while this capture travels.
absl::StatusOr<Engine::DeviceWait> PostSend(const std::shared_ptr<StreamLink>& link,
                                            const std::shared_ptr<NcclPeer>& peer, double timeout_s,
                                            uint64_t batch_id, int64_t tokens,
                                            const std::shared_ptr<NcclBatch>& state,
                                            const Engine::DeviceView& view) {
  absl::StatusOr<NcclPeer::Op> op = peer->PostSend(view.data, view.bytes, view.stream, timeout_s,
                                                   [link] { return link->cancelled(); });
  if (!op.ok()) {
    NcclBroken(*link, op.status());
    return op.status();
  }
  return Engine::DeviceWait([link, peer, timeout_s, batch_id, tokens, state, op = *op] {
    return FinishSend(link, *peer, timeout_s, batch_id, tokens, *state, op);
  });
}

class NcclStreamTransport final : public StreamTransport {
 public:
  NcclStreamTransport(const TransportEnv& env, const v1::Open& open,
                      std::shared_ptr<StreamLink> link, std::unique_ptr<StreamTransport> fallback)
      : device_(NcclDevice(env)),
        timeout_s_(env.nccl_timeout_s),
        setup_timeout_s_(env.nccl_setup_timeout_s),
        unique_id_(open.nccl_unique_id()),
        across_hosts_(NcclAcrossHosts(env, open)),
        hosts_note_(NcclHostsNote(env, open)),
        link_(std::move(link)),
        fallback_(std::move(fallback)) {}

  // The setup thread gives up once the link is cancelled (every NCCL wait
  // polls it), which the stream's end has done by now.
  ~NcclStreamTransport() override {
    if (setup_.joinable()) setup_.join();
  }

  // Joins the trainer's communicator off the reactor thread; the stream reads
  // nothing more until the two sides have shaken hands. Opened goes out once
  // the communicator is up (or says why not), since the trainer joins the
  // handshake only after reading it.
  std::optional<TransportOpened> Start() override {
    setup_ = std::thread([this] {
      NameThisThread("df-nccl-setup");
      Setup();
    });
    return std::nullopt;
  }

  void Post(uint64_t batch_id, WorkItem& item) override {
    if (fell_back_) return fallback_->Post(batch_id, item);
    auto state = std::make_shared<NcclBatch>();
    const int64_t tokens = static_cast<int64_t>(item.token_ids.size());
    item.device_sink = [link = link_, peer = peer_, state, batch_id, tokens,
                        timeout_s = timeout_s_](const Engine::DeviceView& view) {
      return PostSend(link, peer, timeout_s, batch_id, tokens, state, view);
    };
    item.done = [state, done = std::move(item.done)](absl::StatusOr<ForwardResult> r) {
      if (r.ok()) r->send_ms = state->send_ms;  // r->checksum is the send's
      done(std::move(r));
    };
  }

  // The announcement went out when the send started; BatchDone alone follows.
  std::unique_ptr<PayloadWriter> WritePayload(uint64_t batch_id,
                                              std::shared_ptr<ForwardResult> result) override {
    if (fell_back_) return fallback_->WritePayload(batch_id, std::move(result));
    return nullptr;
  }

 private:
  void Setup() {
    auto cancelled = [link = link_] { return link->cancelled(); };
    absl::StatusOr<std::unique_ptr<NcclPeer>> peer =
        NcclPeer::Start(unique_id_, NcclPeer::kSenderRank, device_,
                        NcclSetupHint(across_hosts_, NcclUniqueIdAddress(unique_id_)));
    absl::Status status = peer.status();
    if (status.ok()) status = (*peer)->Wait(setup_timeout_s_, cancelled);
    if (!status.ok()) {
      if (fallback_ == nullptr) {
        link_->Fail(absl::Status(status.code(),
                                 absl::StrCat("transport nccl setup failed: ", status.message())));
        return;
      }
      // Set before Opened: the reactor posts no batch until then.
      fell_back_ = true;
      TransportOpened opened = *fallback_->Start();
      opened.note = absl::StrCat("auto fell back to grpc: nccl setup failed: ", status.message());
      link_->Opened(std::move(opened));
      return;
    }
    // Set before Opened, as above: batches are posted only after Ready.
    peer_ = *std::move(peer);
    link_->Opened({.transport = v1::TRANSPORT_NCCL,
                   .note = hosts_note_,
                   .ready = false,
                   .across_hosts = across_hosts_});
    absl::Status shook = peer_->Handshake(setup_timeout_s_, cancelled);
    if (shook.ok()) {
      link_->Ready();
    } else {
      link_->Fail(absl::UnavailableError(
          absl::StrCat("transport nccl handshake failed: ", shook.message())));
    }
  }

  const int device_;
  const double timeout_s_;
  const double setup_timeout_s_;
  const std::string unique_id_;
  const bool across_hosts_;
  const std::string hosts_note_;  // Opened.transport_note of a stream across hosts
  const std::shared_ptr<StreamLink> link_;
  const std::unique_ptr<StreamTransport> fallback_;
  std::shared_ptr<NcclPeer> peer_;  // shared with the batches in flight
  std::atomic<bool> fell_back_{false};
  std::thread setup_;
};

}  // namespace

std::string NcclUnavailableReason(const TransportEnv& env, const v1::Open* open) {
  if (!env.enable_nccl) return "this target was started with --nccl=false";
  if (env.engines.size() != 1 || !env.engines.front()->has_device_capture()) {
    return absl::StrCat("this target runs on ", env.engines.front()->device_name(),
                        env.engines.size() > 1 ? " and other devices" : "",
                        "; NCCL needs a target with exactly one GPU");
  }
  if (open == nullptr) return "";
  if (open->nccl_unique_id().size() != 128) {
    return absl::StrCat("Open.nccl_unique_id has ", open->nccl_unique_id().size(),
                        " bytes, an ncclUniqueId has 128");
  }
  if (std::string why = NcclHostsRefusal(env, *open); !why.empty()) return why;
  const int device = NcclDevice(env);
  if (!NcclAcrossHosts(env, *open) && !open->gpu_uuid().empty() &&
      open->gpu_uuid() == CudaDeviceUuid(device)) {
    return absl::StrCat("the trainer uses this target's own GPU (cuda:", device,
                        "); NCCL needs two GPUs");
  }
  return "";
}

std::unique_ptr<StreamTransport> MakeNcclStreamTransport(
    const TransportEnv& env, const v1::Open& open, std::shared_ptr<StreamLink> link,
    std::unique_ptr<StreamTransport> fallback) {
  return std::make_unique<NcclStreamTransport>(env, open, std::move(link), std::move(fallback));
}

}  // namespace draftfeed
