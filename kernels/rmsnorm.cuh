// RMSNorm in the conventions of Qwen3.5 / Qwen3, fused with the residual add.
// Row-wise over `width` elements; rows are `x_stride` / `out_stride` elements
// apart, so per-head q/k norms read and write in place inside a projection.
#pragma once

#include "kernels/common.cuh"
#include "kernels/fp8_gemm_operands.cuh"

namespace draftfeed::cuda {

enum class NormKind {
  kZeroCentred,     // y = x̂·(1 + w)   Qwen3.5 RMSNorm₀
  kMultiplicative,  // y = w·x̂         Qwen3
};

// The norms that feed a projection can also write its FP8 operand: with
// `fp8` set, the bf16 output is quantized as QuantizeActivationsFp8 would
// quantize it (bit for bit, padding rows included) in the same pass where
// the row is a multiple of 128 wide and the pointers are 16-byte aligned,
// else by that quantizer after the norm. The quantized row (k) must be a
// multiple of 128.

// Normalises the fp32 residual stream into bf16. out may be strided (e.g.
// straight into a [T, K, H] capture slot).
cudaError_t RmsNormF32(const float* x, int64_t x_stride, const bf16* w, int64_t rows, int64_t width,
                       float eps, NormKind kind, bf16* out, int64_t out_stride, cudaStream_t stream,
                       Fp8Activations fp8 = {});

// residual[r] += float(delta[r]), then out[r] = norm(residual[r]). The fused
// form of "h = h + mixer(u); u = norm(h)". delta: [rows, width] dense.
cudaError_t AddRmsNormF32(float* residual, const bf16* delta, const bf16* w, int64_t rows,
                          int64_t width, float eps, NormKind kind, bf16* out, cudaStream_t stream,
                          Fp8Activations fp8 = {});

// In-place bf16 norm (q_norm / k_norm per head), maths in fp32.
cudaError_t RmsNormBf16InPlace(bf16* x, int64_t x_stride, const bf16* w, int64_t rows,
                               int64_t width, float eps, NormKind kind, cudaStream_t stream);

// GDN output norm: out = w·x̂·SiLU(z) per row (w multiplicative, fp32 maths).
// x: [rows, width] dense; z rows are z_stride apart; out: [rows, width] dense.
// (Not fused with out_proj's quantization: its 128-wide rows ran slower
// fused than as two passes.)
cudaError_t GatedRmsNorm(const bf16* x, const bf16* z, int64_t z_stride, const bf16* w,
                         int64_t rows, int64_t width, float eps, bf16* out, cudaStream_t stream);

// residual[r] += float(delta[r]) without a norm (the last layer when only its
// raw output is captured).
cudaError_t AddResidual(float* residual, const bf16* delta, int64_t rows, int64_t width,
                        cudaStream_t stream);

}  // namespace draftfeed::cuda
