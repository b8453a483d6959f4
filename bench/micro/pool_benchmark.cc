// HostBufferPool Acquire/release in steady state, in buffers/s (and bytes/s), against malloc/free.
//
//   build/bin/draftfeed-bench-pool [--benchmark_filter=800MiB]
//
// The pattern is a stream's: each batch's buffer is taken while the previous
// one is still live (its slices are on the wire), and consecutive batches
// differ by a few tokens (51,200 bytes: one Qwen3.6-27B token, 5 captured
// layers of 5,120 bf16). Sizes: 1 MiB, 32 MiB and 800 MiB (a 16,384-token
// batch of that model). "touch" writes one byte per 4 KiB page, as a
// capture's copy does: there fresh memory pays its page faults, which is
// what the pool exists to avoid; bytes/s counts the bytes handed out, and
// only where they are touched.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "bench/micro/benchmark_main.h"
#include "benchmark/benchmark.h"
#include "common/host_buffer_pool.h"

namespace draftfeed {
namespace {

constexpr size_t kTokenBytes = 5 * 5120 * 2;
constexpr int kSizesPerCycle = 8;  // batches 0..7 tokens longer than the base, in turn
constexpr size_t kPage = 4096;

size_t BatchBytes(size_t base, int64_t i) { return base + (i % kSizesPerCycle) * kTokenBytes; }

void Touch(std::byte* p, size_t n) {
  for (size_t at = 0; at < n; at += kPage) p[at] = std::byte{1};
  benchmark::ClobberMemory();
}

void BM_Pool(benchmark::State& state) {
  const size_t base = static_cast<size_t>(state.range(0));
  const bool touch = state.range(1) != 0;
  HostBufferPool pool(int64_t{4} << 30);  // the target's host pool: size classes, heap memory
  std::shared_ptr<std::byte> previous;
  // Warm up: one cycle of sizes fills the pool, as a stream's first batches do.
  for (int64_t i = 0; i < 2 * kSizesPerCycle; ++i) {
    std::shared_ptr<std::byte> b = pool.Acquire(BatchBytes(base, i));
    if (touch) Touch(b.get(), BatchBytes(base, i));
    previous = std::move(b);
  }
  const int64_t warm_allocations = pool.allocations();
  int64_t i = 0, bytes = 0;
  for (auto _ : state) {
    const size_t n = BatchBytes(base, i++);
    std::shared_ptr<std::byte> b = pool.Acquire(n);
    if (touch) Touch(b.get(), n);
    previous = std::move(b);  // the older buffer goes back to the pool here
    bytes += static_cast<int64_t>(n);
  }
  previous.reset();
  state.SetItemsProcessed(state.iterations());
  if (touch) state.SetBytesProcessed(bytes);
  // 0 in steady state: every Acquire was served by a buffer the pool kept.
  state.counters["fresh_allocs/iter"] =
      benchmark::Counter(static_cast<double>(pool.allocations() - warm_allocations),
                         benchmark::Counter::kAvgIterations);
}

void BM_MallocFree(benchmark::State& state) {
  const size_t base = static_cast<size_t>(state.range(0));
  const bool touch = state.range(1) != 0;
  std::unique_ptr<std::byte, decltype(&std::free)> previous(nullptr, &std::free);
  int64_t i = 0, bytes = 0;
  for (auto _ : state) {
    const size_t n = BatchBytes(base, i++);
    std::unique_ptr<std::byte, decltype(&std::free)> b(static_cast<std::byte*>(std::malloc(n)),
                                                       &std::free);
    if (b == nullptr) {
      state.SkipWithError("malloc failed");
      break;
    }
    if (touch) Touch(b.get(), n);
    previous = std::move(b);
    bytes += static_cast<int64_t>(n);
  }
  state.SetItemsProcessed(state.iterations());
  if (touch) state.SetBytesProcessed(bytes);
}

void Args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"bytes", "touch"});
  for (int64_t base : {int64_t{1} << 20, int64_t{32} << 20, int64_t{800} << 20}) {
    for (int64_t touch : {0, 1}) b->Args({base, touch});
  }
}

BENCHMARK(BM_Pool)->Apply(Args);
BENCHMARK(BM_MallocFree)->Apply(Args);

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  if (!draftfeed::bench::InitBenchmarks(argc, argv, "0.2")) return 1;
  return draftfeed::bench::RunRegisteredBenchmarks();
}
