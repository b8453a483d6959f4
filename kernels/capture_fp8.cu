#include <cuda_fp8.h>

#include "kernels/capture_fp8.cuh"

namespace draftfeed::cuda {
namespace {

constexpr int kThreads = 256;

// One block per (token, layer) row: a max reduction, then every value divided
// by the row's scale and rounded. The row is read twice; the second read hits
// L1/L2 (a 5,120-wide row is 10 KB).
__global__ void EncodeFp8CaptureKernel(const bf16* __restrict__ capture, int64_t layers,
                                       int64_t hidden, uint8_t* __restrict__ out) {
  const int64_t row = blockIdx.x;  // t * K + k
  const int64_t t = row / layers;
  const int64_t k = row % layers;
  const bf16* x = capture + row * hidden;

  // fmaxf ignores a NaN operand, as the host's comparison does.
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += kThreads) {
    amax = fmaxf(amax, fabsf(__bfloat162float(x[i])));
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  __shared__ float warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
  for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);

  const float q = __fdiv_rn(amax, 448.0f);
  const float s = q > 0.0f ? q : 1.0f;
  uint8_t* token = out + t * (layers * hidden + 4 * layers);
  uint8_t* codes = token + k * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += kThreads) {
    codes[i] = static_cast<uint8_t>(
        __nv_cvt_float_to_fp8(__fdiv_rn(__bfloat162float(x[i]), s), __NV_SATFINITE, __NV_E4M3));
  }
  if (threadIdx.x < 4) {
    // Bytewise: the scales sit at K*H + 4k, aligned only when H is.
    const unsigned bits = __float_as_uint(s);
    token[layers * hidden + 4 * k + threadIdx.x] = static_cast<uint8_t>(bits >> (8 * threadIdx.x));
  }
}

}  // namespace

cudaError_t EncodeFp8Capture(const bf16* capture, int64_t num_tokens, int64_t num_layers,
                             int64_t hidden, uint8_t* out, cudaStream_t stream) {
  if (num_tokens < 0 || num_layers < 0 || hidden < 0) return cudaErrorInvalidValue;
  const int64_t rows = num_tokens * num_layers;
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;  // gridDim.x
  EncodeFp8CaptureKernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(capture, num_layers,
                                                                               hidden, out);
  return cudaGetLastError();
}

}  // namespace draftfeed::cuda
