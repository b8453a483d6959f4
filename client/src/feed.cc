#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "draftfeed/client.h"
#include "draftfeed/v1/checksum.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"

namespace draftfeed {

namespace {

using Clock = std::chrono::steady_clock;

absl::Status FromGrpc(const grpc::Status& s, const std::string& context) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(context, ": ", s.error_message()));
}

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

TargetDescription Describe(const std::string& address, const v1::TargetInfo& info) {
  TargetDescription d;
  d.address = address;
  d.model_id = info.model_id();
  d.architecture = info.architecture();
  d.fingerprint = info.fingerprint();
  d.server_version = info.server_version();
  d.num_layers = info.num_layers();
  d.hidden_size = info.hidden_size();
  d.vocab_size = info.vocab_size();
  d.max_batch_tokens = info.max_batch_tokens();
  d.devices.assign(info.devices().begin(), info.devices().end());
  d.layer_types.assign(info.layer_types().begin(), info.layer_types().end());
  return d;
}

}  // namespace

absl::StatusOr<TargetDescription> DescribeTarget(const std::string& address, double timeout_s) {
  auto stub = v1::TargetService::NewStub(MakeChannel(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  ctx.set_wait_for_ready(true);
  v1::TargetInfo info;
  grpc::Status s = stub->GetTargetInfo(&ctx, v1::GetTargetInfoRequest(), &info);
  if (!s.ok()) return FromGrpc(s, absl::StrCat("target ", address, ": GetTargetInfo"));
  return Describe(address, info);
}

struct Feed::Impl {
  struct Pending {
    std::vector<int32_t> token_ids;
    std::vector<int32_t> seq_lens;
    std::vector<uint16_t> hidden;
    int64_t tokens_received = 0;
    int target = -1;
    bool complete = false;
    absl::Status error;
    HiddenBatch result;
  };

  struct Target {
    std::string address;
    TargetDescription info;
    std::unique_ptr<v1::TargetService::Stub> stub;
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream;
    std::mutex write_mu;
    std::thread reader;
    int32_t credits = 0;
    int64_t outstanding_batches = 0;  // guarded by Impl::mu
    int64_t outstanding_tokens = 0;   // guarded by Impl::mu
    bool alive = true;                // guarded by Impl::mu
    absl::Status end_status;          // guarded by Impl::mu
  };

  FeedOptions options;
  std::vector<std::unique_ptr<Target>> targets;
  Clock::time_point opened_at = Clock::now();

  mutable std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Pending> pending;  // by batch id; ids grow in submission order
  uint64_t next_id = 1;
  FeedStats stats;
  bool closing = false;

  int64_t K() const { return static_cast<int64_t>(options.layers.size()); }
  int64_t H() const { return targets.front()->info.hidden_size; }

  absl::Status OpenTarget(const std::string& address, const std::string& fingerprint) {
    auto t = std::make_unique<Target>();
    t->address = address;
    t->stub = v1::TargetService::NewStub(MakeChannel(address));
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(
                           static_cast<int64_t>(options.connect_timeout_s * 1000)));
      ctx.set_wait_for_ready(true);
      v1::TargetInfo info;
      grpc::Status s = t->stub->GetTargetInfo(&ctx, v1::GetTargetInfoRequest(), &info);
      if (!s.ok()) return FromGrpc(s, absl::StrCat("target ", address, ": GetTargetInfo"));
      t->info = Describe(address, info);
    }
    if (!fingerprint.empty() && t->info.fingerprint != fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "target ", address, " serves ", t->info.model_id, " (fingerprint ",
          t->info.fingerprint, ") but the feed expects fingerprint ", fingerprint,
          targets.empty() ? "" : absl::StrCat(" (from ", targets.front()->address, ", ",
                                              targets.front()->info.model_id, ")")));
    }
    t->stream = t->stub->StreamHiddenStates(&t->ctx);
    v1::StreamRequest req;
    v1::Open* open = req.mutable_open();
    for (int32_t l : options.layers) open->add_layers(l);
    open->set_encoding(v1::ENCODING_BF16);
    open->set_transport(v1::TRANSPORT_GRPC);
    open->set_expected_fingerprint(t->info.fingerprint);
    open->set_max_inflight_batches(options.credits_per_target);
    open->set_client_name(options.client_name);
    v1::StreamResponse resp;
    if (!t->stream->Write(req) || !t->stream->Read(&resp)) {
      return FromGrpc(t->stream->Finish(), absl::StrCat("target ", address, ": open stream"));
    }
    if (resp.msg_case() != v1::StreamResponse::kOpened) {
      return absl::InternalError(
          absl::StrCat("target ", address, ": expected Opened, got message ", resp.msg_case()));
    }
    t->credits = std::max(1, resp.opened().max_inflight_batches());
    Target* raw = t.get();
    targets.push_back(std::move(t));
    raw->reader = std::thread([this, raw] { ReadLoop(raw); });
    return absl::OkStatus();
  }

  void FailBatch(Pending& p, uint64_t id, absl::Status status) {
    p.complete = true;
    p.error = std::move(status);
    p.hidden.clear();
    ++stats.failed;
  }

  // Marks a batch's work on its target as over (credit returned).
  void ReleaseOnTarget(Target* t, const Pending& p) {
    --t->outstanding_batches;
    t->outstanding_tokens -= static_cast<int64_t>(p.token_ids.size());
  }

  void HandleResponse(Target* t, v1::StreamResponse& resp) {
    std::lock_guard<std::mutex> lock(mu);
    switch (resp.msg_case()) {
      case v1::StreamResponse::kChunk: {
        const v1::HiddenChunk& c = resp.chunk();
        auto it = pending.find(c.batch_id());
        if (it == pending.end() || it->second.complete) return;
        Pending& p = it->second;
        const int64_t T = static_cast<int64_t>(p.token_ids.size());
        const int64_t stride = K() * H();
        if (c.token_offset() < 0 || c.token_count() < 0 || c.token_offset() + c.token_count() > T ||
            static_cast<int64_t>(c.data().size()) != c.token_count() * stride * 2) {
          FailBatch(p, c.batch_id(),
                    absl::DataLossError(absl::StrCat(
                        "target ", t->address, " sent a malformed chunk for batch ", c.batch_id(),
                        ": tokens [", c.token_offset(), ", +", c.token_count(), ") of ", T, ", ",
                        c.data().size(), " bytes")));
          ReleaseOnTarget(t, p);
          cv.notify_all();
          return;
        }
        std::memcpy(p.hidden.data() + c.token_offset() * stride, c.data().data(), c.data().size());
        p.tokens_received += c.token_count();
        stats.bytes_received += static_cast<int64_t>(c.data().size());
        return;
      }
      case v1::StreamResponse::kDone: {
        const v1::BatchDone& d = resp.done();
        auto it = pending.find(d.batch_id());
        if (it == pending.end() || it->second.complete) return;
        Pending& p = it->second;
        ReleaseOnTarget(t, p);
        const int64_t T = static_cast<int64_t>(p.token_ids.size());
        if (p.tokens_received != T || d.tokens() != T) {
          FailBatch(p, d.batch_id(),
                    absl::DataLossError(absl::StrCat("batch ", d.batch_id(), " from ", t->address,
                                                     ": received ", p.tokens_received, " of ", T,
                                                     " tokens")));
        } else if (options.verify_checksum &&
                   v1::PayloadChecksum(p.hidden.data(), p.hidden.size() * 2) != d.checksum()) {
          FailBatch(p, d.batch_id(),
                    absl::DataLossError(absl::StrCat("batch ", d.batch_id(), " from ", t->address,
                                                     ": checksum mismatch")));
        } else {
          p.complete = true;
          HiddenBatch& r = p.result;
          r.batch_id = d.batch_id();
          r.num_tokens = T;
          r.num_layers = K();
          r.hidden_size = H();
          r.hidden = std::move(p.hidden);
          r.token_ids = std::move(p.token_ids);
          r.seq_lens = std::move(p.seq_lens);
          r.checksum = d.checksum();
          r.target = t->address;
          r.queue_ms = d.timings().queue_ms();
          r.forward_ms = d.timings().forward_ms();
          r.send_ms = d.timings().send_ms();
        }
        cv.notify_all();
        return;
      }
      case v1::StreamResponse::kError: {
        const v1::BatchError& e = resp.error();
        auto it = pending.find(e.batch_id());
        if (it == pending.end() || it->second.complete) return;
        ReleaseOnTarget(t, it->second);
        FailBatch(it->second, e.batch_id(),
                  absl::Status(static_cast<absl::StatusCode>(e.code()),
                               absl::StrCat("target ", t->address, ": ", e.message())));
        cv.notify_all();
        return;
      }
      default:
        return;
    }
  }

  void ReadLoop(Target* t) {
    v1::StreamResponse resp;
    while (t->stream->Read(&resp)) HandleResponse(t, resp);
    grpc::Status s = t->stream->Finish();
    std::lock_guard<std::mutex> lock(mu);
    t->alive = false;
    t->end_status = FromGrpc(s, absl::StrCat("target ", t->address));
    // Batches still on this target cannot complete there.
    for (auto& [id, p] : pending) {
      if (!p.complete && p.target == TargetIndex(t)) {
        ReleaseOnTarget(t, p);
        FailBatch(p, id,
                  t->end_status.ok()
                      ? absl::UnavailableError(absl::StrCat("target ", t->address,
                                                            " closed the stream before batch ",
                                                            id, " was done"))
                      : t->end_status);
      }
    }
    cv.notify_all();
  }

  int TargetIndex(const Target* t) const {
    for (size_t i = 0; i < targets.size(); ++i) {
      if (targets[i].get() == t) return static_cast<int>(i);
    }
    return -1;
  }

  // Least outstanding tokens among live targets with a free credit.
  int PickTarget() const {
    int best = -1;
    for (size_t i = 0; i < targets.size(); ++i) {
      const Target& t = *targets[i];
      if (!t.alive || t.outstanding_batches >= t.credits) continue;
      if (best < 0 || t.outstanding_tokens < targets[best]->outstanding_tokens) {
        best = static_cast<int>(i);
      }
    }
    return best;
  }

  bool AnyAlive() const {
    for (const auto& t : targets) {
      if (t->alive) return true;
    }
    return false;
  }

  absl::Status DeadError() const {
    std::vector<std::string> why;
    for (const auto& t : targets) why.push_back(std::string(t->end_status.message()));
    return absl::UnavailableError(
        absl::StrCat("no live target left: ", absl::StrJoin(why, "; ")));
  }
};

Feed::Feed(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Feed::~Feed() { (void)Close(); }

absl::StatusOr<std::unique_ptr<Feed>> Feed::Open(const FeedOptions& options) {
  if (options.targets.empty()) return absl::InvalidArgumentError("FeedOptions.targets is empty");
  if (options.layers.empty()) {
    return absl::InvalidArgumentError("FeedOptions.layers is empty: name the layer ids to capture");
  }
  if (options.prefetch < 1) return absl::InvalidArgumentError("FeedOptions.prefetch must be >= 1");
  if (options.credits_per_target < 1) {
    return absl::InvalidArgumentError("FeedOptions.credits_per_target must be >= 1");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  std::string fingerprint = options.expected_fingerprint;
  for (const std::string& address : options.targets) {
    absl::Status s = impl->OpenTarget(address, fingerprint);
    if (!s.ok()) {
      std::unique_ptr<Feed> cleanup(new Feed(std::move(impl)));
      return s;
    }
    if (fingerprint.empty()) fingerprint = impl->targets.back()->info.fingerprint;
  }
  return std::unique_ptr<Feed>(new Feed(std::move(impl)));
}

absl::StatusOr<uint64_t> Feed::Submit(std::vector<int32_t> token_ids,
                                      std::vector<int32_t> seq_lens) {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  int target = -1;
  m.cv.wait(lock, [&] {
    if (m.closing || !m.AnyAlive()) return true;
    if (m.stats.outstanding >= m.options.prefetch) return false;
    target = m.PickTarget();
    return target >= 0;
  });
  if (m.closing) return absl::FailedPreconditionError("feed is closed");
  if (!m.AnyAlive()) return m.DeadError();
  const uint64_t id = m.next_id++;
  Impl::Target* t = m.targets[target].get();
  v1::StreamRequest req;
  v1::Batch* b = req.mutable_batch();
  b->set_batch_id(id);
  b->mutable_token_ids()->Add(token_ids.begin(), token_ids.end());
  b->mutable_seq_lens()->Add(seq_lens.begin(), seq_lens.end());
  Impl::Pending& p = m.pending[id];
  p.target = target;
  p.hidden.assign(static_cast<size_t>(static_cast<int64_t>(token_ids.size()) * m.K() * m.H()), 0);
  p.token_ids = std::move(token_ids);
  p.seq_lens = std::move(seq_lens);
  ++t->outstanding_batches;
  t->outstanding_tokens += static_cast<int64_t>(p.token_ids.size());
  ++m.stats.submitted;
  ++m.stats.outstanding;
  lock.unlock();
  std::lock_guard<std::mutex> wlock(t->write_mu);
  if (!t->stream->Write(req)) {
    // The reader thread sees the stream end and fails this batch with the reason.
  }
  return id;
}

absl::StatusOr<HiddenBatch> Feed::Next() {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  if (m.pending.empty()) {
    return absl::FailedPreconditionError("Next() with no batch outstanding: Submit first");
  }
  auto it = m.pending.begin();
  m.cv.wait(lock, [&] { return it->second.complete; });
  Impl::Pending p = std::move(it->second);
  m.pending.erase(it);
  --m.stats.outstanding;
  m.cv.notify_all();
  if (!p.error.ok()) return p.error;
  ++m.stats.delivered;
  m.stats.tokens_delivered += p.result.num_tokens;
  return std::move(p.result);
}

absl::Status Feed::Close() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.closing) return absl::OkStatus();
    m.closing = true;
  }
  m.cv.notify_all();
  for (auto& t : m.targets) {
    {
      std::lock_guard<std::mutex> wlock(t->write_mu);
      t->stream->WritesDone();
    }
    if (t->reader.joinable()) t->reader.join();
  }
  std::lock_guard<std::mutex> lock(m.mu);
  for (auto& t : m.targets) {
    if (!t->end_status.ok() && t->end_status.code() != absl::StatusCode::kCancelled) {
      return t->end_status;
    }
  }
  return absl::OkStatus();
}

const TargetDescription& Feed::target() const { return impl_->targets.front()->info; }

FeedStats Feed::Stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  FeedStats s = impl_->stats;
  s.elapsed_s = std::chrono::duration<double>(Clock::now() - impl_->opened_at).count();
  return s;
}

}  // namespace draftfeed
