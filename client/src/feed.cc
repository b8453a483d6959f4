// The public Feed: opening (the first target fixes the model), Submit and
// Next against the batch table, Close, and the statistics.
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/src/feed_impl.h"
#include "client/src/target_info.h"
#include "client/src/target_outputs.h"
#include "common/fp8_capture.h"
#include "common/status_macros.h"
#include "common/thread_name.h"

namespace draftfeed {
namespace {

// An fp8_e4m3 result in host memory, dequantized into a bf16 buffer from the
// pool (the fp8 one goes back to it). Runs outside the feed's lock, on the
// caller of Next(): ~1 ns a value (draftfeed-bench-codec).
// Target outputs after the hidden states are copied over unchanged, at their
// new offsets.
absl::Status DequantizeToBf16(HostBufferPool& pool, HiddenBatch& r) {
  const int64_t T = r.num_tokens, K = r.num_layers, H = r.hidden_size;
  const int64_t fp8_hidden = CaptureBytesPerToken(CaptureEncoding::kFp8E4m3, K, H);
  const int64_t tail = r.bytes_per_token - fp8_hidden;  // the target outputs' bytes
  const int64_t row = K * H * 2 + tail;
  const size_t bytes = static_cast<size_t>(T * row);
  std::shared_ptr<std::byte> bf16 = pool.Acquire(bytes);
  if (bf16 == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", bytes, " bytes to dequantize batch ", r.batch_id));
  }
  auto* out = reinterpret_cast<uint16_t*>(bf16.get());
  if (tail == 0) {
    DF_RETURN_IF_ERROR(DecodeFp8CaptureToBf16(r.bytes(), T, K, H,
                                              std::span<uint16_t>(out, static_cast<size_t>(T * K * H))));
  } else {
    for (int64_t t = 0; t < T; ++t) {
      const std::span<const std::byte> in = r.bytes().subspan(t * r.bytes_per_token, fp8_hidden);
      std::byte* dst = bf16.get() + t * row;
      DF_RETURN_IF_ERROR(DecodeFp8CaptureToBf16(
          in, 1, K, H,
          std::span<uint16_t>(reinterpret_cast<uint16_t*>(dst), static_cast<size_t>(K * H))));
      std::memcpy(dst + K * H * 2, r.bytes().data() + t * r.bytes_per_token + fp8_hidden,
                  static_cast<size_t>(tail));
    }
  }
  const int64_t shift = K * H * 2 - fp8_hidden;
  for (int64_t* offset : {&r.outputs.argmax, &r.outputs.top_k_ids, &r.outputs.top_k_logprobs,
                          &r.outputs.probs_scale, &r.outputs.probs}) {
    if (*offset >= 0) *offset += shift;
  }
  r.buffer = std::move(bf16);
  r.num_bytes = bytes;
  r.encoding = Encoding::kBf16;
  r.bytes_per_token = row;
  return absl::OkStatus();
}

}  // namespace

Feed::Feed(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Feed::~Feed() { (void)Close(); }

absl::StatusOr<std::unique_ptr<Feed>> Feed::Open(const FeedOptions& options) {
  if (options.targets.empty()) return absl::InvalidArgumentError("FeedOptions.targets is empty");
  DF_ASSIGN_OR_RETURN(TargetOutputs outputs, CheckedTargetOutputs(options.target_outputs));
  if (options.layers.empty() && outputs.empty()) {
    return absl::InvalidArgumentError(
        "FeedOptions.layers is empty: name the layer ids to capture (or ask for target_outputs)");
  }
  if (options.prefetch < 1) return absl::InvalidArgumentError("FeedOptions.prefetch must be >= 1");
  if (options.credits_per_target < 1) {
    return absl::InvalidArgumentError("FeedOptions.credits_per_target must be >= 1");
  }
  if (options.connections_per_target < 1 || options.connections_per_target > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("FeedOptions.connections_per_target must be in [1, 64], got ",
                     options.connections_per_target));
  }
  if (!EncodingFromWire(static_cast<int>(options.encoding)).has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("FeedOptions.encoding is ", static_cast<int>(options.encoding),
                     "; this client reads bf16 (1) and fp8_e4m3 (2)"));
  }
  if (!(options.stats_window_s > 0 && std::isfinite(options.stats_window_s))) {
    return absl::InvalidArgumentError(
        absl::StrCat("FeedOptions.stats_window_s must be a number of seconds > 0, got ",
                     options.stats_window_s));
  }
  if (options.fp8_raw && options.encoding != Encoding::kFp8E4m3) {
    return absl::InvalidArgumentError(
        absl::StrCat("FeedOptions.fp8_raw asks for the fp8 bytes, but FeedOptions.encoding is ",
                     std::string(EncodingName(options.encoding)), ", not fp8_e4m3"));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->outputs_layout = LayoutOf(outputs);
  impl->outputs = std::move(outputs);
  impl->window = FeedWindow(options.stats_window_s);
  impl->read_handoff = options.read_handoff.value_or(std::thread::hardware_concurrency() >= 4);
  // Idle cap: the prefetch window plus one batch in the trainer's hands. A
  // batch larger than prefetch_bytes is let through alone: two such buffers
  // (the one arriving, the one in the trainer's hands) stay for reuse anyway.
  impl->pool = std::make_unique<HostBufferPool>(2 * options.prefetch_bytes, HostAllocator::Heap(),
                                                HostBufferPool::Reuse{.keep_buffers = 2});
  DF_ASSIGN_OR_RETURN(impl->transports, MakeClientTransports(options, impl->pool.get()));
  DF_ASSIGN_OR_RETURN(impl->credentials, ClientCredentials::Create(options.tls, options.token));
  impl->fingerprint = options.expected_fingerprint;
  if (!impl->fingerprint.empty()) impl->fingerprint_source = "FeedOptions.expected_fingerprint";
  Impl& m = *impl;
  std::unique_ptr<Feed> feed(new Feed(std::move(impl)));

  // The first target that answers fixes the model every other must match, so
  // which target is "the other model" does not depend on connection races.
  std::vector<std::pair<std::string, std::string>> addresses;  // address, its dns name
  for (const std::string& t : options.targets) {
    DF_ASSIGN_OR_RETURN(std::vector<std::string> expanded, ExpandTarget(t));
    for (std::string& a : expanded) addresses.emplace_back(std::move(a), DnsNameOf(t));
  }
  if (m.fingerprint.empty()) {
    std::vector<std::string> errors;
    bool all_unauthenticated = true;
    for (const auto& [a, dns_name] : addresses) {
      auto stub = v1::TargetService::NewStub(MakeChannel(a, *m.credentials, dns_name));
      auto info = QueryInfo(stub.get(), a, options.connect_timeout_s, *m.credentials);
      if (info.ok()) {
        m.fingerprint = info->fingerprint;
        m.fingerprint_source = absl::StrCat(a, " (", info->model_id, ")");
        m.hidden_size = info->hidden_size;
        break;
      }
      errors.push_back(std::string(info.status().message()));
      all_unauthenticated &= info.status().code() == absl::StatusCode::kUnauthenticated;
    }
    if (m.fingerprint.empty()) {
      // Every target refusing the token is not a target being down: no retry
      // helps until the token (or the targets' token file) changes.
      return absl::Status(
          all_unauthenticated ? absl::StatusCode::kUnauthenticated : absl::StatusCode::kUnavailable,
          absl::StrCat("no target could be reached: ", absl::StrJoin(errors, "; ")));
    }
  }
  for (const std::string& t : options.targets) {
    DF_RETURN_IF_ERROR(m.AddTargets(t));
  }
  // Wait until every initial target has connected, been refused, or failed once.
  std::unique_lock<std::mutex> lock(m.mu);
  m.cv.wait(lock, [&] {
    for (const auto& t : m.targets) {
      if (t->state == Impl::State::kConnecting) return false;
    }
    return true;
  });
  // A target that serves another model (or lacks a layer) is left out,
  // `refused` in Stats(), while the others serve; only when every target
  // refused does Open fail, with their reasons.
  std::vector<std::string> refusals;
  absl::StatusCode refusal_code = absl::StatusCode::kOk;
  for (const auto& t : m.targets) {
    if (t->state != Impl::State::kRefused) continue;
    if (refusals.empty()) refusal_code = t->refusal.code();
    refusals.push_back(std::string(t->refusal.message()));
  }
  if (!refusals.empty() && refusals.size() == m.targets.size()) {
    const absl::Status refused(refusal_code, absl::StrJoin(refusals, "; "));
    lock.unlock();
    return refused;
  }
  if (!m.AnyLive()) {
    const absl::Status none =
        absl::UnavailableError(absl::StrCat("no target could be reached: ", m.TargetErrors()));
    lock.unlock();
    return none;
  }
  if (m.hidden_size == 0) {
    for (const auto& t : m.targets) {
      if (t->state == Impl::State::kLive) m.hidden_size = t->info.hidden_size;
    }
  }
  m.supervisor = std::thread([&m] {
    NameThisThread("df-supervise");
    m.SuperviseLoop();
  });
  return feed;
}

absl::Status Feed::AddTarget(const std::string& address) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->closing) return absl::FailedPreconditionError("feed is closed");
  }
  return impl_->AddTargets(address);
}

absl::StatusOr<uint64_t> Feed::Submit(std::vector<int32_t> token_ids,
                                      std::vector<int32_t> seq_lens) {
  Impl& m = *impl_;
  const int64_t bytes = static_cast<int64_t>(token_ids.size()) * m.RequestedBytesPerToken();
  std::unique_lock<std::mutex> lock(m.mu);
  m.cv.wait(lock, [&] {
    if (m.closing || !m.fatal.ok()) return true;
    if (m.stats.outstanding >= m.options.prefetch) return false;
    return m.stats.outstanding == 0 || m.outstanding_bytes + bytes <= m.options.prefetch_bytes;
  });
  if (m.closing) return absl::FailedPreconditionError("feed is closed");
  if (!m.fatal.ok()) return m.fatal;
  const uint64_t id = m.next_id++;
  Impl::Pending& p = m.pending[id];
  p.hasher.Reset();
  p.token_ids = std::move(token_ids);
  p.seq_lens = std::move(seq_lens);
  m.unassigned.insert(id);
  m.outstanding_bytes += bytes;
  ++m.stats.submitted;
  ++m.stats.outstanding;
  m.Dispatch();
  return id;
}

absl::StatusOr<HiddenBatch> Feed::Next() {
  Impl& m = *impl_;
  std::unique_lock<std::mutex> lock(m.mu);
  if (m.pending.empty()) {
    return absl::FailedPreconditionError("Next() with no batch outstanding: Submit first");
  }
  std::map<uint64_t, Impl::Pending>::iterator it;
  m.cv.wait(lock, [&] {
    if (m.options.ordered) {
      it = m.pending.begin();
      return it->second.complete;
    }
    for (it = m.pending.begin(); it != m.pending.end(); ++it) {
      if (it->second.complete) return true;
    }
    return false;
  });
  Impl::Pending p = std::move(it->second);
  m.pending.erase(it);
  --m.stats.outstanding;
  m.outstanding_bytes -=
      static_cast<int64_t>(p.error.ok() ? p.result.token_ids.size() : p.token_ids.size()) *
      m.RequestedBytesPerToken();
  m.cv.notify_all();
  if (!p.error.ok()) return p.error;
  ++m.stats.delivered;
  m.stats.tokens_delivered += p.result.num_tokens;
  m.window.Record(m.SinceOpen(), WindowCounts(m.stats));
  lock.unlock();
  if (p.result.encoding == Encoding::kFp8E4m3 && p.result.device < 0 && !m.options.fp8_raw) {
    DF_RETURN_IF_ERROR(DequantizeToBf16(*m.pool, p.result));
  }
  return std::move(p.result);
}

int64_t Feed::Impl::CancelLocked(const std::vector<uint64_t>& batch_ids) {
  std::vector<uint64_t> ids = batch_ids;
  if (ids.empty()) {
    for (const auto& [id, p] : pending) ids.push_back(id);
  }
  int64_t n = 0;
  for (uint64_t id : ids) {
    auto it = pending.find(id);
    if (it == pending.end()) continue;
    Pending& p = it->second;
    if (p.conn != nullptr && !p.complete) {
      // Only cancelling its stream stops the target computing it (a batch
      // that is queued there is skipped, one running finishes and is dropped).
      Conn* c = p.conn;
      if (!c->cancelled_by_client) {
        c->cancelled_by_client = true;
        c->stream.TryCancel();
      }
    }
    Unassign(p);
    unassigned.erase(id);
    outstanding_bytes -= static_cast<int64_t>(p.error.ok() && p.complete ? p.result.token_ids.size()
                                                                         : p.token_ids.size()) *
                         RequestedBytesPerToken();
    pending.erase(it);
    --stats.outstanding;
    ++stats.cancelled;
    ++n;
  }
  cv.notify_all();
  return n;
}

int64_t Feed::Cancel(const std::vector<uint64_t>& batch_ids) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->CancelLocked(batch_ids);
}

absl::Status Feed::Close() {
  Impl& m = *impl_;
  std::vector<std::shared_ptr<Impl::Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.closing) return absl::OkStatus();
    m.closing = true;
    // Nobody can take what is outstanding any more: do not compute it.
    m.CancelLocked({});
    for (auto& t : m.targets) {
      if (t->conn) conns.push_back(t->conn);
    }
  }
  m.cv.notify_all();
  if (m.supervisor.joinable()) m.supervisor.join();
  // Half-close every stream: targets finish what they hold, then end it.
  for (auto& c : conns) Impl::StopWriter(c.get(), /*drop_queued=*/false);
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(m.options.batch_timeout_s));
  {
    std::unique_lock<std::mutex> lock(m.mu);
    m.cv.wait_until(lock, deadline, [&] {
      for (auto& c : conns) {
        if (!c->finished) return false;
      }
      return true;
    });
    for (auto& c : conns) {
      if (!c->finished) c->stream.TryCancel();
    }
  }
  for (auto& t : m.targets) {
    if (t->connector.joinable()) t->connector.join();
  }
  std::vector<std::shared_ptr<Impl::Conn>> dead;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    dead.swap(m.dead_conns);
  }
  for (auto& c : conns) {
    if (c->reader.joinable()) c->reader.join();
  }
  for (auto& c : dead) {
    if (c->reader.joinable()) c->reader.join();
  }
  std::lock_guard<std::mutex> lock(m.mu);
  m.final_stats = m.StatsLocked();
  m.final_stats->closed = true;
  return absl::OkStatus();
}

const TargetDescription& Feed::target() const {
  for (const auto& t : impl_->targets) {
    if (!t->info.fingerprint.empty()) return t->info;
  }
  return impl_->targets.front()->info;
}

void Feed::Impl::RecordWindowsLocked() {
  const double now = SinceOpen();
  window.Record(now, WindowCounts(stats));
  for (const auto& t : targets) t->window.Record(now, WindowCounts(t->stats));
}

FeedStats Feed::Impl::StatsLocked() {
  FeedStats s = stats;
  const double now = SinceOpen();
  SetRates(now, window, s);
  s.outstanding_bytes = outstanding_bytes;
  s.waiting_dispatch = static_cast<int64_t>(unassigned.size());
  s.buffer_allocations = pool->allocations() + transports->allocations();
  for (const auto& t : targets) {
    TargetStats ts = t->stats;
    SetRates(now, t->joined_s, t->window, ts);
    switch (t->state) {
      case State::kConnecting:
        ts.state = "connecting";
        break;
      case State::kLive:
        ts.state = "live";
        ++s.live_targets;
        break;
      case State::kDown:
        ts.state = "down";
        break;
      case State::kRefused:
        ts.state = "refused";
        break;
    }
    s.targets.push_back(std::move(ts));
  }
  return s;
}

FeedStats Feed::Stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->final_stats.has_value()) return *impl_->final_stats;
  return impl_->StatsLocked();
}

}  // namespace draftfeed
