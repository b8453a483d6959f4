// The scheduler shared by every stream of a target: one bounded FIFO of
// batches, one worker thread per engine replica. Streams hold credits, so the
// queue cannot grow past the sum of credits; the explicit bound is the backstop.
//
// Each engine also has a completion thread: the worker starts batch N+1's
// forward as soon as N's forward is done, while N's capture is still being
// copied to the host and then delivered (`done`: checksum, hand-off to the
// stream) on the completion thread, in the order the forwards ran.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/capture_encoding.h"
#include "common/host_buffer_pool.h"
#include "server/model/engine.h"

namespace draftfeed {

// The captured states of one batch, [T, K, H] in `encoding`, in a pooled
// host buffer of tokens * bytes_per_token bytes.
struct ForwardResult {
  std::shared_ptr<std::byte> capture;  // null when the capture went from the device
  size_t bytes = 0;
  CaptureEncoding encoding = CaptureEncoding::kBf16;
  int64_t bytes_per_token = 0;
  int64_t tokens = 0;
  double queue_ms = 0;
  double forward_ms = 0;
  double send_ms = 0;  // set by transports that send from the device (NCCL)
  // The payload's v1::PayloadChecksum when it was computed on the device (a
  // GPU engine's copy, or the NCCL send); empty: the transport computes it.
  std::optional<uint64_t> checksum;
};

struct WorkItem {
  std::vector<int32_t> token_ids;
  std::vector<int32_t> seq_lens;
  std::vector<int32_t> layers;
  CaptureEncoding encoding = CaptureEncoding::kBf16;
  // Called exactly once on the engine's completion thread, in the order the
  // engine took its items: with the result, or with the error that stopped
  // it (cancelled items get CANCELLED without running). It may take its time
  // (a checksum over the payload): the engine is already on the next batch.
  std::function<void(absl::StatusOr<ForwardResult>)> done;
  // Checked before the forward starts; true skips the work.
  std::function<bool()> cancelled;
  // When set (NCCL transport), the capture is handed over while still on the
  // device and `done` gets a result without a host buffer (`capture` null),
  // once the sink's work is done (the engine is on the next batch by then).
  Engine::DeviceSink device_sink;
};

class Scheduler {
 public:
  // `throttle_tokens_per_s` > 0 caps each worker's rate (emulates a slower
  // device, e.g. for balancing and split benchmarks); 0 runs at full speed.
  // `host_allocator` backs the capture buffers (pinned memory for GPU engines).
  Scheduler(std::vector<Engine*> engines, int64_t max_queued, double throttle_tokens_per_s = 0,
            int64_t pool_idle_bytes = int64_t{2} << 30,
            HostAllocator host_allocator = HostAllocator::Heap());
  ~Scheduler();  // Stop()s

  // RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE once stopping.
  absl::Status Submit(WorkItem item);
  // Finishes what is queued and running, delivers it, then joins the threads.
  void Stop();

  // Batches each engine may hold between taking them and delivering them:
  // one in the forward, one whose capture is being copied, one being
  // delivered. With the credits (a batch holds its stream's credit until its
  // last byte is written) this bounds host memory at
  // min(sum of credits, engines x kMaxUndelivered + what streams still send)
  // capture buffers; the worker waits here rather than pile results up.
  static constexpr size_t kMaxUndelivered = 3;

  int64_t queued() const;
  // Taken by a worker and not yet delivered (forward, copy or `done` call).
  int64_t running() const;
  int64_t completed_batches() const;
  int64_t completed_tokens() const;
  const HostBufferPool& pool() const { return pool_; }
  // Caps the capture buffers' host memory, live + idle (0: no cap): a
  // forward waits for buffers to come back rather than exceed it.
  void set_host_memory_cap(int64_t bytes) { pool_.set_max_total_bytes(bytes); }

 private:
  struct Entry {
    WorkItem item;
    std::chrono::steady_clock::time_point enqueued;
  };
  // One batch from the start of its forward to its `done` call. Delivered
  // when both halves are in: the worker's (forward over) and the copy's.
  struct Completion {
    std::function<void(absl::StatusOr<ForwardResult>)> done;
    ForwardResult result;
    absl::Status status;
    int64_t tokens = 0;
    int halves_left = 2;
  };
  // An engine, its worker and its completion thread, which share `fifo`.
  struct Lane {
    Engine* engine = nullptr;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::shared_ptr<Completion>> fifo;
    bool worker_exited = false;
    std::thread worker;
    std::thread completer;
  };
  void WorkerLoop(Lane& lane);
  void CompletionLoop(Lane& lane);
  // Runs one batch's forward; returns the halves it finished (1, or 2 when
  // no copy is left pending).
  int RunItem(Lane& lane, Entry& entry, const std::shared_ptr<Completion>& c);
  static void FinishHalves(Lane& lane, Completion& c, absl::Status status, int halves);

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
  std::vector<std::unique_ptr<Lane>> lanes_;
  bool joined_ = false;
};

}  // namespace draftfeed
