// The draft index (target_outputs_kernel.cuh's DraftIndexLayout), built once
// per draft vocabulary: each draft id's column scattered into a vocabulary-
// sized map, then the map walked in id order into (id, column) pairs and the
// start of each 256-id bucket.
#include "kernels/target_outputs.cuh"
#include "kernels/target_outputs_kernel.cuh"

namespace draftfeed::cuda {
namespace {

constexpr int kPerLane = kTargetSeg / 32;

__global__ void ScatterDraftKernel(const int32_t* __restrict__ draft, int32_t n, int32_t vocab,
                                   int32_t* __restrict__ pos) {
  const int32_t j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int32_t id = draft[j];
  if (id >= 0 && id < vocab) pos[id] = j;
}

// One CTA walks the vocabulary 32 buckets at a time (a warp each), writing
// the pairs of the draft ids in id order and where each bucket starts.
// Once per draft vocabulary: tens of microseconds.
__global__ void __launch_bounds__(1024)
    CompactDraftKernel(const int32_t* __restrict__ pos, int32_t vocab, int32_t buckets,
                       int2* __restrict__ pairs, int32_t* __restrict__ starts) {
  __shared__ int32_t warp_count[32];
  __shared__ int32_t base;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  for (int32_t b0 = 0; b0 < buckets; b0 += 32) {
    const int32_t b = b0 + warp;
    int32_t col[kPerLane];
    uint32_t hits[kPerLane];
    int32_t count = 0;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int32_t v = b * kTargetSeg + r * 32 + lane;
      col[r] = b < buckets && v < vocab ? pos[v] : -1;
      hits[r] = __ballot_sync(0xffffffffu, col[r] >= 0);
      count += __popc(hits[r]);
    }
    if (lane == 0) warp_count[warp] = count;
    __syncthreads();
    int32_t at = base;
    for (int w = 0; w < warp; ++w) at += warp_count[w];
    if (b < buckets) {
      if (lane == 0) starts[b] = at;
#pragma unroll
      for (int r = 0; r < kPerLane; ++r) {
        if (col[r] >= 0) {
          pairs[at + __popc(hits[r] & ((1u << lane) - 1))] =
              make_int2(b * kTargetSeg + r * 32 + lane, col[r]);
        }
        at += __popc(hits[r]);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 0; w < 32; ++w) base += warp_count[w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) starts[buckets] = base;
}

}  // namespace

size_t DraftIndexBytes(int64_t vocab, int64_t num_draft) {
  return DraftIndexLayoutOf(vocab, num_draft).bytes;
}

cudaError_t BuildDraftIndex(const int32_t* draft, int64_t num_draft, int64_t vocab, void* index,
                            cudaStream_t stream) {
  if (vocab < 1 || vocab > (int64_t{1} << 30) || num_draft < 0 ||
      num_draft > kTargetOutputsMaxDraft || index == nullptr ||
      (num_draft > 0 && draft == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const DraftIndexLayout l = DraftIndexLayoutOf(vocab, num_draft);
  char* base = static_cast<char*>(index);
  int32_t* pos = reinterpret_cast<int32_t*>(base + l.pos);
  if (cudaError_t e = cudaMemsetAsync(pos, 0xff, 4 * static_cast<size_t>(vocab), stream);
      e != cudaSuccess) {
    return e;
  }
  if (num_draft > 0) {
    const int32_t n = static_cast<int32_t>(num_draft);
    ScatterDraftKernel<<<(n + 255) / 256, 256, 0, stream>>>(draft, n, static_cast<int32_t>(vocab),
                                                            pos);
  }
  CompactDraftKernel<<<1, 1024, 0, stream>>>(
      pos, static_cast<int32_t>(vocab), static_cast<int32_t>(l.buckets),
      reinterpret_cast<int2*>(base), reinterpret_cast<int32_t*>(base + l.starts));
  return cudaGetLastError();
}

}  // namespace draftfeed::cuda
