// The main() of draftfeed-bench-kernels: every CUDA kernel family against the H200's spec ceilings.
//
//   build/bin/draftfeed-bench-kernels [--benchmark_filter=Attention]
//
// The benchmarks live in memory_bound_kernels_benchmark.cc (GB/s: norms,
// rope, elementwise, embedding, checksum, random init), attention_benchmark.cc,
// gdn_benchmark.cc and moe_benchmark.cc (TFLOP/s). Without a CUDA device it says so and exits
// 0, so a CPU machine can build and run it.
#include <cuda_runtime.h>

#include <cstdio>
#include <string_view>

#include "bench/micro/benchmark_main.h"
#include "benchmark/benchmark.h"

namespace {

// --benchmark_list_tests touches no device, so it lists on any machine.
bool ListOnly(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--benchmark_list_tests" || arg == "--benchmark_list_tests=true") return true;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  const bool list_only = ListOnly(argc, argv);
  if (!draftfeed::bench::InitBenchmarks(argc, argv, "0.2")) return 1;
  if (list_only) return draftfeed::bench::RunRegisteredBenchmarks();
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("draftfeed-bench-kernels: no CUDA device (%s); nothing to measure.\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
    benchmark::Shutdown();
    return 0;
  }
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    benchmark::AddCustomContext("gpu", prop.name);
  }
  benchmark::AddCustomContext("ceilings", "H200 SXM spec: 4.8 TB/s HBM, 989 TFLOP/s dense bf16");
  return draftfeed::bench::RunRegisteredBenchmarks();
}
