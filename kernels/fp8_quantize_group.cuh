// Device-side pieces of the activation quantizer (fp8_gemm_operands.cuh's
// rule: s = max(amax, kFp8MinAmax) / 448 per token and 128-wide group,
// q = e4m3(x / s) rounded to nearest even, saturating), shared by the
// quantizing kernels and the producers that quantize their own output
// (the norms, SwiGLU). Internal to kernels/; no launchers.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda::fp8 {

// A group's scale and its correctly rounded reciprocal.
struct GroupScale {
  float s;
  float r;
};

__device__ __forceinline__ GroupScale ScaleOf(float amax) {
  const float s = fmaxf(amax, kFp8MinAmax) / kFp8Max;
  return {s, __frcp_rn(s)};
}

// x / s as e4m3, without a division per element: q0 = x·r, then one
// correction step from the exact residual (an FMA). For every bf16 x and
// every scale of a bf16 amax >= |x| this gives e4m3(__fdiv_rn(x, s)) bit for
// bit; the quotients where the fp32 steps differ from the IEEE division lie
// below 2^-11 and both round to a zero of the same sign. The GPU test
// `Fp8OperandsCudaTest.ReciprocalDivisionEqualsIeeeDivisionForEveryBf16`
// checks every such pair on the device. A zero residual keeps q0, which also
// keeps the sign of −0.
__device__ __forceinline__ float Divide(float x, GroupScale g) {
  const float q0 = x * g.r;
  const float e = fmaf(-q0, g.s, x);
  return e == 0.0f ? q0 : fmaf(e, g.r, q0);
}

// Two quotients to two e4m3 bytes (low byte = a) in one conversion.
__device__ __forceinline__ uint16_t PackE4m3x2(float a, float b) {
  return static_cast<uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// Eight values of one group to eight e4m3 bytes.
__device__ __forceinline__ uint2 Quantize8(const float (&v)[vec::kVec], GroupScale g) {
  uint2 out;
  out.x = static_cast<uint32_t>(PackE4m3x2(Divide(v[0], g), Divide(v[1], g))) |
          static_cast<uint32_t>(PackE4m3x2(Divide(v[2], g), Divide(v[3], g))) << 16;
  out.y = static_cast<uint32_t>(PackE4m3x2(Divide(v[4], g), Divide(v[5], g))) |
          static_cast<uint32_t>(PackE4m3x2(Divide(v[6], g), Divide(v[7], g))) << 16;
  return out;
}

__device__ __forceinline__ float AbsMax8(const float (&v)[vec::kVec]) {
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < vec::kVec; ++j) m = fmaxf(m, fabsf(v[j]));
  return m;
}

// The max over aligned runs of `kLanes` lanes (a power of two <= 32); every
// lane of the warp must call it.
template <int kLanes>
__device__ __forceinline__ float LanesMax(float v) {
#pragma unroll
  for (int o = kLanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Rows m..m_pad-1 of a quantized operand of width k: q = 0 and s = 0, as the
// quantizer writes them (a GEMM reads whole padded rows). Called by threads
// `thread` of `threads` (by default a whole block).
__device__ __forceinline__ void ZeroPadRows(uint8_t* q, float* scale, int64_t m, int64_t m_pad,
                                            int64_t k, int thread = threadIdx.x,
                                            int threads = blockDim.x) {
  const int64_t bytes = (m_pad - m) * k;  // k % 128 == 0: whole 16-byte runs
  for (int64_t i = thread; i < bytes / 16; i += threads) {
    reinterpret_cast<uint4*>(q + m * k)[i] = make_uint4(0, 0, 0, 0);
  }
  const int64_t groups = k / kFp8Block;
  for (int64_t i = thread; i < groups * (m_pad - m); i += threads) {
    scale[(i / (m_pad - m)) * m_pad + m + i % (m_pad - m)] = 0.0f;
  }
}

}  // namespace draftfeed::cuda::fp8
