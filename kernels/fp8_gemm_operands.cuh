// The operands of the fine-grained FP8 GEMMs, in the layouts cuBLASLt's
// block-scaled mode reads on sm_90 (found by probing it against a reference,
// see the GPU test): activations quantized per token and 128-wide K group,
// weights e4m3 with one fp32 scale per 128x128 block, and the conversions the
// loader needs (checkpoint scales to that layout; GPU-made random weights
// quantized; FP8 weights dequantized for the kernels that take bf16).
//
// Layouts, for Y[M, N] = X[M, K]·W[N, K]ᵀ with KB = K / 128:
//   xq      [M_pad, K] e4m3, row-major; M_pad = Fp8RowsPadded(M) (rows >= M are 0)
//   x_scale [KB, M_pad] fp32: the scale of token m's group g at g * M_pad + m
//   wq      [N, K] e4m3, row-major
//   w_scale [ceil(N/128), Fp8ScaleStride(K)] fp32: block (nb, g) at nb * stride + g
#pragma once

#include <cstdint>

#include "kernels/common.cuh"

namespace draftfeed::cuda {

inline constexpr int64_t kFp8Block = 128;
inline constexpr float kFp8Max = 448.0f;
// An all-zero activation group still gets a finite, non-zero scale (so the
// GEMM never sees 0 * inf): amax is clamped from below, as vLLM's quantizer does.
inline constexpr float kFp8MinAmax = 1e-10f;

// cuBLASLt takes M (the token count) only in multiples of 4 with these modes.
inline constexpr int64_t Fp8RowsPadded(int64_t m) { return (m + 3) / 4 * 4; }
// The weight scales' row stride: the K blocks padded to a multiple of 4.
inline constexpr int64_t Fp8ScaleStride(int64_t k) {
  return ((k + kFp8Block - 1) / kFp8Block + 3) / 4 * 4;
}

// Where a producer also writes the quantized copy of its bf16 output for the
// FP8 GEMM that reads it (xq and x_scale as above); q == nullptr: none.
struct Fp8Activations {
  uint8_t* q = nullptr;
  float* scale = nullptr;
};

// Quantizes x[m, :] (row stride ldx, bf16) for m < M into xq/x_scale as above:
// s = max(amax, kFp8MinAmax) / 448 per 128 group (fp32), q = e4m3(x / s)
// (IEEE division, round to nearest even, saturating). Rows M..M_pad-1 get
// q = 0, s = 0. K must be a multiple of 128.
cudaError_t QuantizeActivationsFp8(const bf16* x, int64_t ldx, int64_t m, int64_t k, uint8_t* xq,
                                   float* x_scale, cudaStream_t stream);

// SwiGLU fused with the quantization of its output, the down projection's
// input: the values are exactly SwiGlu's (elementwise.cuh), rounded to bf16,
// then quantized as QuantizeActivationsFp8 does. gate_up: [M, 2F]; F % 128 == 0.
cudaError_t SwiGluQuantizeFp8(const bf16* gate_up, int64_t m, int64_t ffn_dim, uint8_t* xq,
                              float* x_scale, cudaStream_t stream);

// SigmoidGateMul (elementwise.cuh) fused with the quantization of its
// output, the o projection's input: o is still written (the same bf16), and
// fp8 gets o quantized as QuantizeActivationsFp8 would. heads·head_dim must
// be a multiple of 128, head_dim and the gate strides multiples of 8, o and
// gate 16-byte aligned.
cudaError_t SigmoidGateMulQuantizeFp8(bf16* o, const bf16* gate, int64_t num_tokens, int64_t heads,
                                      int64_t head_dim, int64_t gate_token_stride,
                                      int64_t gate_head_stride, Fp8Activations fp8,
                                      cudaStream_t stream);

// Quantizes bf16 weights w[N, K] by 128x128 blocks (s = amax / 448, an
// all-zero block s = 1; q = e4m3(w / s)): the host quantizer's rule, for the
// GPU-made random FP8 models. Writes wq [N, K] and w_scale with row stride
// `scale_stride` (>= ceil(K/128)).
cudaError_t QuantizeWeightBlocksFp8(const bf16* w, int64_t n, int64_t k, uint8_t* wq,
                                    float* w_scale, int64_t scale_stride, cudaStream_t stream);

// w[r, c] = bf16(float(wq[r, c]) * scale[(r / 128) * scale_stride + c / 128])
// for the kernels that take bf16 weights (the MoE experts' grouped GEMMs).
cudaError_t DequantizeWeightBlocksFp8(const uint8_t* wq, const float* scale, int64_t scale_stride,
                                      int64_t n, int64_t k, bf16* w, cudaStream_t stream);

}  // namespace draftfeed::cuda
