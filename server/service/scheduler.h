// The scheduler shared by every stream of a target: one bounded FIFO of
// batches, one worker thread per engine replica. Streams hold credits, so the
// queue cannot grow past the sum of credits; the explicit bound is the backstop.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/engine.h"
#include "server/common/host_buffer_pool.h"

namespace draftfeed {

// The captured states of one batch, bf16 [T, K, H], in a pooled host buffer.
struct ForwardResult {
  std::shared_ptr<uint16_t> hidden;
  size_t hidden_size = 0;  // elements
  int64_t tokens = 0;
  double queue_ms = 0;
  double forward_ms = 0;
};

struct WorkItem {
  std::vector<int32_t> token_ids;
  std::vector<int32_t> seq_lens;
  std::vector<int32_t> layers;
  // Called on the worker thread exactly once: with the result, or with the
  // error that stopped it (cancelled items get CANCELLED without running).
  std::function<void(absl::StatusOr<ForwardResult>)> done;
  // Checked before the forward starts; true skips the work.
  std::function<bool()> cancelled;
  // When set (NCCL transport), the capture is handed over while still on the
  // device and `done` gets a result without a host buffer (`hidden` null).
  Engine::DeviceSink device_sink;
};

class Scheduler {
 public:
  // `throttle_tokens_per_s` > 0 caps each worker's rate (emulates a slower
  // device, e.g. for balancing and split benchmarks); 0 runs at full speed.
  Scheduler(std::vector<Engine*> engines, int64_t max_queued, double throttle_tokens_per_s = 0,
            int64_t pool_idle_bytes = int64_t{2} << 30);
  ~Scheduler();  // Stop()s

  // RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE once stopping.
  absl::Status Submit(WorkItem item);
  // Finishes what is queued and running, then joins the workers.
  void Stop();

  int64_t queued() const;
  int64_t running() const;
  int64_t completed_batches() const;
  int64_t completed_tokens() const;
  const HostBufferPool& pool() const { return pool_; }

 private:
  struct Entry {
    WorkItem item;
    std::chrono::steady_clock::time_point enqueued;
  };
  void WorkerLoop(Engine* engine);

  HostBufferPool pool_;
  const int64_t max_queued_;
  const double throttle_tokens_per_s_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Entry> queue_;
  bool stopping_ = false;
  int64_t running_ = 0;
  int64_t completed_batches_ = 0;
  int64_t completed_tokens_ = 0;
  std::vector<std::thread> workers_;
};

}  // namespace draftfeed
