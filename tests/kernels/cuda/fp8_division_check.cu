#include "tests/kernels/cuda/fp8_division_check.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/fp8_quantize_group.cuh"

namespace draftfeed::testing {
namespace {

__device__ float Bf16BitsToFloat(uint32_t bits) { return __uint_as_float(bits << 16); }

__device__ uint8_t IeeeE4m3(float x, float s) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(x, s), __NV_SATFINITE, __NV_E4M3));
}

// One block per amax (the bf16 bits 0x0000..0x7F7F: +0 and every positive
// finite value); its threads walk all 65,536 bf16 x. The pair path is the
// quantizer's own (Quantize8 over a run of 8 x), so its packing is checked too.
__global__ void CheckKernel(unsigned long long* pairs, unsigned long long* mismatches,
                            unsigned long long* first) {
  const uint32_t amax_bits = blockIdx.x;
  const float amax = Bf16BitsToFloat(amax_bits);
  const cuda::fp8::GroupScale g = cuda::fp8::ScaleOf(amax);
  unsigned long long tried = 0, bad = 0;
  for (uint32_t base = threadIdx.x * 8; base < 65536; base += blockDim.x * 8) {
    float v[8];
    bool use[8];
    for (int j = 0; j < 8; ++j) {
      const float x = Bf16BitsToFloat(base + j);
      use[j] = fabsf(x) <= amax;  // NaN and |x| > amax: never in one group with this amax
      v[j] = use[j] ? x : 0.0f;
    }
    const uint2 q = cuda::fp8::Quantize8(v, g);
    for (int j = 0; j < 8; ++j) {
      if (!use[j]) continue;
      ++tried;
      const uint8_t got = static_cast<uint8_t>((j < 4 ? q.x : q.y) >> (8 * (j % 4)));
      if (got != IeeeE4m3(v[j], g.s)) {
        ++bad;
        atomicMin(first, (static_cast<unsigned long long>(amax_bits) << 16) | (base + j));
      }
    }
  }
  atomicAdd(pairs, tried);
  if (bad > 0) atomicAdd(mismatches, bad);
}

}  // namespace

cudaError_t CheckReciprocalDivisionForEveryBf16(DivisionCheck* out) {
  unsigned long long* d = nullptr;
  cudaError_t e = cudaMalloc(&d, 3 * sizeof(unsigned long long));
  if (e != cudaSuccess) return e;
  const unsigned long long init[3] = {0, 0, ~0ull};
  e = cudaMemcpy(d, init, sizeof(init), cudaMemcpyHostToDevice);
  if (e == cudaSuccess) {
    CheckKernel<<<0x7F80, 256>>>(d, d + 1, d + 2);
    e = cudaGetLastError();
  }
  unsigned long long h[3] = {0, 0, 0};
  if (e == cudaSuccess) e = cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
  cudaFree(d);
  out->pairs = h[0];
  out->mismatches = h[1];
  out->first_amax_bits = static_cast<uint32_t>(h[2] >> 16);
  out->first_x_bits = static_cast<uint32_t>(h[2] & 0xFFFF);
  return e;
}

}  // namespace draftfeed::testing
