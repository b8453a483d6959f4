// Reusable host buffers for captured hidden states. A batch's buffer is taken
// when its forward starts and comes back when the last gRPC slice pointing
// into it is released, so steady streaming allocates (and page-faults)
// nothing; idle memory is capped.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>

namespace draftfeed {

// Where the pool's memory comes from. The default is plain heap memory; a
// GPU target plugs in page-locked memory (cudaHostAlloc) so device-to-host
// copies run at full bandwidth and asynchronously. `allocate` returns null
// (or throws) on failure; `release` takes back what `allocate` returned.
struct HostAllocator {
  std::function<void*(size_t bytes)> allocate;
  std::function<void(void*)> release;
  static HostAllocator Heap();
};

// How a HostBufferPool sizes and keeps its buffers.
struct HostBufferReuse {
  // false: buffers of exactly the size asked (GPU memory beside a drafter
  // that fills the GPU, where a quarter more per batch is the difference
  // between two batches fitting and one).
  bool size_classes = true;
  // Buffers of the size last asked for that stay idle for reuse whatever
  // `max_idle_bytes` says (it is raised to fit them, never lowered): a
  // stream whose batches outgrow the cap then still allocates (and frees)
  // nothing in steady state. 0: the cap alone decides.
  int keep_buffers = 0;
};

class HostBufferPool {
 public:
  using Reuse = HostBufferReuse;
  explicit HostBufferPool(int64_t max_idle_bytes, HostAllocator allocator = HostAllocator::Heap(),
                          Reuse reuse = {});
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  // The capacity, in bytes, that Acquire(bytes) allocates (with size
  // classes on, the default): the next size class a quarter octave up (2^k,
  // 1.25, 1.5 or 1.75 x 2^k). A buffer serves only requests no larger than
  // itself, and streamed batches differ by a few tokens, so exact sizes would
  // allocate anew for most of them (pinned memory: a cudaHostAlloc, and a
  // cudaFreeHost that synchronises the GPU); a class costs at most a quarter
  // more memory.
  static size_t SizeClass(size_t bytes);

  // At least `bytes` bytes, uninitialised (any encoding's capture); null when the allocator
  // returns null even after the pool's idle buffers were released. Returns to
  // the pool (or is freed, past the idle cap) when the last copy of the
  // pointer drops; buffers may outlive the pool.
  std::shared_ptr<std::byte> Acquire(size_t bytes);

  // Caps live + idle bytes (0: no cap). Acquire then waits until its buffer
  // fits, dropping idle buffers first; a buffer larger than the cap alone is
  // still handed out when nothing else is live, so one batch always runs.
  void set_max_total_bytes(int64_t bytes);

  int64_t live_bytes() const;        // handed out, not yet returned
  int64_t idle_bytes() const;        // kept for reuse
  int64_t allocations() const;       // fresh allocations so far
  int64_t peak_total_bytes() const;  // highest live + idle so far

 private:
  struct State {
    std::mutex mu;
    std::multimap<size_t, std::byte*> idle;  // by capacity (bytes)
    int64_t idle_bytes = 0;
    int64_t live_bytes = 0;
    int64_t allocations = 0;
    int64_t max_idle_bytes = 0;
    Reuse reuse;
    int64_t max_total_bytes = 0;
    int64_t peak_total_bytes = 0;  // live + idle, highest seen
    std::condition_variable returned;
    bool closed = false;
    HostAllocator allocator;
  };
  std::shared_ptr<State> state_;
};

}  // namespace draftfeed
