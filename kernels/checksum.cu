#include "kernels/checksum.cuh"

#include <algorithm>

#include "proto/draftfeed/v1/checksum.h"

namespace draftfeed::cuda {
namespace {

using v1::PositionalMix;

// Grid-stride over 16-byte loads (two words); integer adds mod 2^64 commute,
// so the block order cannot change the result.
__global__ void PositionalSumKernel(const uint64_t* __restrict__ words, size_t n_words,
                                    const unsigned char* __restrict__ tail, size_t tail_bytes,
                                    unsigned long long* out) {
  uint64_t acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t pairs = n_words / 2;
  const auto* w2 = reinterpret_cast<const ulonglong2*>(words);
  for (size_t p = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
       p += stride) {
    const ulonglong2 v = w2[p];
    acc += PositionalMix(v.x) * (4 * p + 1) + PositionalMix(v.y) * (4 * p + 3);
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (n_words % 2 == 1) acc += PositionalMix(words[n_words - 1]) * (2 * (n_words - 1) + 1);
    if (tail_bytes > 0) {
      uint64_t w = 0;
      for (size_t b = 0; b < tail_bytes; ++b) w |= static_cast<uint64_t>(tail[b]) << (8 * b);
      acc += PositionalMix(w) * (2 * n_words + 1);
    }
  }
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  __shared__ uint64_t warp_sums[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    acc = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0;
    for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
    if (lane == 0) atomicAdd(out, static_cast<unsigned long long>(acc));
  }
}

}  // namespace

cudaError_t PositionalChecksum(const void* data, size_t bytes, unsigned long long* scratch,
                               uint64_t* host_out, cudaStream_t stream) {
  if (cudaError_t e = EnqueuePositionalSum(data, bytes, scratch, host_out, stream);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return e;
  *host_out = v1::PositionalFinish(*host_out, bytes);
  return cudaSuccess;
}

cudaError_t EnqueuePositionalSum(const void* data, size_t bytes, unsigned long long* scratch,
                                 uint64_t* host_sum, cudaStream_t stream) {
  if (cudaError_t e = cudaMemsetAsync(scratch, 0, sizeof(*scratch), stream); e != cudaSuccess) {
    return e;
  }
  const size_t n_words = bytes / 8;
  const size_t tail = bytes % 8;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int threads = 256;
  const size_t pairs = n_words / 2;
  const int blocks = static_cast<int>(
      std::max<size_t>(1, std::min<size_t>((pairs + threads - 1) / threads,
                                           static_cast<size_t>(sms) * 8)));
  PositionalSumKernel<<<blocks, threads, 0, stream>>>(
      static_cast<const uint64_t*>(data), n_words,
      static_cast<const unsigned char*>(data) + n_words * 8, tail, scratch);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return cudaMemcpyAsync(host_sum, scratch, sizeof(*scratch), cudaMemcpyDeviceToHost, stream);
}

}  // namespace draftfeed::cuda
