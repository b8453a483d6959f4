// Minimal fork-join helper shared by the CPU reference kernels (internal to
// kernels/cpu; not part of any kernel's interface).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace draftfeed::cpu {

// Runs fn(item) for every item in [0, num_items) on up to num_threads threads
// (the caller's thread is one of them). Items are handed out dynamically, so
// uneven items (causal attention rows) balance; every item is computed by
// exactly one thread, so results never depend on the thread count.
// num_threads <= 0 means std::thread::hardware_concurrency().
template <typename Fn>
void ParallelFor(int64_t num_items, int num_threads, Fn&& fn) {
  if (num_items <= 0) return;
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  const int64_t workers = std::clamp<int64_t>(num_threads, 1, num_items);
  if (workers == 1) {
    for (int64_t i = 0; i < num_items; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  auto drain = [&] {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < num_items;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(workers - 1));
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(drain);
  drain();
  for (std::thread& t : pool) t.join();
}

}  // namespace draftfeed::cpu
