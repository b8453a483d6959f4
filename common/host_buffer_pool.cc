#include "common/host_buffer_pool.h"

#include <algorithm>
#include <iterator>
#include <utility>
#include <vector>

namespace draftfeed {

HostAllocator HostAllocator::Heap() {
  return HostAllocator{.allocate = [](size_t bytes) -> void* { return ::operator new(bytes); },
                       .release = [](void* p) { ::operator delete(p); }};
}

HostBufferPool::HostBufferPool(int64_t max_idle_bytes, HostAllocator allocator, Reuse reuse)
    : state_(std::make_shared<State>()) {
  state_->max_idle_bytes = max_idle_bytes;
  state_->reuse = reuse;
  state_->allocator = std::move(allocator);
}

HostBufferPool::~HostBufferPool() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [cap, p] : state_->idle) state_->allocator.release(p);
  state_->idle.clear();
  state_->idle_bytes = 0;
  state_->closed = true;  // buffers still out are freed when they come back
}

size_t HostBufferPool::SizeClass(size_t bytes) {
  if (bytes <= 16) return bytes;
  size_t octave = 1;
  while (octave <= bytes / 2) octave *= 2;
  const size_t quarter = octave / 4;
  return (bytes + quarter - 1) / quarter * quarter;
}

std::shared_ptr<std::byte> HostBufferPool::Acquire(size_t bytes) {
  std::shared_ptr<State> state = state_;
  std::byte* p = nullptr;
  size_t cap = 0;
  std::vector<std::byte*> evicted;  // idle buffers dropped to stay under the cap
  const size_t fresh = state->reuse.size_classes ? SizeClass(bytes) : bytes;
  {
    std::unique_lock<std::mutex> lock(state->mu);
    state->max_idle_bytes =
        std::max(state->max_idle_bytes, static_cast<int64_t>(state->reuse.keep_buffers * fresh));
    for (;;) {
      // Best fit, but not more than twice the size (a small batch must not
      // pin a huge buffer).
      auto it = state->idle.lower_bound(bytes);
      const bool reuse = it != state->idle.end() && it->first <= 2 * bytes + 8192;
      cap = reuse ? it->first : fresh;
      const int64_t need = static_cast<int64_t>(cap);
      const int64_t limit = state->max_total_bytes;
      if (limit > 0 && state->live_bytes > 0 && state->live_bytes + need > limit) {
        state->returned.wait(lock);  // a live buffer must come back first
        continue;
      }
      if (reuse) {
        p = it->second;
        state->idle.erase(it);
        state->idle_bytes -= need;
      }
      // Drop idle buffers (largest first) until live + idle fits the cap.
      while (limit > 0 && !state->idle.empty() &&
             state->live_bytes + state->idle_bytes + need > limit) {
        auto last = std::prev(state->idle.end());
        state->idle_bytes -= static_cast<int64_t>(last->first);
        evicted.push_back(last->second);
        state->idle.erase(last);
      }
      state->live_bytes += need;  // reserved before a fresh allocation
      state->peak_total_bytes =
          std::max(state->peak_total_bytes, state->live_bytes + state->idle_bytes);
      break;
    }
  }
  for (std::byte* q : evicted) state->allocator.release(q);
  if (p == nullptr) {
    p = static_cast<std::byte*>(state->allocator.allocate(std::max<size_t>(cap, 1)));
    if (p == nullptr) {
      // Out of memory (a GPU the trainer fills, say): what this pool keeps
      // idle goes back first, then one more try.
      std::vector<std::byte*> idle;
      {
        std::lock_guard<std::mutex> lock(state->mu);
        for (auto& [c, q] : state->idle) idle.push_back(q);
        state->idle.clear();
        state->idle_bytes = 0;
      }
      for (std::byte* q : idle) state->allocator.release(q);
      if (!idle.empty()) {
        p = static_cast<std::byte*>(state->allocator.allocate(std::max<size_t>(cap, 1)));
      }
    }
    std::lock_guard<std::mutex> lock(state->mu);
    if (p == nullptr) {
      state->live_bytes -= static_cast<int64_t>(cap);
      state->returned.notify_all();
      return nullptr;
    }
    ++state->allocations;
  }
  return std::shared_ptr<std::byte>(p, [state, cap](std::byte* q) {
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->live_bytes -= static_cast<int64_t>(cap);
      state->returned.notify_all();
      if (!state->closed &&
          state->idle_bytes + static_cast<int64_t>(cap) <= state->max_idle_bytes) {
        state->idle.emplace(cap, q);
        state->idle_bytes += static_cast<int64_t>(cap);
        return;
      }
    }
    // Outside the lock: freeing pinned memory is slow (and synchronises the GPU).
    state->allocator.release(q);
  });
}

void HostBufferPool::set_max_total_bytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->max_total_bytes = std::max<int64_t>(0, bytes);
  state_->returned.notify_all();
}

int64_t HostBufferPool::peak_total_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->peak_total_bytes;
}

int64_t HostBufferPool::live_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->live_bytes;
}
int64_t HostBufferPool::idle_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->idle_bytes;
}
int64_t HostBufferPool::allocations() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->allocations;
}

}  // namespace draftfeed
