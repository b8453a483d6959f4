// Small fused elementwise ops of the decoder: SwiGLU, the attention output
// gate, copying the residual stream into a capture slot, and a row's dot
// product with one weight row.
#pragma once

#include "kernels/common.cuh"

namespace draftfeed::cuda {

// out[t, i] = SiLU(gate_up[t, i])·gate_up[t, F + i]: gate_up is the output of
// the fused [gate; up] projection, [T, 2F]. out: [T, F]. fp32 maths.
cudaError_t SwiGlu(const bf16* gate_up, int64_t num_tokens, int64_t ffn_dim, bf16* out,
                   cudaStream_t stream);

// o[t, h, j] *= sigmoid(gate[t*gate_token_stride + h*gate_head_stride + j])
// for o: [T, heads, head_dim] dense (the gated attention output).
cudaError_t SigmoidGateMul(bf16* o, const bf16* gate, int64_t num_tokens, int64_t heads,
                           int64_t head_dim, int64_t gate_token_stride, int64_t gate_head_stride,
                           cudaStream_t stream);

// capture[t*K*width + slot*width + i] = bf16(residual[t*width + i]).
cudaError_t CaptureResidual(const float* residual, int64_t num_tokens, int64_t width, bf16* capture,
                            int64_t num_slots, int64_t slot, cudaStream_t stream);

// out[t] = bf16(Σ_i x[t·x_stride + i]·w[i]) for t < num_tokens: a [T, width]
// by [width] product, the N = 1 "GEMM" of the MoE's shared-expert gate. One
// warp a row, each lane summing its elements in order in fp32, then a fixed
// shuffle tree: a row's value never depends on num_tokens, where cuBLASLt
// picks an N = 1 algorithm (split-K or not) by M and so rounds a token
// differently with the batch it is in.
cudaError_t RowDot(const bf16* x, int64_t x_stride, const bf16* w, int64_t num_tokens,
                   int64_t width, bf16* out, cudaStream_t stream);

}  // namespace draftfeed::cuda
