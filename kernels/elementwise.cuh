// Small fused elementwise ops of the decoder: SwiGLU, the attention output
// gate, and copying the residual stream into a capture slot.
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

}  // namespace draftfeed::cuda
