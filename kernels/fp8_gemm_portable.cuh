// The block-scaled FP8 GEMM that runs on every GPU the build covers (sm_90,
// sm_100, sm_120: warp-level mma.sync m16n8k32 e4m3, no wgmma, no TMA, 97.5 KB
// of shared memory a block, within sm_120's 99 KB), in fp8_gemm_portable.cu.
// Where Hopper's wgmma GEMM (hopper_gemm.cuh) does not run, and under
// DRAFTFEED_PORTABLE_KERNELS (kernel_paths.cuh), the dense FP8 projections
// run on this one: cuBLASLt serves 128x128-block scales on sm_90 only.
//
// Y[M, N] (bf16) = X·Wᵀ, the same operands and maths as Fp8BlockGemm: X
// quantized per token and 128-wide K group, W e4m3 with one fp32 scale per
// 128x128 block, in kernels/fp8_gemm_operands.cuh's layouts. Per 128-wide K
// block g the tensor cores' fp32 partial is scaled by s_x[row, g]·S_w[n / 128,
// g] and added (one fused multiply-add) to an fp32 accumulator in registers,
// in K order; one bf16 rounding of Y. No split-K and no atomics: every output
// element is summed in the same order whatever M is and wherever its row
// sits in the tile, so a token's Y does not depend on the batch around it.
#pragma once

#include <cstdint>

#include "kernels/common.cuh"

namespace draftfeed::cuda {

// True where the current GPU runs the kernel: compute capability 8.9 or newer
// (e4m3 mma.sync) and code for it in the loaded binary.
bool PortableFp8GemmAvailable();

// Fp8BlockGemm's operands, shapes and result (hopper_gemm.cuh): columns
// 0..n-1 of y's m_pad rows written, the others untouched; x_scale 16-byte
// aligned too (its 128-row slices are copied by cp.async), w_scale 4-byte.
// cudaErrorInvalidValue for a shape or pointer it cannot take,
// cudaErrorNotSupported where !PortableFp8GemmAvailable().
cudaError_t Fp8BlockGemmPortable(const uint8_t* xq, const float* x_scale, const uint8_t* wq,
                                 const float* w_scale, int64_t w_scale_stride, bf16* y, int64_t ldy,
                                 int64_t m_pad, int64_t n, int64_t k, cudaStream_t stream);

}  // namespace draftfeed::cuda
