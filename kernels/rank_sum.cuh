// The sums of tensor parallelism on one device: the ranks' partial block
// outputs added in a fixed order (an all-reduce whose ranks share a GPU, so
// that one GPU can prove a sharding plan), and an fp32 partial added into
// the fp32 residual stream (a sharded MoE block's summed output).
#pragma once

#include "kernels/common.cuh"

namespace draftfeed::cuda {

inline constexpr int kMaxRankSumRanks = 8;

// For i in [begin, end): s = ((b[0][i] + b[1][i]) + b[2][i]) + ... in fp32,
// written to every b[r][i] (rounded once for bf16). `ranks` buffers of
// `bf16 ? bf16 : float` elements, 1 <= ranks <= kMaxRankSumRanks; every
// buffer must be readable and writable from the current device.
cudaError_t SumRanks(void* const* buffers, int ranks, bool bf16_elements, int64_t begin,
                     int64_t end, cudaStream_t stream);

// residual[i] += delta[i] for i < n, fp32.
cudaError_t AddF32(float* residual, const float* delta, int64_t n, cudaStream_t stream);

}  // namespace draftfeed::cuda
