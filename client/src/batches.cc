// The feed's batch table as streams fill it: chunks claimed and landed (the
// BatchSink every transport delivers into), BatchDone and BatchError, and a
// finished batch's checks before it is handed out.
#include "absl/strings/str_cat.h"
#include "client/src/feed_impl.h"
#include "client/src/target_outputs.h"

namespace draftfeed {
namespace {

// The public mirror of the capture's encoding (draftfeed/client.h stands alone).
static_assert(static_cast<int>(Encoding::kBf16) == static_cast<int>(CaptureEncoding::kBf16));
static_assert(static_cast<int>(Encoding::kFp8E4m3) == static_cast<int>(CaptureEncoding::kFp8E4m3));
Encoding Public(CaptureEncoding e) { return static_cast<Encoding>(e); }

}  // namespace

std::optional<BatchSink::Landing> Feed::Impl::Claim(const void* stream, const ChunkHeader& c,
                                                    size_t payload_bytes, int device,
                                                    const Acquire& acquire) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = pending.find(c.batch_id);
  if (it == pending.end() || it->second.complete || it->second.conn != stream) {
    return std::nullopt;  // re-sent elsewhere, or already returned: drop it
  }
  Pending& p = it->second;
  Target* t = p.target;
  const int64_t T = static_cast<int64_t>(p.token_ids.size());
  p.last_progress = Clock::now();
  p.conn->last_progress = p.last_progress;
  if (c.token_offset < 0 || c.token_count < 0 || c.token_offset + c.token_count > T ||
      static_cast<int64_t>(payload_bytes) != c.token_count * t->bytes_per_token) {
    FailMalformedChunk(t, c.batch_id, p, c, payload_bytes);
    return std::nullopt;
  }
  if (p.buffer == nullptr) {
    // Pooled and uninitialised: every byte is overwritten by a chunk before
    // the batch completes (tokens_received must reach T).
    p.bytes = static_cast<size_t>(T * t->bytes_per_token);
    p.buffer = acquire(p.bytes);
    p.device = device;
    if (p.buffer == nullptr) {
      Fail(c.batch_id, p,
           absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", T * t->bytes_per_token,
                                                     " bytes for batch ", c.batch_id)));
      cv.notify_all();
      return std::nullopt;
    }
  }
  Landing landing;
  landing.buffer = p.buffer;
  landing.dst = p.buffer.get() + c.token_offset * t->bytes_per_token;
  landing.epoch = p.epoch;
  landing.hash = options.verify_checksum && p.hashed_in_order && p.landings == 0 &&
                 c.token_offset == p.tokens_received;
  if (landing.hash) landing.hasher = p.hasher;
  ++p.landings;
  return landing;
}

void Feed::Impl::Landed(const void* stream, const ChunkHeader& c, size_t payload_bytes,
                        Landing* landing, bool ok, std::optional<uint64_t> checksum,
                        double recv_ms) {
  std::lock_guard<std::mutex> lock(mu);
  if (ok) stats.bytes_received += static_cast<int64_t>(payload_bytes);
  if (landing == nullptr) return;
  auto it = pending.find(c.batch_id);
  if (it == pending.end() || it->second.complete || it->second.conn != stream ||
      it->second.epoch != landing->epoch) {
    return;  // re-assigned meanwhile: these bytes are not wanted
  }
  Pending& p = it->second;
  --p.landings;
  p.last_progress = Clock::now();
  p.conn->last_progress = p.last_progress;
  if (!ok) {
    FailMalformedChunk(p.target, c.batch_id, p, c, payload_bytes);
    return;
  }
  if (options.verify_checksum) {
    if (landing->hash) {
      p.hasher = landing->hasher;
    } else {
      p.hashed_in_order = false;
    }
  }
  if (checksum.has_value()) p.transport_checksum = checksum;
  p.result.recv_ms = recv_ms;
  p.tokens_received += c.token_count;
  if (p.landings == 0 && p.early_done.has_value()) {
    const v1::BatchDone d = *std::move(p.early_done);
    p.early_done.reset();
    FinishBatch(p.target, c.batch_id, p, d);
  }
}

void Feed::Impl::FailBatch(const void* stream, uint64_t id, absl::Status why) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = pending.find(id);
  if (it == pending.end() || it->second.complete || it->second.conn != stream) return;
  Fail(id, it->second, std::move(why));
  cv.notify_all();
}

void Feed::Impl::StreamBroken(const void* stream, std::string why, bool cancel) {
  auto* conn = static_cast<Conn*>(const_cast<void*>(stream));
  std::lock_guard<std::mutex> lock(mu);
  if (!closing) conn->target->stats.last_error = std::move(why);
  if (cancel) conn->stream.TryCancel();  // its reader re-sends its batches
}

void Feed::Impl::FailMalformedChunk(Target* t, uint64_t id, Pending& p, const ChunkHeader& c,
                                    size_t payload_bytes) {
  Fail(id, p,
       absl::DataLossError(absl::StrCat("target ", t->address, " sent a malformed chunk for batch ",
                                        id, ": tokens [", c.token_offset, ", +", c.token_count,
                                        ") of ", p.token_ids.size(), ", ", payload_bytes,
                                        " bytes")));
  cv.notify_all();
}

void Feed::Impl::HandleResponse(Target* t, Conn* conn, const v1::StreamResponse& resp) {
  std::lock_guard<std::mutex> lock(mu);
  uint64_t id = 0;
  switch (resp.msg_case()) {
    case v1::StreamResponse::kDone:
      id = resp.done().batch_id();
      break;
    case v1::StreamResponse::kError:
      id = resp.error().batch_id();
      break;
    default:
      return;
  }
  auto it = pending.find(id);
  if (it == pending.end() || it->second.complete || it->second.conn != conn) {
    // A batch that was re-sent elsewhere (or already returned, or cancelled
    // with its stream): drop it.
    if (resp.msg_case() == v1::StreamResponse::kDone && !conn->cancelled_by_client) {
      ++stats.duplicates_dropped;
    }
    return;
  }
  Pending& p = it->second;
  p.last_progress = Clock::now();
  conn->last_progress = p.last_progress;
  if (resp.msg_case() == v1::StreamResponse::kError) {
    const v1::BatchError& e = resp.error();
    const auto code = static_cast<absl::StatusCode>(e.code());
    if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kResourceExhausted) {
      // The target is draining or full: the batch is fine, send it elsewhere.
      Unassign(p);
      unassigned.insert(id);
      ++stats.resent;
    } else {
      Fail(id, p, absl::Status(code, absl::StrCat("target ", t->address, ": ", e.message())));
    }
    cv.notify_all();
    return;
  }
  if (p.landings > 0) {
    p.early_done = resp.done();  // the bytes' landing finishes the batch (Landed)
    return;
  }
  FinishBatch(t, id, p, resp.done());
}

// A batch's BatchDone with its payload in place: check it, hand it out.
void Feed::Impl::FinishBatch(Target* t, uint64_t id, Pending& p, const v1::BatchDone& d) {
  const int64_t T = static_cast<int64_t>(p.token_ids.size());
  if (p.tokens_received != T || d.tokens() != T) {
    Fail(id, p,
         absl::DataLossError(absl::StrCat("batch ", id, " from ", t->address, ": received ",
                                          p.tokens_received, " of ", T, " tokens")));
  } else if (options.verify_checksum &&
             (p.transport_checksum.has_value() ? *p.transport_checksum
              : p.hashed_in_order && p.hasher.bytes_seen() == p.bytes
                  ? p.hasher.Finish()
                  : v1::PayloadChecksum(p.buffer.get(), p.bytes)) != d.checksum()) {
    Fail(id, p,
         absl::DataLossError(
             absl::StrCat("batch ", id, " from ", t->address, ": checksum mismatch")));
  } else {
    ++t->stats.delivered_batches;
    t->stats.delivered_tokens += T;
    t->window.Record(SinceOpen(), WindowCounts(t->stats));
    if (d.timings().forward_ms() > 0) {
      const double inst = static_cast<double>(T) / (d.timings().forward_ms() / 1000.0);
      t->rate_tps = t->rate_tps > 0 ? 0.7 * t->rate_tps + 0.3 * inst : inst;
    }
    Unassign(p);
    p.complete = true;
    HiddenBatch& r = p.result;
    r.batch_id = id;
    r.num_tokens = T;
    r.num_layers = K();
    r.hidden_size = hidden_size;
    r.encoding = Public(t->encoding);
    r.bytes_per_token = t->bytes_per_token;
    r.outputs = RowOffsets(outputs, outputs_layout, t->hidden_bytes_per_token);
    r.num_bytes = p.bytes;
    r.buffer = std::move(p.buffer);
    r.device = p.device;
    r.token_ids = std::move(p.token_ids);
    r.seq_lens = std::move(p.seq_lens);
    r.checksum = d.checksum();
    r.target = t->address;
    r.queue_ms = d.timings().queue_ms();
    r.forward_ms = d.timings().forward_ms();
    r.send_ms = d.timings().send_ms();
  }
  cv.notify_all();
}

void Feed::Impl::Unassign(Pending& p) {
  if (p.target != nullptr) {
    --p.target->stats.outstanding_batches;
    p.target->stats.outstanding_tokens -= static_cast<int64_t>(p.token_ids.size());
  }
  p.target = nullptr;
  p.conn = nullptr;
  p.tokens_received = 0;
  ++p.epoch;  // bytes still landing from the old assignment are dropped
  p.landings = 0;
  p.early_done.reset();
  p.hasher.Reset();
  p.hashed_in_order = true;
}

void Feed::Impl::Fail(uint64_t id, Pending& p, absl::Status status) {
  Unassign(p);
  unassigned.erase(id);
  p.complete = true;
  p.error = std::move(status);
  p.buffer.reset();
  ++stats.failed;
}

}  // namespace draftfeed
