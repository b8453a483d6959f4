// Token embedding gather into the fp32 residual stream.
#pragma once

#include "kernels/common.cuh"

namespace draftfeed::cuda {

// out[t, :] = float(table[ids[t], :]). ids: [T] (validated by the caller);
// table: [vocab, width] bf16; out: [T, width] fp32.
cudaError_t EmbeddingLookup(const int32_t* ids, int64_t num_tokens, const bf16* table,
                            int64_t width, float* out, cudaStream_t stream);

}  // namespace draftfeed::cuda
