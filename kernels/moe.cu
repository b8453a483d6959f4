// The memory-bound half of the MoE family: routing, the permutation by
// expert and the weighted combine. The grouped GEMMs are in moe_gemm.cu.
#include <algorithm>
#include <cmath>

#include "kernels/moe.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

using vec::kVec;

constexpr int kWarp = 32;
constexpr int kTopKThreads = 256;  // 8 tokens per block, one per warp
constexpr int kCountThreads = 256;
constexpr int kCountPerThread = 16;  // pairs each thread of the count kernel ranks
constexpr int kScanThreads = kMoeMaxExperts;
constexpr int kScatterThreads = 256;

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(bf16 v) { return __bfloat162float(v); }

// One warp per token; lane l holds experts l, l + 32, ... (kPerLane of them,
// E <= 32·kPerLane). The softmax is the CPU reference's: p = e^(l − max) / Σ.
// Top-k is k rounds of a warp arg-max on p whose order is (p descending, id
// ascending), so exact ties go to the lower id; the selection is broadcast
// from lane 0 so every lane agrees even on NaN logits, and every id chosen
// lies in [0, E).
template <int kPerLane, typename Logit>
__global__ void __launch_bounds__(kTopKThreads)
    TopKKernel(const Logit* logits, int64_t stride, int64_t num_tokens, int num_experts, int top_k,
               bool renormalize, int32_t* expert_ids, float* weights) {
  const int lane = threadIdx.x % kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (kTopKThreads / kWarp) + threadIdx.x / kWarp;
  if (t >= num_tokens) return;
  const Logit* row = logits + t * stride;
  float p[kPerLane];
  float max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarp + lane;
    p[i] = e < num_experts ? ToFloat(row[e]) : -INFINITY;
    max = fmaxf(max, p[i]);
  }
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) max = fmaxf(max, __shfl_xor_sync(~0u, max, off));
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    p[i] = i * kWarp + lane < num_experts ? expf(p[i] - max) : 0.0f;
    sum += p[i];
  }
#pragma unroll
  for (int off = kWarp / 2; off > 0; off /= 2) sum += __shfl_xor_sync(~0u, sum, off);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) p[i] /= sum;

  uint32_t taken = 0;  // bit i: expert i·32 + lane is chosen
  float kept = 0.0f;
  int32_t my_id = 0;
  float my_p = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    float best = 0.0f;
    int32_t best_id = -1;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = i * kWarp + lane;
      if (e < num_experts && !(taken >> i & 1u) && (best_id < 0 || p[i] > best)) {
        best = p[i];
        best_id = e;
      }
    }
#pragma unroll
    for (int off = kWarp / 2; off > 0; off /= 2) {
      const float other = __shfl_xor_sync(~0u, best, off);
      const int32_t other_id = __shfl_xor_sync(~0u, best_id, off);
      if (other_id >= 0 && (best_id < 0 || other > best || (other == best && other_id < best_id))) {
        best = other;
        best_id = other_id;
      }
    }
    best = __shfl_sync(~0u, best, 0);
    best_id = __shfl_sync(~0u, best_id, 0);
    if (best_id % kWarp == lane) taken |= 1u << (best_id / kWarp);
    if (lane == j) {
      my_id = best_id;
      my_p = best;
    }
    kept += best;  // in slot order, as the reference sums
  }
  if (lane < top_k) {
    expert_ids[t * top_k + lane] = my_id;
    weights[t * top_k + lane] = renormalize ? my_p / kept : my_p;
  }
}

template <typename Logit>
cudaError_t LaunchTopK(const Logit* logits, int64_t stride, int64_t num_tokens, int num_experts,
                       int top_k, bool renormalize, int32_t* expert_ids, float* weights,
                       cudaStream_t stream) {
  if (num_tokens < 0 || num_experts < 1 || num_experts > kMoeMaxExperts || top_k < 1 ||
      top_k > kMoeMaxTopK || top_k > num_experts || stride < num_experts) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;
  constexpr int kTokensPerBlock = kTopKThreads / kWarp;
  const int64_t blocks = (num_tokens + kTokensPerBlock - 1) / kTokensPerBlock;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  const int per_lane = (num_experts + kWarp - 1) / kWarp;
  auto launch = [&](auto kernel) {
    kernel<<<grid, kTopKThreads, 0, stream>>>(logits, stride, num_tokens, num_experts, top_k,
                                              renormalize, expert_ids, weights);
    return cudaGetLastError();
  };
  if (per_lane <= 1) return launch(TopKKernel<1, Logit>);
  if (per_lane <= 2) return launch(TopKKernel<2, Logit>);
  if (per_lane <= 4) return launch(TopKKernel<4, Logit>);
  if (per_lane <= 8) return launch(TopKKernel<8, Logit>);
  return launch(TopKKernel<16, Logit>);
}

// Each pair's rank among its expert's rows: ranks within the block from a
// shared-memory histogram, then one global atomic per (block, expert) claims
// the block's range, so a hot expert costs one atomic per block, not per
// pair. rank[p] = -1 for an id outside [0, E).
__global__ void __launch_bounds__(kCountThreads)
    CountKernel(const int32_t* expert_ids, int64_t pairs, int num_experts, int32_t* counts,
                int32_t* rank) {
  __shared__ int32_t hist[kMoeMaxExperts];
  for (int e = threadIdx.x; e < num_experts; e += kCountThreads) hist[e] = 0;
  __syncthreads();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kCountThreads * kCountPerThread;
  int32_t local[kCountPerThread];
  int32_t ids[kCountPerThread];
#pragma unroll
  for (int i = 0; i < kCountPerThread; ++i) {
    const int64_t p = base + static_cast<int64_t>(i) * kCountThreads + threadIdx.x;
    ids[i] = p < pairs ? expert_ids[p] : -1;
    if (ids[i] >= num_experts) ids[i] = -1;
    local[i] = ids[i] >= 0 ? atomicAdd(&hist[ids[i]], 1) : -1;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += kCountThreads) {
    if (hist[e] > 0) hist[e] = atomicAdd(&counts[e], hist[e]);  // now the block's first rank
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kCountPerThread; ++i) {
    const int64_t p = base + static_cast<int64_t>(i) * kCountThreads + threadIdx.x;
    if (p < pairs) rank[p] = ids[i] >= 0 ? hist[ids[i]] + local[i] : -1;
  }
}

// Inclusive scan of one int per thread over a block of kScanThreads.
__device__ int32_t BlockInclusiveScan(int32_t v, int32_t* warp_sums) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int off = 1; off < kWarp; off *= 2) {
    const int32_t up = __shfl_up_sync(~0u, v, off);
    if (lane >= off) v += up;
  }
  if (lane == kWarp - 1) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int32_t w = lane < kScanThreads / kWarp ? warp_sums[lane] : 0;
#pragma unroll
    for (int off = 1; off < kWarp; off *= 2) {
      const int32_t up = __shfl_up_sync(~0u, w, off);
      if (lane >= off) w += up;
    }
    if (lane < kScanThreads / kWarp) warp_sums[lane] = w;
  }
  __syncthreads();
  return warp > 0 ? v + warp_sums[warp - 1] : v;
}

// offsets and tile_offsets: exclusive scans of the counts and of each
// expert's tile count, in one block (E <= kScanThreads).
__global__ void __launch_bounds__(kScanThreads)
    ScanKernel(const int32_t* counts, int num_experts, int32_t* offsets, int32_t* tile_offsets) {
  __shared__ int32_t rows_sums[kScanThreads / kWarp], tile_sums[kScanThreads / kWarp];
  const int e = threadIdx.x;
  const int32_t c = e < num_experts ? counts[e] : 0;
  const int32_t rows = BlockInclusiveScan(c, rows_sums);
  const int32_t tiles = BlockInclusiveScan((c + kMoeTileRows - 1) / kMoeTileRows, tile_sums);
  if (e < num_experts) {
    offsets[e + 1] = rows;
    tile_offsets[e + 1] = tiles;
  }
  if (e == 0) {
    offsets[0] = 0;
    tile_offsets[0] = 0;
  }
}

// Pair p's rank becomes its row, and the row learns its token; the first
// `tiles` threads also write the tile map (each tile's expert by binary
// search over tile_offsets, its row range), which the GEMM blocks read in
// one load.
__global__ void __launch_bounds__(kScatterThreads)
    ScatterKernel(const int32_t* expert_ids, int64_t pairs, int top_k, int num_experts,
                  const int32_t* offsets, const int32_t* tile_offsets, int64_t tiles,
                  int32_t* pair_row, int32_t* row_token, int4* tile_map) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kScatterThreads + threadIdx.x;
  if (i < pairs) {
    const int32_t r = pair_row[i];  // the rank CountKernel left
    if (r >= 0) {
      const int32_t row = offsets[expert_ids[i]] + r;
      pair_row[i] = row;
      row_token[row] = static_cast<int32_t>(i / top_k);
    }
  }
  if (i < tiles) {
    const int32_t tile = static_cast<int32_t>(i);
    int4 entry = make_int4(-1, 0, 0, 0);
    if (tile < tile_offsets[num_experts]) {
      int lo = 0, hi = num_experts;  // tile_offsets[lo] <= tile < tile_offsets[hi]
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (tile_offsets[mid] <= tile) {
          lo = mid;
        } else {
          hi = mid;
        }
      }
      const int32_t first = offsets[lo] + (tile - tile_offsets[lo]) * kMoeTileRows;
      entry = make_int4(lo, first, min(first + kMoeTileRows, offsets[lo + 1]), 0);
    }
    tile_map[i] = entry;
  }
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The MoE output of token t over 8 (vector) or 1 (scalar) columns, summed in
// slot order in fp32, then added to the residual.
struct CombineArgs {
  const bf16* y;
  const int32_t* pair_row;
  const float* weights;
  int top_k;
  int64_t hidden;
  const bf16* shared;
  int64_t shared_stride;
  const bf16* gate;
  int64_t gate_stride;
  float* residual;
};

struct CombineVec {
  CombineArgs a;
  __device__ void operator()(int64_t t, int64_t c) const {
    float out[kVec] = {};
    for (int j = 0; j < a.top_k; ++j) {
      const int32_t row = a.pair_row[t * a.top_k + j];
      if (row < 0) continue;
      const float w = a.weights[t * a.top_k + j];
      float v[kVec];
      vec::LoadBf16x8(a.y + static_cast<int64_t>(row) * a.hidden + c * kVec, v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) out[i] += w * v[i];
    }
    if (a.shared != nullptr) {
      const float g = Sigmoid(__bfloat162float(a.gate[t * a.gate_stride]));
      float s[kVec];
      vec::LoadBf16x8(a.shared + t * a.shared_stride + c * kVec, s);
#pragma unroll
      for (int i = 0; i < kVec; ++i) out[i] += g * s[i];
    }
    float* r = a.residual + t * a.hidden + c * kVec;
    float h[kVec];
    vec::LoadF32x8(r, h);
#pragma unroll
    for (int i = 0; i < kVec; ++i) h[i] += out[i];
    vec::StoreF32x8(r, h);
  }
};

struct CombineScalar {
  CombineArgs a;
  __device__ void operator()(int64_t t, int64_t c) const {
    float out = 0.0f;
    for (int j = 0; j < a.top_k; ++j) {
      const int32_t row = a.pair_row[t * a.top_k + j];
      if (row < 0) continue;
      out += a.weights[t * a.top_k + j] *
             __bfloat162float(a.y[static_cast<int64_t>(row) * a.hidden + c]);
    }
    if (a.shared != nullptr) {
      out += Sigmoid(__bfloat162float(a.gate[t * a.gate_stride])) *
             __bfloat162float(a.shared[t * a.shared_stride + c]);
    }
    a.residual[t * a.hidden + c] += out;
  }
};

size_t Round256(size_t bytes) { return (std::max<size_t>(bytes, 1) + 255) & ~size_t{255}; }

}  // namespace

cudaError_t MoeTopK(const bf16* logits, int64_t logits_stride, int64_t num_tokens, int num_experts,
                    int top_k, bool renormalize, int32_t* expert_ids, float* weights,
                    cudaStream_t stream) {
  return LaunchTopK(logits, logits_stride, num_tokens, num_experts, top_k, renormalize, expert_ids,
                    weights, stream);
}

cudaError_t MoeTopK(const float* logits, int64_t logits_stride, int64_t num_tokens, int num_experts,
                    int top_k, bool renormalize, int32_t* expert_ids, float* weights,
                    cudaStream_t stream) {
  return LaunchTopK(logits, logits_stride, num_tokens, num_experts, top_k, renormalize, expert_ids,
                    weights, stream);
}

int64_t MoeMaxTiles(int64_t rows, int64_t num_experts) {
  // Σ ⌈r_e / B⌉ <= Σ (r_e / B + 1) over the experts with r_e > 0, of which
  // there are at most min(E, rows); the sum of r_e / B is at most ⌊rows / B⌋
  // plus fractions already counted by the +1s.
  return rows / kMoeTileRows + std::min(num_experts, rows);
}

size_t MoeWorkspaceBytes(int64_t max_tokens, int num_experts, int top_k, int64_t hidden,
                         int64_t inter) {
  const size_t pairs = static_cast<size_t>(std::max<int64_t>(max_tokens, 0) * top_k);
  const size_t experts = static_cast<size_t>(num_experts);
  const size_t tiles = static_cast<size_t>(MoeMaxTiles(static_cast<int64_t>(pairs), num_experts));
  return Round256(pairs * 4)                                   // expert_ids
         + Round256(pairs * 4)                                 // weights
         + Round256(experts * 4)                               // counts
         + 2 * Round256((experts + 1) * 4)                     // offsets, tile_offsets
         + Round256(tiles * sizeof(int4))                      // tile_map
         + 2 * Round256(pairs * 4)                             // pair_row, row_token
         + Round256(pairs * static_cast<size_t>(inter) * 2)    // act
         + Round256(pairs * static_cast<size_t>(hidden) * 2);  // y
}

MoeBuffers CarveMoeWorkspace(void* base, int64_t max_tokens, int num_experts, int top_k,
                             int64_t hidden, int64_t inter) {
  const size_t pairs = static_cast<size_t>(std::max<int64_t>(max_tokens, 0) * top_k);
  const size_t experts = static_cast<size_t>(num_experts);
  const int64_t tiles = MoeMaxTiles(static_cast<int64_t>(pairs), num_experts);
  char* p = static_cast<char*>(base);
  auto take = [&](size_t bytes) {
    char* out = p;
    p += Round256(bytes);
    return out;
  };
  MoeBuffers b;
  b.expert_ids = reinterpret_cast<int32_t*>(take(pairs * 4));
  b.weights = reinterpret_cast<float*>(take(pairs * 4));
  b.routing.counts = reinterpret_cast<int32_t*>(take(experts * 4));
  b.routing.offsets = reinterpret_cast<int32_t*>(take((experts + 1) * 4));
  b.routing.tile_offsets = reinterpret_cast<int32_t*>(take((experts + 1) * 4));
  b.routing.tile_map = reinterpret_cast<int32_t*>(take(static_cast<size_t>(tiles) * sizeof(int4)));
  b.routing.pair_row = reinterpret_cast<int32_t*>(take(pairs * 4));
  b.routing.row_token = reinterpret_cast<int32_t*>(take(pairs * 4));
  b.routing.max_tiles = tiles;
  b.act = reinterpret_cast<bf16*>(take(pairs * static_cast<size_t>(inter) * 2));
  b.y = reinterpret_cast<bf16*>(take(pairs * static_cast<size_t>(hidden) * 2));
  return b;
}

cudaError_t MoePermute(const int32_t* expert_ids, int64_t num_tokens, int num_experts, int top_k,
                       const MoeRouting& routing, cudaStream_t stream) {
  if (num_tokens < 0 || num_experts < 1 || num_experts > kMoeMaxExperts || top_k < 1 ||
      top_k > kMoeMaxTopK) {
    return cudaErrorInvalidValue;
  }
  const int64_t pairs = num_tokens * top_k;
  const int64_t tiles = MoeMaxTiles(pairs, num_experts);
  if (pairs > INT32_MAX || tiles > routing.max_tiles) return cudaErrorInvalidValue;
  cudaError_t err =
      cudaMemsetAsync(routing.counts, 0, static_cast<size_t>(num_experts) * 4, stream);
  if (err != cudaSuccess) return err;
  if (pairs > 0) {
    constexpr int64_t kPerBlock = int64_t{kCountThreads} * kCountPerThread;
    const int64_t blocks = (pairs + kPerBlock - 1) / kPerBlock;
    CountKernel<<<static_cast<unsigned>(blocks), kCountThreads, 0, stream>>>(
        expert_ids, pairs, num_experts, routing.counts, routing.pair_row);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  ScanKernel<<<1, kScanThreads, 0, stream>>>(routing.counts, num_experts, routing.offsets,
                                             routing.tile_offsets);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const int64_t n = std::max(pairs, tiles);
  if (n == 0) return cudaSuccess;
  const int64_t blocks = (n + kScatterThreads - 1) / kScatterThreads;
  ScatterKernel<<<static_cast<unsigned>(blocks), kScatterThreads, 0, stream>>>(
      expert_ids, pairs, top_k, num_experts, routing.offsets, routing.tile_offsets, tiles,
      routing.pair_row, routing.row_token, reinterpret_cast<int4*>(routing.tile_map));
  return cudaGetLastError();
}

namespace {
__global__ void KeepLocalExpertsKernel(int32_t* ids, int64_t n, int begin, int count) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const int32_t local = ids[i] - begin;
  ids[i] = local >= 0 && local < count ? local : -1;
}
}  // namespace

cudaError_t MoeKeepLocalExperts(int32_t* expert_ids, int64_t n, int begin, int count,
                                cudaStream_t stream) {
  if (n < 0 || begin < 0 || count < 1) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  KeepLocalExpertsKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(expert_ids, n,
                                                                                     begin, count);
  return cudaGetLastError();
}

cudaError_t MoeCombine(const bf16* y, const int32_t* pair_row, const float* weights,
                       int64_t num_tokens, int top_k, int64_t hidden, const bf16* shared,
                       int64_t shared_stride, const bf16* shared_gate, int64_t gate_stride,
                       float* residual, cudaStream_t stream) {
  if (num_tokens < 0 || hidden < 0 || top_k < 1 || top_k > kMoeMaxTopK ||
      (shared == nullptr) != (shared_gate == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const CombineArgs a{y,      pair_row,      weights,     top_k,       hidden,
                      shared, shared_stride, shared_gate, gate_stride, residual};
  const bool vector = hidden % kVec == 0 && vec::Aligned16(y) && vec::Aligned16(residual) &&
                      (shared == nullptr || (shared_stride % kVec == 0 && vec::Aligned16(shared)));
  if (vector) return vec::LaunchRows(CombineVec{a}, num_tokens, hidden / kVec, stream);
  return vec::LaunchRows(CombineScalar{a}, num_tokens, hidden, stream);
}

}  // namespace draftfeed::cuda
