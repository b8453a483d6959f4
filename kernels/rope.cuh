// Partial rotary embedding (rotate-half over the first rotary_dim dims of each
// head) with positions that restart at every sequence.
#pragma once

#include "kernels/common.cuh"

namespace draftfeed::cuda {

// positions[t] = t − cu_seqlens[seq(t)]. cu_seqlens: [num_seqs + 1] on device.
cudaError_t PositionsFromCuSeqlens(const int32_t* cu_seqlens, int32_t num_seqs, int64_t num_tokens,
                                   int32_t* positions, cudaStream_t stream);

// In place on x [T, heads, head_dim] (token t at x + t*token_stride, head h at
// + h*head_stride): for j < rotary_dim/2, with φ = pos·θ^(−2j/rotary_dim)
// computed in fp32 as 1/θ^(2j/R),
//   y[j] = x[j]·cos φ − x[j+R/2]·sin φ,  y[j+R/2] = x[j+R/2]·cos φ + x[j]·sin φ.
// Dims ≥ rotary_dim are untouched. Maths in fp32, one rounding to bf16.
cudaError_t ApplyRope(bf16* x, int64_t num_tokens, int64_t heads, int64_t head_dim,
                      int64_t token_stride, int64_t head_stride, int64_t rotary_dim,
                      const int32_t* positions, float theta, cudaStream_t stream);

}  // namespace draftfeed::cuda
