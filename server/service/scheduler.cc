#include "server/service/scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/thread_name.h"
#include "server/service/forward_chunks.h"
#include "server/service/elapsed.h"

namespace draftfeed {

Scheduler::Scheduler(std::vector<Engine*> engines, int64_t max_queued, double throttle_tokens_per_s,
                     int64_t pool_idle_bytes, HostAllocator host_allocator)
    // Two capture buffers of the size in use stay for reuse whatever the
    // idle cap: one batch is sent while the next forward's copy fills the other.
    : pool_(pool_idle_bytes, std::move(host_allocator), {.keep_buffers = 2}),
      max_queued_(max_queued),
      throttle_tokens_per_s_(throttle_tokens_per_s) {
  streams_[0];  // the default stream, uncapped
  lanes_.reserve(engines.size());
  for (Engine* engine : engines) {
    lanes_.push_back(std::make_unique<Lane>());
    lanes_.back()->engine = engine;
  }
  for (auto& lane : lanes_) {
    Lane* l = lane.get();
    l->completer = std::thread([this, l] {
      NameThisThread("df-complete");
      CompletionLoop(*l);
    });
    l->worker = std::thread([this, l] {
      NameThisThread("df-forward");
      WorkerLoop(*l);
    });
  }
}

Scheduler::~Scheduler() { Stop(); }

absl::Status Scheduler::Submit(WorkItem item) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("target is shutting down; send to another target");
    if (queued_ >= max_queued_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("target queue is full (", max_queued_,
                       " batches); retry later or lower the client's credits"));
    }
    auto it = streams_.find(item.stream);
    if (it == streams_.end() || it->second.removed) {
      return absl::NotFoundError(absl::StrCat("scheduler stream ", item.stream, " is closed"));
    }
    it->second.queue.push_back(Entry{std::move(item), std::chrono::steady_clock::now()});
    ++queued_;
  }
  cv_.notify_one();
  return absl::OkStatus();
}

uint64_t Scheduler::AddStream(int64_t max_pending_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_stream_++;
  streams_[id].max_pending_bytes = max_pending_bytes;
  return id;
}

void Scheduler::RemoveStream(uint64_t stream) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(stream);
    if (stream == 0 || it == streams_.end()) return;
    if (it->second.queue.empty()) {
      streams_.erase(it);
      return;
    }
    it->second.removed = true;  // eligible from now on, whatever it holds
  }
  cv_.notify_all();
}

void Scheduler::ChargePending(uint64_t stream, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(stream);
  if (it != streams_.end()) it->second.pending_bytes += bytes;
}

void Scheduler::ReleasePending(uint64_t stream, int64_t bytes) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = streams_.find(stream);
    if (it == streams_.end()) return;
    StreamQueue& s = it->second;
    const bool was_eligible = Eligible(s);
    s.pending_bytes = std::max<int64_t>(0, s.pending_bytes - bytes);
    wake = !was_eligible && Eligible(s) && !s.queue.empty();
  }
  if (wake) cv_.notify_all();
}

int64_t Scheduler::pending_bytes(uint64_t stream) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(stream);
  return it == streams_.end() ? 0 : it->second.pending_bytes;
}

bool Scheduler::Eligible(const StreamQueue& s) const {
  // Stopping drains everything queued: nobody will read those streams again.
  // Two of the stream's batches always fit, however large: one being written
  // while the next computes is the pipeline end-to-end speed relies on (a
  // 49,152-token bf16 capture of 5 layers at the 27B shape is 2.4 GB, more
  // than the default cap alone).
  return stopping_ || s.removed || s.max_pending_bytes <= 0 ||
         s.pending_bytes < std::max(s.max_pending_bytes, 2 * s.largest_result_bytes);
}

bool Scheduler::TakeLocked(Entry& out) {
  // At most --max_streams streams: a scan per batch costs far less than the
  // forward it starts.
  auto best = streams_.end();
  int64_t best_tag = 0;
  for (auto it = streams_.begin(); it != streams_.end(); ++it) {
    const StreamQueue& s = it->second;
    if (s.queue.empty() || !Eligible(s)) continue;
    const int64_t tag = std::max(s.vtime, vtime_);
    if (best == streams_.end() || tag < best_tag ||
        (tag == best_tag && s.last_taken < best->second.last_taken)) {
      best = it;
      best_tag = tag;
    }
  }
  if (best == streams_.end()) return false;
  StreamQueue& s = best->second;
  out = std::move(s.queue.front());
  s.queue.pop_front();
  --queued_;
  vtime_ = best_tag;
  s.vtime = best_tag + static_cast<int64_t>(out.item.token_ids.size());
  s.last_taken = ++taken_;
  s.pending_bytes += out.item.result_bytes;
  s.largest_result_bytes = std::max(s.largest_result_bytes, out.item.result_bytes);
  if (s.removed && s.queue.empty()) streams_.erase(best);
  return true;
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (joined_) return;
    joined_ = true;
    stopping_ = true;
  }
  cv_.notify_all();
  // Workers drain the queue; each completion thread then delivers what its
  // worker left and exits.
  for (auto& lane : lanes_) lane->worker.join();
  for (auto& lane : lanes_) lane->completer.join();
}

void Scheduler::FinishHalves(Lane& lane, Completion& c, absl::Status status, int halves) {
  // Notified under the lock: the engine's copy thread calls this, and once
  // the lock is released the completion thread may deliver the last batch and
  // Stop() may destroy the lane, condition variable included, before a
  // notify after the unlock ran (TSan: the destructor raced the broadcast).
  std::lock_guard<std::mutex> lock(lane.mu);
  if (c.status.ok()) c.status = std::move(status);
  c.halves_left -= halves;
  lane.cv.notify_all();
}

void Scheduler::WorkerLoop(Lane& lane) {
  for (;;) {
    Entry entry;
    {
      std::unique_lock<std::mutex> lock(mu_);
      bool taken = false;
      cv_.wait(lock, [&] {
        taken = TakeLocked(entry);
        return taken || (stopping_ && queued_ == 0);
      });
      if (!taken) break;  // stopping and drained
      ++running_;
    }
    RunBatch(lane, entry);
  }
  {
    std::lock_guard<std::mutex> lock(lane.mu);
    lane.worker_exited = true;
  }
  lane.cv.notify_all();
}

void Scheduler::RunBatch(Lane& lane, Entry& entry) {
  WorkItem& item = entry.item;
  const auto tokens = static_cast<int64_t>(item.token_ids.size());
  std::vector<ForwardChunk> chunks;
  if (item.max_forward_tokens > 0 && tokens > item.max_forward_tokens) {
    chunks = PlanForwardChunks(item.seq_lens, item.max_forward_tokens);
  } else {
    chunks.push_back(ForwardChunk{.token_begin = 0, .token_end = tokens, .seq_lens = {}});
  }
  // Every part's Completion calls the one `done`, in order (one completion
  // thread per lane).
  auto done = std::make_shared<std::function<void(absl::StatusOr<ForwardResult>)>>(
      std::move(item.done));
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ForwardChunk& chunk = chunks[i];
    auto c = std::make_shared<Completion>();
    c->done = [done](absl::StatusOr<ForwardResult> r) { (*done)(std::move(r)); };
    c->tokens = chunk.tokens();
    c->result.token_offset = chunk.token_begin;
    c->result.last_part = i + 1 == chunks.size();
    {
      // A slot in the lane's FIFO before the forward: results leave in the
      // order the forwards ran, whichever copy finishes first.
      std::unique_lock<std::mutex> lock(lane.mu);
      lane.cv.wait(lock, [&] { return lane.fifo.size() < kMaxUndelivered; });
      lane.fifo.push_back(c);
    }
    if (item.cancelled && item.cancelled()) {
      if (i == 0) {
        std::lock_guard<std::mutex> lock(mu_);
        ++skipped_batches_;
      } else {
        lane.engine->DropCarry();  // mid-sequence: its state is freed
      }
      c->result.last_part = true;
      FinishHalves(lane, *c,
                   absl::CancelledError(i == 0 ? "stream closed before the batch ran"
                                               : "stream closed while the batch ran"),
                   2);
      return;
    }
    ForwardInput input{item.token_ids, item.seq_lens, item.layers, item.encoding};
    input.outputs = item.outputs.get();
    if (chunks.size() > 1) {
      input.token_ids = std::span<const int32_t>(item.token_ids).subspan(
          static_cast<size_t>(chunk.token_begin), static_cast<size_t>(chunk.tokens()));
      input.seq_lens = chunk.seq_lens;
      input.resume_tokens = chunk.resume_tokens;
      input.carry_last = chunk.carry_last;
    }
    bool forward_ok = false;
    const int halves = RunItem(lane, entry, input, c, &forward_ok);
    if (!forward_ok) {
      if (input.chunked()) lane.engine->DropCarry();
      c->result.last_part = true;
    }
    FinishHalves(lane, *c, absl::OkStatus(), halves);
    if (!forward_ok) return;
  }
}

int Scheduler::RunItem(Lane& lane, Entry& entry, const ForwardInput& input,
                       const std::shared_ptr<Completion>& c, bool* forward_ok) {
  const WorkItem& item = entry.item;
  Engine* engine = lane.engine;
  ForwardResult& result = c->result;
  result.queue_ms = MsSince(entry.enqueued);
  result.tokens = c->tokens;
  result.encoding = item.encoding;
  result.bytes_per_token = RowBytesPerToken(engine->model().config, input);
  result.bytes = static_cast<size_t>(c->tokens * result.bytes_per_token);
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status status;
  bool copy_pending = false;
  // The second half (the copy to the host, or the device sink's send) arrives
  // from the engine (its copy thread, or inline); it touches only `status`
  // and `checksum`, which the lane's mutex guards (read once both are in).
  Completion* raw = c.get();
  auto second_half = [&lane, raw](Engine::Copied copied) {
    raw->result.checksum = copied.checksum;
    FinishHalves(lane, *raw, std::move(copied.status), 1);
  };
  if (item.device_sink) {
    status = engine->ForwardToDevice(input, item.device_sink, second_half);
    copy_pending = status.ok();
  } else {
    result.capture = pool_.Acquire(result.bytes);
    if (result.capture == nullptr) {
      status = absl::ResourceExhaustedError(absl::StrCat(
          "cannot allocate ", result.bytes >> 20, " MiB of host memory for the batch's capture"));
    } else {
      status = engine->ForwardAsync(input, std::span<std::byte>(result.capture.get(), result.bytes),
                                    second_half);
      copy_pending = status.ok();
    }
  }
  if (throttle_tokens_per_s_ > 0) {
    std::this_thread::sleep_until(t0 +
                                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                      std::chrono::duration<double>(static_cast<double>(c->tokens) /
                                                                    throttle_tokens_per_s_)));
  }
  result.forward_ms = MsSince(t0);
  *forward_ok = status.ok();
  if (!status.ok()) FinishHalves(lane, *c, std::move(status), 0);
  return copy_pending ? 1 : 2;
}

void Scheduler::CompletionLoop(Lane& lane) {
  for (;;) {
    std::shared_ptr<Completion> c;
    {
      std::unique_lock<std::mutex> lock(lane.mu);
      lane.cv.wait(lock, [&] {
        return (!lane.fifo.empty() && lane.fifo.front()->halves_left == 0) ||
               (lane.worker_exited && lane.fifo.empty());
      });
      if (lane.fifo.empty()) return;
      c = std::move(lane.fifo.front());
      lane.fifo.pop_front();
    }
    lane.cv.notify_all();  // the worker may be waiting for room
    const bool last = c->result.last_part;
    if (c->status.ok()) {
      c->done(std::move(c->result));
    } else {
      c->result.capture.reset();  // back to the pool before the error is handled
      c->done(std::move(c->status));
    }
    std::lock_guard<std::mutex> lock(mu_);
    completed_tokens_ += c->tokens;
    if (!last) continue;  // a part of a batch run in several forwards
    --running_;
    ++completed_batches_;
  }
}

int64_t Scheduler::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_;
}
int64_t Scheduler::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}
int64_t Scheduler::completed_batches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_batches_;
}
int64_t Scheduler::completed_tokens() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_tokens_;
}
int64_t Scheduler::skipped_batches() const {
  std::lock_guard<std::mutex> lock(mu_);
  return skipped_batches_;
}

}  // namespace draftfeed
