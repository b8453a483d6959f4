#include "server/common/host_buffer_pool.h"

#include <algorithm>
#include <iterator>
#include <vector>
#include <utility>

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

size_t HostBufferPool::SizeClass(size_t elements) {
  if (elements <= 8) return elements;
  size_t octave = 1;
  while (octave <= elements / 2) octave *= 2;
  const size_t quarter = octave / 4;
  return (elements + quarter - 1) / quarter * quarter;
}

std::shared_ptr<uint16_t> HostBufferPool::Acquire(size_t elements) {
  std::shared_ptr<State> state = state_;
  uint16_t* p = nullptr;
  size_t cap = 0;
  std::vector<uint16_t*> evicted;  // idle buffers dropped to stay under the cap
  const size_t fresh = state->reuse.size_classes ? SizeClass(elements) : elements;
  {
    std::unique_lock<std::mutex> lock(state->mu);
    state->max_idle_bytes = std::max(
        state->max_idle_bytes, static_cast<int64_t>(state->reuse.keep_buffers * fresh * 2));
    for (;;) {
      // Best fit, but not more than twice the size (a small batch must not
      // pin a huge buffer).
      auto it = state->idle.lower_bound(elements);
      const bool reuse = it != state->idle.end() && it->first <= 2 * elements + 4096;
      cap = reuse ? it->first : fresh;
      const int64_t need = static_cast<int64_t>(cap * 2);
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
        state->idle_bytes -= static_cast<int64_t>(last->first * 2);
        evicted.push_back(last->second);
        state->idle.erase(last);
      }
      state->live_bytes += need;  // reserved before a fresh allocation
      state->peak_total_bytes =
          std::max(state->peak_total_bytes, state->live_bytes + state->idle_bytes);
      break;
    }
  }
  for (uint16_t* q : evicted) state->allocator.release(q);
  if (p == nullptr) {
    p = static_cast<uint16_t*>(state->allocator.allocate(std::max<size_t>(cap, 1) * 2));
    if (p == nullptr) {
      // Out of memory (a GPU the trainer fills, say): what this pool keeps
      // idle goes back first, then one more try.
      std::vector<uint16_t*> idle;
      {
        std::lock_guard<std::mutex> lock(state->mu);
        for (auto& [c, q] : state->idle) idle.push_back(q);
        state->idle.clear();
        state->idle_bytes = 0;
      }
      for (uint16_t* q : idle) state->allocator.release(q);
      if (!idle.empty()) {
        p = static_cast<uint16_t*>(state->allocator.allocate(std::max<size_t>(cap, 1) * 2));
      }
    }
    std::lock_guard<std::mutex> lock(state->mu);
    if (p == nullptr) {
      state->live_bytes -= static_cast<int64_t>(cap * 2);
      state->returned.notify_all();
      return nullptr;
    }
    ++state->allocations;
  }
  return std::shared_ptr<uint16_t>(p, [state, cap](uint16_t* q) {
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->live_bytes -= static_cast<int64_t>(cap * 2);
      state->returned.notify_all();
      if (!state->closed &&
          state->idle_bytes + static_cast<int64_t>(cap * 2) <= state->max_idle_bytes) {
        state->idle.emplace(cap, q);
        state->idle_bytes += static_cast<int64_t>(cap * 2);
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
