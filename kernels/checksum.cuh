// The BatchDone payload checksum (kernels/checksum_terms.h), computed
// where the payload is: on the GPU. Its eight lane sums are plain sums, so the
// kernel adds them in any order; the host folds them (FinishPayloadChecksum).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace draftfeed::cuda {

// Enqueues the lane sums of `bytes` bytes at `data` (device memory, 16-byte
// aligned) on `stream`: once the stream reaches this point, host_lanes[0..8)
// (pinned host memory) hold them, and
// v1::FinishPayloadChecksum(host_lanes, bytes) is the checksum. `scratch` is
// eight device uint64s.
cudaError_t EnqueuePayloadLanes(const void* data, size_t bytes, unsigned long long* scratch,
                                uint64_t* host_lanes, cudaStream_t stream);

// The same, waited for and folded: *checksum is the payload's checksum.
cudaError_t PayloadChecksum(const void* data, size_t bytes, unsigned long long* scratch,
                            uint64_t* host_lanes, uint64_t* checksum, cudaStream_t stream);

}  // namespace draftfeed::cuda
