#include "kernels/checksum.cuh"

#include <algorithm>

#include "kernels/checksum_terms.h"

namespace draftfeed::cuda {
namespace {

constexpr int kLanes = v1::kChecksumLanes;

// Grid-stride over 16-byte loads: pair p holds words 2p and 2p+1, lanes
// 2(p%4) and 2(p%4)+1 of stripe p/4. The stride is a multiple of 4 pairs, so
// each thread stays on one lane pair and keeps two sums; the adds are mod
// 2^64 and commute, so the block order cannot change the result.
__global__ void PayloadLanesKernel(const uint64_t* __restrict__ words, size_t n_words,
                                   const unsigned char* __restrict__ tail, size_t tail_bytes,
                                   unsigned long long* out) {
  const int q = threadIdx.x % 4;
  const uint64_t key_a = v1::LaneKey(2 * q), key_b = v1::LaneKey(2 * q + 1);
  uint64_t a = 0, b = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t pairs = n_words / 2;
  const auto* w2 = reinterpret_cast<const ulonglong2*>(words);
  for (size_t p = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
       p += stride) {
    const ulonglong2 v = w2[p];
    const uint64_t step = (p / 4) * v1::kStripeStep;
    a += v1::KeyedTerm(v.x, key_a + step);
    b += v1::KeyedTerm(v.y, key_b + step);
  }
  // Threads 4 apart in a warp share a lane pair.
  for (int off = 4; off < 32; off *= 2) {
    a += __shfl_xor_sync(0xffffffffu, a, off);
    b += __shfl_xor_sync(0xffffffffu, b, off);
  }
  __shared__ uint64_t warp_lanes[32][kLanes];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < 4) {
    warp_lanes[warp][2 * lane] = a;
    warp_lanes[warp][2 * lane + 1] = b;
  }
  __syncthreads();
  if (threadIdx.x < kLanes) {
    uint64_t sum = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) sum += warp_lanes[w][threadIdx.x];
    atomicAdd(out + threadIdx.x, static_cast<unsigned long long>(sum));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    // An odd last word, then the zero-padded partial word.
    size_t i = 2 * pairs;
    if (i < n_words) {
      atomicAdd(out + i % kLanes, static_cast<unsigned long long>(v1::ChecksumTerm(
                                      words[i], i / kLanes, static_cast<int>(i % kLanes))));
      ++i;
    }
    if (tail_bytes > 0) {
      uint64_t w = 0;
      for (size_t k = 0; k < tail_bytes; ++k) w |= static_cast<uint64_t>(tail[k]) << (8 * k);
      atomicAdd(out + i % kLanes, static_cast<unsigned long long>(v1::ChecksumTerm(
                                      w, i / kLanes, static_cast<int>(i % kLanes))));
    }
  }
}

}  // namespace

cudaError_t EnqueuePayloadLanes(const void* data, size_t bytes, unsigned long long* scratch,
                                uint64_t* host_lanes, cudaStream_t stream) {
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0) return cudaErrorMisalignedAddress;
  if (cudaError_t e = cudaMemsetAsync(scratch, 0, kLanes * sizeof(*scratch), stream);
      e != cudaSuccess) {
    return e;
  }
  const size_t n_words = bytes / 8;
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int threads = 256;
  const size_t pairs = n_words / 2;
  const int blocks = static_cast<int>(std::max<size_t>(
      1, std::min<size_t>((pairs + threads - 1) / threads, static_cast<size_t>(sms) * 8)));
  PayloadLanesKernel<<<blocks, threads, 0, stream>>>(
      static_cast<const uint64_t*>(data), n_words,
      static_cast<const unsigned char*>(data) + n_words * 8, bytes % 8, scratch);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return cudaMemcpyAsync(host_lanes, scratch, kLanes * sizeof(*scratch), cudaMemcpyDeviceToHost,
                         stream);
}

cudaError_t PayloadChecksum(const void* data, size_t bytes, unsigned long long* scratch,
                            uint64_t* host_lanes, uint64_t* checksum, cudaStream_t stream) {
  if (cudaError_t e = EnqueuePayloadLanes(data, bytes, scratch, host_lanes, stream);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess) return e;
  *checksum = v1::FinishPayloadChecksum(host_lanes, bytes);
  return cudaSuccess;
}

}  // namespace draftfeed::cuda
