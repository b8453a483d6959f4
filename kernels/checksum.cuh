// The NCCL transport's payload checksum (v1::PositionalChecksum in
// proto/draftfeed/v1/checksum.h), computed where the payload is: on the GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace draftfeed::cuda {

// Writes the checksum of `bytes` bytes at `data` (device memory, 8-byte
// aligned) into *host_out (pinned host memory) and waits for it on `stream`.
// `scratch` is one device uint64.
cudaError_t PositionalChecksum(const void* data, size_t bytes, unsigned long long* scratch,
                               uint64_t* host_out, cudaStream_t stream);

// The same, enqueued only: once `stream` reaches this point, *host_sum holds
// the raw sum; v1::PositionalFinish(*host_sum, bytes) is the checksum.
cudaError_t EnqueuePositionalSum(const void* data, size_t bytes, unsigned long long* scratch,
                                 uint64_t* host_sum, cudaStream_t stream);

}  // namespace draftfeed::cuda
