// Which variant of an op family runs on the current GPU, chosen at run time.
//
// The kernels are built as sm_90a, sm_100a and sm_120a SASS plus compute_90
// PTX (CMake's DRAFTFEED_CUDA_ARCHS). Two things differ between those GPUs
// that the kernels care about:
// - wgmma and setmaxnreg exist on sm_90a only. Attention and the GDN scan
//   (at key dim 128) run their wgmma kernels where the loaded binary is
//   sm_90a SASS (the kernel's block size says so) and their mma.sync kernels
//   everywhere else: sm_100, sm_120, and any GPU that JIT-compiles the PTX.
// - Shared memory a block may opt into: 227 KB on sm_90 and sm_100, 99 KB on
//   sm_120. Attention at head dim 256 and the GDN scan read the device's
//   limit and take a smaller KV tile or one pipeline stage where theirs does
//   not fit.
// TMA, mbarriers, cp.async and mma.sync (bf16 m16n8k16, e4m3 m16n8k32) exist
// on every sm_90 or newer GPU, so every other kernel is one kernel everywhere.
//
// DRAFTFEED_PORTABLE_KERNELS makes a Hopper run what another GPU would, so
// that those paths can be proven on one: `sm100` (the kernels of a B200: no
// wgmma, the device's shared memory), `1` or `sm120` (those of an RTX PRO
// 6000: no wgmma, at most 99 KB of shared memory a block). Unset, empty or
// `0`: what the device runs. The CUDA engine refuses another value at
// start-up; a kernel test reads it too (tests can also set the mode in
// process with ScopedPortableKernels).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace draftfeed::cuda {

inline constexpr char kPortableKernelsEnv[] = "DRAFTFEED_PORTABLE_KERNELS";
// sm_120's opt-in shared memory per block, the smallest of the supported GPUs.
inline constexpr int kSm120SmemPerBlock = 99 * 1024;

enum class PortableKernels : int {
  kAuto = 0,   // what this device runs
  kSm100 = 1,  // no wgmma; the device's shared memory
  kSm120 = 2,  // no wgmma; at most kSm120SmemPerBlock bytes of shared memory a block
};

// A DRAFTFEED_PORTABLE_KERNELS value: null, "" or "0": kAuto; "sm100": kSm100;
// "1" or "sm120": kSm120. False (out untouched) for anything else.
inline bool ParsePortableKernels(const char* value, PortableKernels* out) {
  if (value == nullptr || value[0] == '\0' || std::strcmp(value, "0") == 0) {
    *out = PortableKernels::kAuto;
  } else if (std::strcmp(value, "sm100") == 0) {
    *out = PortableKernels::kSm100;
  } else if (std::strcmp(value, "1") == 0 || std::strcmp(value, "sm120") == 0) {
    *out = PortableKernels::kSm120;
  } else {
    return false;
  }
  return true;
}

inline const char* PortableKernelsName(PortableKernels mode) {
  switch (mode) {
    case PortableKernels::kSm100:
      return "sm100";
    case PortableKernels::kSm120:
      return "sm120";
    default:
      return "auto";
  }
}

namespace internal {
// -1: the environment decides; else a PortableKernels set by a test.
inline std::atomic<int> portable_kernels_override{-1};
}  // namespace internal

// The mode in force: a test's ScopedPortableKernels, else the environment
// (read once; a value ParsePortableKernels refuses counts as kAuto here).
inline PortableKernels PortableKernelsMode() {
  const int set = internal::portable_kernels_override.load(std::memory_order_relaxed);
  if (set >= 0) return static_cast<PortableKernels>(set);
  static const PortableKernels from_env = [] {
    PortableKernels mode = PortableKernels::kAuto;
    ParsePortableKernels(std::getenv(kPortableKernelsEnv), &mode);
    return mode;
  }();
  return from_env;
}

// Runs another GPU's variants in this process while it lives (tests).
class ScopedPortableKernels {
 public:
  explicit ScopedPortableKernels(PortableKernels mode)
      : previous_(internal::portable_kernels_override.exchange(static_cast<int>(mode))) {}
  ~ScopedPortableKernels() { internal::portable_kernels_override.store(previous_); }
  ScopedPortableKernels(const ScopedPortableKernels&) = delete;
  ScopedPortableKernels& operator=(const ScopedPortableKernels&) = delete;

 private:
  int previous_;
};

// Whether a kernel may take its sm_90a-only variant where the binary has one.
inline bool HopperKernelsAllowed() { return PortableKernelsMode() == PortableKernels::kAuto; }

// Dynamic shared memory a block may opt into on the current device (capped at
// sm_120's under kSm120).
inline cudaError_t SmemPerBlockLimit(int* bytes) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (err == cudaSuccess && PortableKernelsMode() == PortableKernels::kSm120 &&
      *bytes > kSm120SmemPerBlock) {
    *bytes = kSm120SmemPerBlock;
  }
  return err;
}

}  // namespace draftfeed::cuda
