// The payload checksum, each path and way of feeding it, in bytes/s against memcpy of that size.
//
//   build/bin/draftfeed-bench-checksum [--benchmark_filter=avx2]
//
// Sizes: 64 KiB (in L2), 4 MiB (one HiddenChunk, TargetServiceOptions'
// chunk_bytes) and 64 MiB (from DRAM, a batch's worth). memcpy is the
// ceiling of CopyAndUpdate (which moves the same bytes) and a bound on the
// read-only hash, which cannot beat reading its input.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "bench/micro/benchmark_main.h"
#include "benchmark/benchmark.h"
#include "common/payload_checksum.h"

namespace draftfeed {
namespace {

constexpr size_t kSizes[] = {size_t{64} << 10, size_t{4} << 20, size_t{64} << 20};

// One random source and one destination of the largest size, shared by every
// benchmark (filling 64 MiB per run would dwarf the short runs).
const std::vector<unsigned char>& Source() {
  static const std::vector<unsigned char> src = [] {
    std::vector<unsigned char> b(kSizes[std::size(kSizes) - 1]);
    std::mt19937_64 rng(1);
    for (size_t i = 0; i + 8 <= b.size(); i += 8) {
      const uint64_t x = rng();
      std::memcpy(&b[i], &x, 8);
    }
    return b;
  }();
  return src;
}

unsigned char* Destination() {
  static std::vector<unsigned char> dst(kSizes[std::size(kSizes) - 1], 1);  // pages touched
  return dst.data();
}

struct Path {
  int id;  // UseChecksumPathForTesting's argument
  const char* name;
};
constexpr Path kPaths[] = {{0, "auto"}, {1, "sse2"}, {2, "avx2"}};

void BM_Memcpy(benchmark::State& state, size_t n) {
  const unsigned char* src = Source().data();
  unsigned char* dst = Destination();
  for (auto _ : state) {
    std::memcpy(dst, src, n);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n));
}

void BM_PayloadChecksum(benchmark::State& state, Path path, size_t n) {
  v1::UseChecksumPathForTesting(path.id);
  const unsigned char* src = Source().data();
  for (auto _ : state) benchmark::DoNotOptimize(v1::PayloadChecksum(src, n));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n));
  v1::UseChecksumPathForTesting(0);
}

// The client's use: each chunk copied into the batch buffer and hashed in
// one pass, here in pieces of a HiddenChunk (4 MiB) as they arrive.
void BM_CopyAndUpdate(benchmark::State& state, Path path, size_t n) {
  v1::UseChecksumPathForTesting(path.id);
  const unsigned char* src = Source().data();
  unsigned char* dst = Destination();
  const size_t piece = std::min(n, size_t{4} << 20);
  v1::PayloadHasher hasher;
  for (auto _ : state) {
    hasher.Reset();
    for (size_t at = 0; at < n; at += piece) {
      hasher.CopyAndUpdate(dst + at, src + at, std::min(piece, n - at));
    }
    benchmark::DoNotOptimize(hasher.Finish());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n));
  v1::UseChecksumPathForTesting(0);
}

void BM_PayloadChecksumReference(benchmark::State& state, size_t n) {
  const unsigned char* src = Source().data();
  for (auto _ : state) benchmark::DoNotOptimize(v1::PayloadChecksumReference(src, n));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n));
}

std::string SizeName(size_t n) {
  return n >= (size_t{1} << 20) ? std::to_string(n >> 20) + "MiB" : std::to_string(n >> 10) + "KiB";
}

// Each size's group lists memcpy first, so every figure sits under its ceiling.
void RegisterAll() {
  std::vector<Path> paths;
  for (const Path& p : kPaths) {
    // A path this CPU lacks (AVX2 on an old machine) is left out, not failed.
    if (v1::UseChecksumPathForTesting(p.id)) paths.push_back(p);
  }
  v1::UseChecksumPathForTesting(0);
  for (size_t n : kSizes) {
    const std::string size = SizeName(n);
    benchmark::RegisterBenchmark(("Memcpy/" + size).c_str(), BM_Memcpy, n);
    for (const Path& p : paths) {
      benchmark::RegisterBenchmark(("PayloadChecksum/" + std::string(p.name) + "/" + size).c_str(),
                                   BM_PayloadChecksum, p, n);
    }
    for (const Path& p : paths) {
      benchmark::RegisterBenchmark(("CopyAndUpdate/" + std::string(p.name) + "/" + size).c_str(),
                                   BM_CopyAndUpdate, p, n);
    }
    benchmark::RegisterBenchmark(("PayloadChecksumReference/" + size).c_str(),
                                 BM_PayloadChecksumReference, n);
  }
}

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  if (!draftfeed::bench::InitBenchmarks(argc, argv, "0.2")) return 1;
  draftfeed::RegisterAll();
  return draftfeed::bench::RunRegisteredBenchmarks();
}
