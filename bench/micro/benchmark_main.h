// The main() of draftfeed's Google Benchmark programs: a short default
// --benchmark_min_time so each program runs in well under a minute on a
// small CPU machine, which any flag on the command line still overrides.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "benchmark/benchmark.h"

namespace draftfeed::bench {

// Parses benchmark flags (with `default_min_time` seconds unless the command
// line sets --benchmark_min_time) and leaves the rest to the caller, who then
// calls RunRegisteredBenchmarks. Per-benchmark MinTime() would beat the flag,
// so the programs set none and rely on this default instead. Returns false if
// an unknown argument was passed (the usage was printed).
inline bool InitBenchmarks(int argc, char** argv, const char* default_min_time) {
  std::vector<char*> args(argv, argv + argc);
  std::string min_time = std::string("--benchmark_min_time=") + default_min_time;
  // Parsed in order, so a --benchmark_min_time the caller passes comes later and wins.
  args.insert(args.begin() + 1, min_time.data());
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  return !benchmark::ReportUnrecognizedArguments(n, args.data());
}

inline int RunRegisteredBenchmarks() {
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace draftfeed::bench
