// Internal to kernels/target_outputs.cu and target_outputs_index.cu: the
// draft index's layout, the top-k's order on the device and the CTA-wide
// selection of the k best of a candidate buffer. No launchers.
//
// A candidate is one 64-bit word: the logit's order key (an unsigned integer
// that sorts as the float does) above ~id, so that "larger word" is exactly
// "larger logit, ties to the lower id", every word is distinct, and a single
// threshold word decides whether a new value can still enter the top-k.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace draftfeed::cuda {

// Vocabulary ids a warp takes per step of the op, and the width of the
// index's buckets (so that a warp finds its step's draft columns in one).
inline constexpr int kTargetSeg = 256;

// The draft index in one buffer: at 0 the (id, column) pairs of the draft
// ids in increasing id order (int2 [num_draft]); at `starts`, for each
// 256-id bucket the first pair of its ids, then the pairs' count (int32
// [buckets + 1]); at `pos`, the builder's scratch (int32 [vocab]).
struct DraftIndexLayout {
  int64_t buckets = 0;
  size_t starts = 0, pos = 0, bytes = 0;
};

inline DraftIndexLayout DraftIndexLayoutOf(int64_t vocab, int64_t num_draft) {
  auto align16 = [](size_t b) { return (b + 15) & ~size_t{15}; };
  DraftIndexLayout l;
  l.buckets = (vocab + kTargetSeg - 1) / kTargetSeg;
  l.starts = align16(8 * static_cast<size_t>(std::max<int64_t>(num_draft, 1)));
  l.pos = l.starts + align16(4 * static_cast<size_t>(l.buckets + 1));
  l.bytes = l.pos + 4 * static_cast<size_t>(vocab);
  return l;
}

}  // namespace draftfeed::cuda

namespace draftfeed::cuda::topk {

inline constexpr int kThreads = 256;  // one radix bin per thread
inline constexpr int kWarps = kThreads / 32;

// -0 sorts with +0 (they tie, as in the reference's comparison).
__device__ __forceinline__ uint32_t OrderKey(float x) {
  const uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t Composite(float x, int32_t id) {
  return (static_cast<uint64_t>(OrderKey(x)) << 32) | static_cast<uint32_t>(~id);
}

__device__ __forceinline__ uint32_t IdOf(uint64_t c) { return ~static_cast<uint32_t>(c); }

__device__ __forceinline__ float ValueOf(uint64_t c) {
  const uint32_t k = static_cast<uint32_t>(c >> 32);
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

struct Scratch {
  uint32_t warp_sum[kWarps];
  uint32_t digit, above, bin;
  int32_t kept;
  unsigned long long smallest;
};

// Leaves the k largest of the n (> k) distinct words c[0..n) in c[0..k), in
// no order, sets *count = k and returns the smallest of them. Called by the
// whole CTA. A radix select from the top byte down: each pass counts the
// words that share the digits chosen so far by their next byte (warp-
// aggregated, since logits crowd a few exponents), and picks the byte whose
// bin holds the k-th; it stops as soon as that bin is taken whole, which for
// real logits is after 3-4 of the 8 passes. The kept words pass through
// `side` (k words) to the front.
__device__ inline uint64_t SelectTopK(uint64_t* c, int32_t n, int32_t k, uint64_t* side,
                                      uint32_t* hist, Scratch& sh, int32_t* count) {
  static_assert(kThreads == 256, "one bin per thread");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint64_t prefix = 0;
  uint32_t need = static_cast<uint32_t>(k);
  int shift = 56;
  for (;;) {
    const uint64_t high = shift == 56 ? 0 : ~0ull << (shift + 8);
    hist[threadIdx.x] = 0;
    __syncthreads();
    for (int32_t i0 = 0; i0 < n; i0 += kThreads) {
      const int32_t i = i0 + static_cast<int32_t>(threadIdx.x);
      const uint64_t v = i < n ? c[i] : 0;
      const bool in = i < n && (v & high) == prefix;
      const uint32_t digit = in ? static_cast<uint32_t>(v >> shift) & 255u : 256u;
      const uint32_t peers = __match_any_sync(0xffffffffu, digit);
      if (in && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
    }
    __syncthreads();
    const uint32_t h = hist[threadIdx.x];
    uint32_t s = h;  // Σ hist[b] over b >= threadIdx.x, within the warp first
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t v = __shfl_down_sync(0xffffffffu, s, o);
      if (lane + o < 32) s += v;
    }
    if (lane == 0) sh.warp_sum[warp] = s;
    __syncthreads();
    for (int w = warp + 1; w < kWarps; ++w) s += sh.warp_sum[w];
    if (s - h < need && need <= s) {
      sh.digit = threadIdx.x;
      sh.above = s - h;
      sh.bin = h;
    }
    __syncthreads();
    need -= sh.above;
    prefix |= static_cast<uint64_t>(sh.digit) << shift;
    const bool done = sh.bin == need;
    __syncthreads();                // sh and hist are rewritten by the next pass
    if (done || shift == 0) break;  // distinct words: done by the last byte
    shift -= 8;
  }
  // Kept: the words above the chosen digits, and all of the last bin.
  const uint64_t mask = ~0ull << shift;
  if (threadIdx.x == 0) {
    sh.kept = 0;
    sh.smallest = ~0ull;
  }
  __syncthreads();
  for (int32_t i = threadIdx.x; i < n; i += kThreads) {
    const uint64_t v = c[i];
    if ((v & mask) >= prefix) {
      const int32_t at = atomicAdd(&sh.kept, 1);
      if (at < k) {  // always, for distinct words
        side[at] = v;
        atomicMin(&sh.smallest, static_cast<unsigned long long>(v));
      }
    }
  }
  __syncthreads();
  for (int32_t i = threadIdx.x; i < k; i += kThreads) c[i] = side[i];
  const uint64_t smallest = sh.smallest;
  if (threadIdx.x == 0) *count = k;
  __syncthreads();
  return smallest;
}

}  // namespace draftfeed::cuda::topk
