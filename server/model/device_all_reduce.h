// The all-reduce of a tensor-parallel CUDA group: after every mixer and MLP
// each rank's partial block output is summed over the ranks, in place, on
// the rank's compute stream. Ranks on distinct GPUs sum through NCCL (one
// communicator per rank in this process); ranks that share one GPU (a
// sharding plan proven on a single GPU) sum with a kernel in a fixed order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"

namespace draftfeed {

class DeviceAllReduce {
 public:
  virtual ~DeviceAllReduce() = default;
  // Every rank of the group calls Sum with the same count and element type,
  // each from its own thread, in the same order; `buffer` ([count] bf16 or
  // fp32 on the rank's device) holds the sum when `stream`'s work reaches
  // that point. Returns once the sum is enqueued.
  virtual absl::Status Sum(int rank, void* buffer, int64_t count, bool bf16_elements,
                           cudaStream_t stream) = 0;
  virtual int ranks() const = 0;
  // "nccl" or "one-device kernel", for the start-up line.
  virtual const char* kind() const = 0;
};

// The group's all-reduce over `devices` (rank r on devices[r]): a single
// rank needs none (nullptr); every rank on one GPU, the kernel sum; distinct
// GPUs, NCCL (UNIMPLEMENTED in a build without NCCL). A device listed twice
// among others is INVALID_ARGUMENT: NCCL takes one rank per GPU.
absl::StatusOr<std::unique_ptr<DeviceAllReduce>> MakeDeviceAllReduce(
    const std::vector<int>& devices);

// NCCL's all-reduce over distinct devices (nccl_all_reduce.cc; a build
// without NCCL returns UNIMPLEMENTED).
absl::StatusOr<std::unique_ptr<DeviceAllReduce>> MakeNcclAllReduce(const std::vector<int>& devices);

}  // namespace draftfeed
