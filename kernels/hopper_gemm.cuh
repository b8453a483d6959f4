// draftfeed's own GEMMs for Hopper (sm_90a, TMA + wgmma, in hopper_gemm.cu):
// the fine-grained FP8 GEMM, and the MoE experts' grouped GEMMs in FP8 and
// bf16.
//
// The FP8 GEMM: Y[M, N] (bf16) = X·Wᵀ with X quantized per token and 128-wide
// K group and W e4m3 with one fp32 scale per 128x128 block, in
// kernels/fp8_gemm_operands.cuh's layouts (the ones cuBLASLt's block-scaled
// mode reads, so either GEMM takes the same operands). Per 128-wide K block
// the tensor cores' fp32 partial is scaled by s_x[row, g]·S_w[n / 128, g] and
// added to an fp32 accumulator in registers; one bf16 rounding of Y.
#pragma once

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/fp8_gemm_operands.cuh"

namespace draftfeed::cuda {

// True where the loaded binary has the sm_90a kernel (a Hopper GPU running
// this build's sm_90a SASS) and DRAFTFEED_PORTABLE_KERNELS allows it; the
// MoE experts take moe_gemm.cu's mma.sync kernels otherwise.
bool HopperGemmsAvailable();

// xq [m_pad, k] e4m3; x_scale [k / 128, m_pad]; wq [n, k] e4m3; w_scale
// [ceil(n / 128), w_scale_stride]; y [m_pad, ldy] bf16, columns 0..n-1
// written. m_pad a multiple of 4 (Fp8RowsPadded), k of 128, n of 16, ldy
// even and >= n; xq, x_scale and wq 16-byte aligned (TMA), y 4-byte.
// cudaErrorNotSupported where !HopperGemmsAvailable(), cudaErrorInvalidValue
// for a shape it cannot take.
cudaError_t Fp8BlockGemm(const uint8_t* xq, const float* x_scale, const uint8_t* wq,
                         const float* w_scale, int64_t w_scale_stride, bf16* y, int64_t ldy,
                         int64_t m_pad, int64_t n, int64_t k, cudaStream_t stream);

// The dense MLP's [gate; up] projection fused with SwiGLU and the down
// projection's quantization: wq [2f, k] (gate rows, then up rows), w_scale
// [2f / 128, w_scale_stride]; act8 (16-byte aligned) gets SiLU(gate)·up of the m tokens,
// quantized as QuantizeActivationsFp8 would ([m_pad, f] e4m3, scales
// [f / 128, m_pad], padding rows zero), and no bf16 is written. Bit for bit
// Fp8BlockGemm into [m_pad, 2f] then SwiGluQuantizeFp8. f a multiple of
// 128; otherwise Fp8BlockGemm's conditions.
cudaError_t Fp8GemmSwiGluQuantize(const uint8_t* xq, const float* x_scale, const uint8_t* wq,
                                  const float* w_scale, int64_t w_scale_stride, int64_t m,
                                  int64_t f, int64_t k, Fp8Activations act8, cudaStream_t stream);

// The MoE experts' two FP8 GEMMs on the same kernel, over MoePermute's tile
// map (moe.cuh: tile_map [max_tiles][4], row_token), with the operands and
// results of moe.cuh's MoeGateUpSwiGluFp8 and MoeDownFp8, which call these
// where HopperGemmsAvailable(). gate_up gathers each sorted row's token
// from xq ([tokens, D] e4m3, scales [D/128][x_scale_stride] by token) and
// writes act = SiLU(gate)·up (fp32, one bf16 rounding) [rows, I]; down reads
// actq [act_scale_stride rows, I] (scales [I/128][act_scale_stride], the
// stride being the padded row count) and writes y [rows, D]. D and I
// multiples of 128; pointers 16-byte aligned, outputs 4-byte. With act8 set
// (16-byte aligned), gate_up writes act quantized for down instead (act8_rows
// rows, padded as QuantizeActivationsFp8 pads them), bit for bit what that
// quantizer would make of act, and leaves act unwritten.
cudaError_t Fp8MoeGateUpSwiGlu(const uint8_t* xq, const float* x_scale, int64_t x_scale_stride,
                               const uint8_t* gate_up, const float* gate_up_scale, int64_t hidden,
                               int64_t inter, int num_experts, const int32_t* tile_map,
                               int64_t max_tiles, const int32_t* row_token, bf16* act,
                               cudaStream_t stream, Fp8Activations act8 = {},
                               int64_t act8_rows = 0);
cudaError_t Fp8MoeDown(const uint8_t* actq, const float* act_scale, int64_t act_scale_stride,
                       const uint8_t* down, const float* down_scale, int64_t hidden, int64_t inter,
                       int num_experts, const int32_t* tile_map, int64_t max_tiles, bf16* y,
                       cudaStream_t stream);

// The same two on bf16 operands (moe.cuh's MoeGateUpSwiGlu and MoeDown call
// these where HopperGemmsAvailable() and D, I are multiples of 128): x rows
// x_stride (a multiple of 8) apart, act [rows, I] dense, fp32 accumulation,
// one bf16 rounding (gate_up: SiLU(gate)·up in fp32).
cudaError_t HopperMoeGateUpSwiGlu(const bf16* x, int64_t x_stride, const bf16* gate_up,
                                  int64_t hidden, int64_t inter, int num_experts,
                                  const int32_t* tile_map, int64_t max_tiles,
                                  const int32_t* row_token, bf16* act, cudaStream_t stream);
cudaError_t HopperMoeDown(const bf16* act, int64_t rows, const bf16* down, int64_t hidden,
                          int64_t inter, int num_experts, const int32_t* tile_map,
                          int64_t max_tiles, bf16* y, cudaStream_t stream);

}  // namespace draftfeed::cuda
