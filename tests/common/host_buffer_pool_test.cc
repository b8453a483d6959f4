// HostBufferPool: reuse, size classes, the idle and total caps, the plugged
// allocator. Sizes are in bytes; the pool knows nothing of encodings.
#include "common/host_buffer_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <thread>

namespace draftfeed {
namespace {

TEST(HostBufferPoolTest, ReusesAndCapsIdleMemory) {
  // Sizes here are size classes (powers of two are), so bytes are exact.
  HostBufferPool pool(/*max_idle_bytes=*/3072);
  {
    auto a = pool.Acquire(2048);
    auto b = pool.Acquire(1024);
    EXPECT_EQ(pool.live_bytes(), 3072);
  }
  EXPECT_EQ(pool.live_bytes(), 0);
  EXPECT_EQ(pool.idle_bytes(), 3072);
  auto c = pool.Acquire(1800);  // fits the idle 2048-byte buffer: no new allocation
  EXPECT_EQ(pool.allocations(), 2);
  auto d = pool.Acquire(10240);  // nothing big enough idle
  EXPECT_EQ(pool.allocations(), 3);
  d.reset();  // 10240 bytes would pass the idle cap: freed
  EXPECT_LE(pool.idle_bytes(), 3072);
}

// Requests a few bytes apart share one size class, so a stream of them
// reuses one buffer; a class is never more than a quarter over the request.
TEST(HostBufferPoolTest, NearbySizesShareOneBuffer) {
  EXPECT_EQ(HostBufferPool::SizeClass(2000), 2048u);
  EXPECT_EQ(HostBufferPool::SizeClass(2048), 2048u);
  EXPECT_EQ(HostBufferPool::SizeClass(2049), 2560u);
  EXPECT_EQ(HostBufferPool::SizeClass(3000), 3072u);
  EXPECT_EQ(HostBufferPool::SizeClass(7), 7u);
  // A 49,152-token bf16 batch of 5 layers x 5,120: one class for 48,000..49,152 tokens.
  EXPECT_EQ(HostBufferPool::SizeClass(size_t{48000} * 51200),
            HostBufferPool::SizeClass(size_t{49152} * 51200));
  for (size_t n = 1; n < 100000; n = n * 5 / 4 + 1) {
    const size_t c = HostBufferPool::SizeClass(n);
    EXPECT_GE(c, n);
    EXPECT_LE(c, n + n / 4 + 1) << n;
  }
  HostBufferPool pool(/*max_idle_bytes=*/1, HostAllocator::Heap(), {.keep_buffers = 2});
  for (size_t n = 2049; n <= 2560; n += 34) {
    auto b = pool.Acquire(n);
    ASSERT_NE(b, nullptr);
    b.get()[n - 1] = std::byte{1};  // the whole request is there
  }
  EXPECT_EQ(pool.allocations(), 1);
  HostBufferPool exact(/*max_idle_bytes=*/1 << 20, HostAllocator::Heap(), {.size_classes = false});
  {
    auto b = exact.Acquire(2050);
    EXPECT_EQ(exact.live_bytes(), 2050);
  }
}

TEST(HostBufferPoolTest, TotalCapMakesAcquireWaitAndDropsIdleBuffersFirst) {
  HostBufferPool pool(/*max_idle_bytes=*/1 << 20);
  pool.set_max_total_bytes(6144);
  auto a = pool.Acquire(2048);  // class sizes, so the bytes are exact
  auto b = pool.Acquire(2048);
  auto c = pool.Acquire(2048);
  std::atomic<bool> got{false};
  std::thread waiter([&] {
    auto d = pool.Acquire(2048);  // would make 8192 bytes: waits
    got = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  EXPECT_FALSE(got.load()) << "Acquire went past the cap";
  b.reset();  // a buffer comes back (to the idle list): the waiter reuses it
  waiter.join();
  EXPECT_TRUE(got.load());
  EXPECT_LE(pool.peak_total_bytes(), 6144);
  // Idle buffers are dropped, not counted on, to make room: 2 live (4096) +
  // 1 idle (2048) leaves no room for 1536 more bytes until the idle one goes.
  auto e = pool.Acquire(1536);
  EXPECT_LE(pool.live_bytes() + pool.idle_bytes(), 6144);
  EXPECT_LE(pool.peak_total_bytes(), 6144);
  a.reset();
  c.reset();
  e.reset();
  // A buffer larger than the cap alone still runs when nothing else is live.
  auto big = pool.Acquire(10240);
  EXPECT_NE(big, nullptr);
  EXPECT_EQ(pool.live_bytes(), 10240);
}

// An allocator that is out of memory (a GPU the drafter fills) gets the
// pool's idle buffers back before the pool gives up.
TEST(HostBufferPoolTest, AFailedAllocationReleasesIdleBuffersAndTriesAgain) {
  struct Budget {
    size_t used = 0;
    std::map<void*, size_t> sizes;
  };
  auto budget = std::make_shared<Budget>();
  HostAllocator limited{.allocate = [budget](size_t bytes) -> void* {
                          if (budget->used + bytes > 10000) return nullptr;
                          void* p = ::operator new(bytes);
                          budget->used += bytes;
                          budget->sizes[p] = bytes;
                          return p;
                        },
                        .release =
                            [budget](void* p) {
                              budget->used -= budget->sizes.at(p);
                              budget->sizes.erase(p);
                              ::operator delete(p);
                            }};
  HostBufferPool pool(/*max_idle_bytes=*/100000, limited);
  auto a = pool.Acquire(4096);
  auto b = pool.Acquire(4096);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  a.reset();
  b.reset();
  EXPECT_EQ(pool.idle_bytes(), 8192);
  auto c = pool.Acquire(5120);  // too big to reuse, and 8192 + 5120 > 10000
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(pool.idle_bytes(), 0);
  EXPECT_EQ(budget->used, 5120u);
  EXPECT_EQ(pool.Acquire(8192), nullptr);  // nothing idle left to give back
  EXPECT_EQ(pool.live_bytes(), 5120);
}

TEST(HostBufferPoolTest, UsesThePluggedAllocatorForEveryBuffer) {
  struct Counts {
    int allocated = 0, released = 0;
    size_t bytes = 0;
  };
  auto counts = std::make_shared<Counts>();
  HostAllocator counting{.allocate = [counts](size_t bytes) -> void* {
                           ++counts->allocated;
                           counts->bytes += bytes;
                           return ::operator new(bytes);
                         },
                         .release =
                             [counts](void* p) {
                               ++counts->released;
                               ::operator delete(p);
                             }};
  std::shared_ptr<std::byte> outlives;
  {
    HostBufferPool pool(/*max_idle_bytes=*/3072, counting);
    auto a = pool.Acquire(2048);
    EXPECT_EQ(counts->allocated, 1);
    EXPECT_EQ(counts->bytes, 2048u);
    a.reset();  // idle, not released
    EXPECT_EQ(counts->released, 0);
    a = pool.Acquire(1600);  // reused
    EXPECT_EQ(counts->allocated, 1);
    EXPECT_EQ(pool.allocations(), 1);
    auto big = pool.Acquire(8192);  // past the idle cap when returned
    big.reset();
    EXPECT_EQ(counts->released, 1);
    EXPECT_EQ(pool.live_bytes(), 2048);
    outlives = std::move(a);
  }
  EXPECT_EQ(counts->released, 1);  // still out when the pool closed
  outlives.reset();
  EXPECT_EQ(counts->released, counts->allocated);

  HostAllocator failing{.allocate = [](size_t) -> void* { return nullptr; },
                        .release = [](void*) {}};
  HostBufferPool pool(1 << 20, failing);
  EXPECT_EQ(pool.Acquire(200), nullptr);
  EXPECT_EQ(pool.live_bytes(), 0);
}

}  // namespace
}  // namespace draftfeed
