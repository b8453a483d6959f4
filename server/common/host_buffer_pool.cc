#include "server/common/host_buffer_pool.h"

#include <algorithm>
#include <utility>

namespace draftfeed {

HostAllocator HostAllocator::Heap() {
  return HostAllocator{.allocate = [](size_t bytes) -> void* { return ::operator new(bytes); },
                       .release = [](void* p) { ::operator delete(p); }};
}

HostBufferPool::HostBufferPool(int64_t max_idle_bytes, HostAllocator allocator)
    : state_(std::make_shared<State>()) {
  state_->max_idle_bytes = max_idle_bytes;
  state_->allocator = std::move(allocator);
}

HostBufferPool::~HostBufferPool() {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [cap, p] : state_->idle) state_->allocator.release(p);
  state_->idle.clear();
  state_->idle_bytes = 0;
  state_->closed = true;  // buffers still out are freed when they come back
}

std::shared_ptr<uint16_t> HostBufferPool::Acquire(size_t elements) {
  std::shared_ptr<State> state = state_;
  uint16_t* p = nullptr;
  size_t cap = 0;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    // Best fit, but not more than twice the size (a small batch must not pin
    // a huge buffer).
    auto it = state->idle.lower_bound(elements);
    if (it != state->idle.end() && it->first <= 2 * elements + 4096) {
      cap = it->first;
      p = it->second;
      state->idle.erase(it);
      state->idle_bytes -= static_cast<int64_t>(cap * 2);
    }
  }
  if (p == nullptr) {
    cap = elements;
    p = static_cast<uint16_t*>(state->allocator.allocate(std::max<size_t>(cap, 1) * 2));
    if (p == nullptr) return nullptr;
    std::lock_guard<std::mutex> lock(state->mu);
    ++state->allocations;
  }
  {
    std::lock_guard<std::mutex> lock(state->mu);
    state->live_bytes += static_cast<int64_t>(cap * 2);
  }
  return std::shared_ptr<uint16_t>(p, [state, cap](uint16_t* q) {
    {
      std::lock_guard<std::mutex> lock(state->mu);
      state->live_bytes -= static_cast<int64_t>(cap * 2);
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
