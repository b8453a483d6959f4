// The scheduler shared by every stream of a target: a queue of batches per
// stream, one worker thread per engine replica. Streams hold credits, so the
// queues cannot grow past the sum of credits; the explicit bound is the
// backstop.
//
// Fair queueing by tokens across streams (the limit of deficit round-robin as
// its quantum shrinks to one token): each stream has a virtual time, the
// tokens taken for it so far, and the next batch taken is the head of the
// eligible stream whose virtual time is least. A stream that starts queueing
// (or comes back from its cap) joins at the virtual time of the batch taken
// last, so it cannot bank credit while it sent nothing. Hence: a stream's
// batches run in the order it sent them; while two streams both have batches
// queued, the tokens taken for them differ by at most one batch; and a
// stream's batch waits behind at most one batch of each other stream (plus
// those already taken), however many the others queue.
//
// A stream's pending bytes are the result bytes of its batches taken for the
// forward and not yet written to its client (the stream releases them), plus
// what the stream charges for its unsent errors. A stream whose pending bytes
// reach its cap is not eligible: its batches wait, the others run on.
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
#include <map>
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

// The captured states of one batch, [T, K, H] in `encoding` (each token's
// target outputs after its K layers, when asked), in a pooled host buffer of
// tokens * bytes_per_token bytes; or of one part of it (chunked prefill: a
// batch over WorkItem::max_forward_tokens is delivered one forward at a time).
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
  // A part's is of the part alone.
  std::optional<uint64_t> checksum;
  // Chunked prefill: these `tokens` are the batch's from token_offset on;
  // last_part marks the batch's last (then whole_tokens is the batch's
  // count, set by whoever joins the parts). One part: offset 0, last.
  int64_t token_offset = 0;
  bool last_part = true;
  int64_t whole_tokens = 0;
  int64_t batch_tokens() const { return whole_tokens > 0 ? whole_tokens : tokens; }
};

struct WorkItem {
  std::vector<int32_t> token_ids;
  std::vector<int32_t> seq_lens;
  std::vector<int32_t> layers;
  CaptureEncoding encoding = CaptureEncoding::kBf16;
  std::shared_ptr<const TargetOutputs> outputs;  // null: hidden states only
  // Called on the engine's completion thread, in the order the engine took
  // its items: once with the result, or with the error that stopped it
  // (cancelled items get CANCELLED without running). A batch run in several
  // forwards (max_forward_tokens) gets one call per part, in token order,
  // the last with last_part set; an error is always the last call, and parts
  // before it have been delivered. It may take its time (a checksum over the
  // payload): the engine is already on the next forward.
  std::function<void(absl::StatusOr<ForwardResult>)> done;
  // Forwards of at most this many tokens: a larger batch runs in the chunks
  // PlanForwardChunks cuts, back to back on one engine, which carries the
  // sequence each cut splits; 0: the batch in one forward.
  int64_t max_forward_tokens = 0;
  // Checked before the forward starts; true skips the work.
  std::function<bool()> cancelled;
  // The stream it belongs to (AddStream); 0 is the default stream, uncapped.
  uint64_t stream = 0;
  // Charged to the stream's pending bytes when the batch is taken for its
  // forward: the result's size, which the stream releases once written.
  int64_t result_bytes = 0;
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

  // Queues `item` behind its stream's earlier items. RESOURCE_EXHAUSTED when
  // `max_queued` items are queued across streams, UNAVAILABLE once stopping,
  // NOT_FOUND for a stream that is not (or no longer) added.
  absl::Status Submit(WorkItem item);

  // A new stream with its own queue. `max_pending_bytes` > 0: while the
  // stream's pending bytes are at least this, its batches wait (a batch
  // larger than the cap still runs when nothing of the stream is pending).
  uint64_t AddStream(int64_t max_pending_bytes);
  // The stream is going away: its queued items are still taken (in its
  // order, whatever its cap) so that each gets its `done`; then it is gone.
  void RemoveStream(uint64_t stream);
  // Pending bytes the stream adds (an unsent error) or gives back (a result
  // or error written). No-ops for a removed stream.
  void ChargePending(uint64_t stream, int64_t bytes);
  void ReleasePending(uint64_t stream, int64_t bytes);
  int64_t pending_bytes(uint64_t stream) const;
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
  // Of the completed: skipped because their stream was gone (or cancelled by
  // the client) before they ran.
  int64_t skipped_batches() const;
  const HostBufferPool& pool() const { return pool_; }
  // Caps the capture buffers' host memory, live + idle (0: no cap): a
  // forward waits for buffers to come back rather than exceed it.
  void set_host_memory_cap(int64_t bytes) { pool_.set_max_total_bytes(bytes); }

 private:
  struct Entry {
    WorkItem item;
    std::chrono::steady_clock::time_point enqueued;
  };
  struct StreamQueue {
    int64_t max_pending_bytes = 0;  // 0: no cap
    int64_t pending_bytes = 0;
    int64_t largest_result_bytes = 0;  // of the batches taken so far
    int64_t vtime = 0;                 // tokens taken for it, in virtual time
    uint64_t last_taken = 0;           // sequence number of its last batch taken (breaks ties)
    std::deque<Entry> queue;
    bool removed = false;
  };
  bool Eligible(const StreamQueue& s) const;
  // Moves the next batch by fair queueing into `out`; false when no stream
  // has an eligible batch. Called with mu_ held.
  bool TakeLocked(Entry& out);
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
  // `part` is the forward's input (the whole batch or one chunk of it);
  // `forward_ok` says whether the forward itself started and finished.
  int RunItem(Lane& lane, Entry& entry, const ForwardInput& part,
              const std::shared_ptr<Completion>& c, bool* forward_ok);
  // The forwards of the batch `entry` holds, each a Completion in the lane's
  // FIFO; a cancelled or failed chunk ends the batch (its carry dropped).
  void RunBatch(Lane& lane, Entry& entry);
  static void FinishHalves(Lane& lane, Completion& c, absl::Status status, int halves);

  HostBufferPool pool_;
  const int64_t max_queued_;
  const double throttle_tokens_per_s_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, StreamQueue> streams_;
  uint64_t next_stream_ = 1;
  int64_t queued_ = 0;
  int64_t vtime_ = 0;   // virtual time at which the last batch taken started
  uint64_t taken_ = 0;  // batches taken so far
  bool stopping_ = false;
  int64_t running_ = 0;
  int64_t completed_batches_ = 0;
  int64_t completed_tokens_ = 0;
  int64_t skipped_batches_ = 0;
  std::vector<std::unique_ptr<Lane>> lanes_;
  bool joined_ = false;
};

}  // namespace draftfeed
