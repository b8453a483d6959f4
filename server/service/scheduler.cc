#include "server/service/scheduler.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace draftfeed {

namespace {
double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

Scheduler::Scheduler(std::vector<Engine*> engines, int64_t max_queued,
                     double throttle_tokens_per_s, int64_t pool_idle_bytes)
    : pool_(pool_idle_bytes), max_queued_(max_queued), throttle_tokens_per_s_(throttle_tokens_per_s) {
  workers_.reserve(engines.size());
  for (Engine* engine : engines) workers_.emplace_back([this, engine] { WorkerLoop(engine); });
}

Scheduler::~Scheduler() { Stop(); }

absl::Status Scheduler::Submit(WorkItem item) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return absl::UnavailableError("target is shutting down; send to another target");
    if (static_cast<int64_t>(queue_.size()) >= max_queued_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("target queue is full (", max_queued_,
                       " batches); retry later or lower the client's credits"));
    }
    queue_.push_back(Entry{std::move(item), std::chrono::steady_clock::now()});
  }
  cv_.notify_one();
  return absl::OkStatus();
}

void Scheduler::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && workers_.empty()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void Scheduler::WorkerLoop(Engine* engine) {
  for (;;) {
    Entry entry;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      entry = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    WorkItem& item = entry.item;
    if (item.cancelled && item.cancelled()) {
      item.done(absl::CancelledError("stream closed before the batch ran"));
    } else {
      ForwardResult result;
      result.queue_ms = MsSince(entry.enqueued);
      const int64_t tokens = static_cast<int64_t>(item.token_ids.size());
      const int64_t width = engine->model().config.hidden_size;
      result.hidden_size =
          static_cast<size_t>(tokens * static_cast<int64_t>(item.layers.size()) * width);
      result.tokens = tokens;
      const ForwardInput input{item.token_ids, item.seq_lens, item.layers};
      const auto t0 = std::chrono::steady_clock::now();
      absl::Status status;
      if (item.device_sink) {
        status = engine->ForwardToDevice(input, item.device_sink);
      } else {
        result.hidden = pool_.Acquire(result.hidden_size);
        status = engine->Forward(input,
                                 std::span<uint16_t>(result.hidden.get(), result.hidden_size));
      }
      if (throttle_tokens_per_s_ > 0) {
        std::this_thread::sleep_until(
            t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                     std::chrono::duration<double>(static_cast<double>(tokens) /
                                                   throttle_tokens_per_s_)));
      }
      result.forward_ms = MsSince(t0);
      if (status.ok()) {
        item.done(std::move(result));
      } else {
        item.done(std::move(status));
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    --running_;
    ++completed_batches_;
    completed_tokens_ += static_cast<int64_t>(item.token_ids.size());
  }
}

int64_t Scheduler::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(queue_.size());
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

}  // namespace draftfeed
