#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/target_outputs.cuh"
#include "kernels/target_outputs_kernel.cuh"

// One thread-block cluster per token: its N CTAs (1, 2, 4 or 8) stream
// contiguous ranges of the token's logits once, 256 ids per warp per step,
// and on the way
//   - keep each thread's best (value, lowest id) and its running max and
//     Σ exp (the log-softmax's denominator, online);
//   - copy every draft column they pass into its slot, held in the shared
//     memory of one of the cluster's CTAs (the slots of 65,536 fp32 columns
//     exceed one CTA's shared memory; N CTAs each hold 1/N, in groups of 32
//     columns so that the final write of a group is one 64-byte run). The
//     columns of a warp's 256 ids are found through the draft index (its
//     (id, column) pairs by id, and where each 256-id bucket starts), the
//     values read back from a per-warp staging copy;
//   - append every value above the CTA's top-k threshold to a candidate
//     buffer; when it nears full, the CTA selects its k best (a radix select
//     on (order key, ~id): ties to the lower id for free) and the k-th becomes
//     the threshold. Random-order logits refill it rarely (after the first
//     steps a new value beats the k-th of n seen with chance k/n).
// Then the cluster combines its partials through distributed shared memory:
// each CTA writes the probs of the columns it holds, rank 0 the argmax and
// the top-k (its candidates and the others', selected and ranked).

namespace draftfeed::cuda {
namespace {

namespace cg = cooperative_groups;
using topk::kThreads;
using topk::kWarps;

constexpr int kSeg = kTargetSeg;
constexpr int kPerLane = kSeg / 32;
constexpr int kStep = kWarps * kSeg;  // ids a CTA takes per step
constexpr int kMaxLogCluster = 3;
constexpr int kMaxCluster = 1 << kMaxLogCluster;
constexpr int kColGroup = 32;
// A CTA's draft slots at most: 65,536 columns over 8 CTAs. Keeping them this
// small leaves room for several CTAs per SM, which the stream needs to keep
// enough loads in flight.
constexpr int64_t kMaxSlotBytes = 32 << 10;
// A step appends at most kStep candidates; after a selection k remain, and
// the slack above that lets many steps pass before the next one.
constexpr int kCandCap = kTargetOutputsMaxTopK + kStep + 1024;
static_assert(kCandCap >= kMaxCluster * kTargetOutputsMaxTopK, "rank 0 merges every CTA's k");

struct Params {
  const float* logits;
  int64_t pitch;
  int32_t vocab;
  const int2* pairs;      // (id, column) by increasing id
  const int32_t* starts;  // [buckets + 1]: the first pair of each 256-id bucket
  int32_t num_draft;      // 0: no probs
  int32_t top_k;          // 0: no top-k
  bool sum_exp;           // the top-k's log-probs are asked
  TargetOutputOffsets off;
  uint8_t* out;
  int64_t row_pitch;
  int32_t range;  // ids per CTA, a multiple of kSeg
  int32_t steps;  // ceil(range / kStep)
  int32_t slots;  // draft slots per CTA, a multiple of kColGroup
  int32_t log_cluster;
};

// Dynamic shared memory: the 8-byte arrays first.
struct SmemLayout {
  int64_t cand = 0, side = 0, hist = 0, slots = 0, stage = 0, bytes = 0;
};

__host__ __device__ inline SmemLayout LayoutSmem(int32_t slots, bool draft, bool top) {
  SmemLayout l;
  int64_t at = 0;
  if (top) {
    l.cand = at;
    at += int64_t{kCandCap} * 8;
    l.side = at;
    at += int64_t{kTargetOutputsMaxTopK} * 8;
    l.hist = at;
    at += 256 * 4;
  }
  if (draft) {
    l.slots = at;
    at += int64_t{slots} * 4;
    l.stage = at;
    at += int64_t{kWarps} * kSeg * 4;
  }
  l.bytes = at;
  return l;
}

// What a CTA hands the cluster.
struct Partial {
  float best_v;
  int32_t best_i;
  float m, s;     // max and Σ exp(l - m) over the CTA's ids
  float dm, ds;   // the same over the draft columns it holds
  int32_t count;  // its top-k candidates (at most k)
};

struct Shared {
  Partial part;
  float* remote[kMaxCluster];  // every CTA's draft slots, as this CTA addresses them
  int32_t cand_count;
  float rv[kWarps];
  int32_t ri[kWarps];
  float rm[kWarps], rs[kWarps];
  topk::Scratch sel;
  // The cluster's totals, and where rank r's candidates go in rank 0's buffer.
  float best_v, M, logS, md, Sd;
  int32_t best_i, total;
  int32_t cand_off[kMaxCluster];
};

__device__ __forceinline__ bool Better(float v, int32_t i, float bv, int32_t bi) {
  return v > bv || (v == bv && i < bi);
}

// (m, s) += (om, os): two partial log-sum-exps.
__device__ __forceinline__ void Combine(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  if (nm == -INFINITY) return;
  s = s * expf(m - nm) + os * expf(om - nm);
  m = nm;
}

// Id offset within a warp's 256 of register q of `lane`. Aligned rows load
// float4s (lane l holds ids 4l..4l+3 of each 128); others lane-strided floats.
template <bool kVec4>
__device__ __forceinline__ int32_t Offset(int q, int lane) {
  if constexpr (kVec4) {
    return (q >> 2) * 128 + lane * 4 + (q & 3);
  } else {
    return q * 32 + lane;
  }
}

// -inf past `end`: it never wins, adds 0 to a sum, and is never a candidate
// (which tests the id).
template <bool kVec4>
__device__ __forceinline__ void Load(const float* row, int32_t seg, int32_t end, int lane,
                                     float (&x)[kPerLane]) {
  if constexpr (kVec4) {
#pragma unroll
    for (int u = 0; u < kPerLane / 4; ++u) {
      const int32_t i = seg + u * 128 + lane * 4;
      if (i + 4 <= end) {
        const float4 v = __ldcs(reinterpret_cast<const float4*>(row + i));
        x[4 * u] = v.x;
        x[4 * u + 1] = v.y;
        x[4 * u + 2] = v.z;
        x[4 * u + 3] = v.w;
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) x[4 * u + c] = i + c < end ? __ldcs(row + i + c) : -INFINITY;
      }
    }
  } else {
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      const int32_t i = seg + q * 32 + lane;
      x[q] = i < end ? __ldcs(row + i) : -INFINITY;
    }
  }
}

template <bool kVec4>
__device__ __forceinline__ void StageValues(float* st, int lane, const float (&x)[kPerLane]) {
  if constexpr (kVec4) {
#pragma unroll
    for (int u = 0; u < kPerLane / 4; ++u) {
      *reinterpret_cast<float4*>(st + u * 128 + lane * 4) =
          make_float4(x[4 * u], x[4 * u + 1], x[4 * u + 2], x[4 * u + 3]);
    }
  } else {
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) st[q * 32 + lane] = x[q];
  }
}

// Appends the warp's values above `tau` to the candidates; returns the
// buffer's end after this warp's append (0 when it appended none).
template <bool kVec4>
__device__ __forceinline__ int32_t AppendCandidates(const float (&x)[kPerLane], int32_t seg,
                                                    int32_t end, int lane, uint64_t tau,
                                                    uint64_t* cand, int32_t* count) {
  uint32_t mine = 0;
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) {
    const int32_t id = seg + Offset<kVec4>(q, lane);
    if (id < end && topk::Composite(x[q], id) > tau) mine |= 1u << q;
  }
  if (!__any_sync(0xffffffffu, mine != 0)) return 0;
  const int32_t n = __popc(mine);
  int32_t incl = n;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  const int32_t total = __shfl_sync(0xffffffffu, incl, 31);
  int32_t base = 0;
  if (lane == 0) base = atomicAdd(count, total);
  base = __shfl_sync(0xffffffffu, base, 0);
  int32_t at = base + incl - n;
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) {
    if ((mine >> q) & 1u) cand[at++] = topk::Composite(x[q], seg + Offset<kVec4>(q, lane));
  }
  return base + total;
}

// The column of a CTA's slot, and the slot of a column (owner CTA, index):
// groups of 32 columns dealt round-robin over the cluster.
__device__ __forceinline__ int32_t ColumnOf(int32_t idx, int rank, int log_cluster) {
  return ((((idx >> 5) << log_cluster) | rank) << 5) | (idx & 31);
}

__device__ __forceinline__ void StoreU32(uint8_t* p, uint32_t v) {
  if ((reinterpret_cast<uintptr_t>(p) & 3) == 0) {
    *reinterpret_cast<uint32_t*>(p) = v;
  } else {
#pragma unroll
    for (int b = 0; b < 4; ++b) p[b] = static_cast<uint8_t>(v >> (8 * b));
  }
}

__device__ __forceinline__ void StoreU16(uint8_t* p, uint16_t v) {
  if ((reinterpret_cast<uintptr_t>(p) & 1) == 0) {
    *reinterpret_cast<uint16_t*>(p) = v;
  } else {
    p[0] = static_cast<uint8_t>(v);
    p[1] = static_cast<uint8_t>(v >> 8);
  }
}

__device__ float BlockMax(float v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) sh.rv[threadIdx.x >> 5] = v;
  __syncthreads();
  v = sh.rv[0];
  for (int w = 1; w < kWarps; ++w) v = fmaxf(v, sh.rv[w]);
  __syncthreads();
  return v;
}

__device__ float BlockSum(float v, Shared& sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) sh.rv[threadIdx.x >> 5] = v;
  __syncthreads();
  v = 0.0f;
  for (int w = 0; w < kWarps; ++w) v += sh.rv[w];
  __syncthreads();
  return v;
}

template <bool kVec4>
__global__ void __launch_bounds__(kThreads) TargetOutputsKernel(const Params p) {
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int cluster_size = 1 << p.log_cluster;
  const int64_t t = blockIdx.x >> p.log_cluster;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool draft = p.num_draft > 0, top = p.top_k > 0;

  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ Shared sh;
  const SmemLayout lay = LayoutSmem(p.slots, draft, top);
  uint64_t* cand = reinterpret_cast<uint64_t*>(smem + lay.cand);
  uint64_t* side = reinterpret_cast<uint64_t*>(smem + lay.side);
  uint32_t* hist = reinterpret_cast<uint32_t*>(smem + lay.hist);
  float* slots = reinterpret_cast<float*>(smem + lay.slots);
  float* stage = reinterpret_cast<float*>(smem + lay.stage) + warp * kSeg;
  if (draft && threadIdx.x < cluster_size)
    sh.remote[threadIdx.x] = cluster.map_shared_rank(slots, threadIdx.x);
  if (threadIdx.x == 0) sh.cand_count = 0;
  // Every CTA of the cluster has started before any writes another's slots.
  cluster.sync();

  const float* row = p.logits + t * p.pitch;
  const int32_t begin = rank * p.range;
  const int32_t end = min(p.vocab, begin + p.range);
  float best_v = -INFINITY;
  int32_t best_i = INT_MAX;
  float m = -INFINITY, s = 0.0f;
  uint64_t tau = 0;  // below every candidate until the first selection
  float x[kPerLane], next[kPerLane];
  int32_t seg = begin + warp * kSeg;
  Load<kVec4>(row, seg, end, lane, x);
  for (int32_t step = 0; step < p.steps; ++step, seg += kStep) {
    if (step + 1 < p.steps) Load<kVec4>(row, seg + kStep, end, lane, next);
    // Ids rise with q and with the step: a strict > keeps a thread's lowest.
    float mx = x[0];
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) {
      if (x[q] > best_v) {
        best_v = x[q];
        best_i = seg + Offset<kVec4>(q, lane);
      }
      mx = fmaxf(mx, x[q]);
    }
    if (p.sum_exp) {
      const float nm = fmaxf(m, mx);
      if (nm != -INFINITY) {
        // The rescale in full precision: it compounds over the steps.
        float a = s * expf(m - nm);
#pragma unroll
        for (int q = 0; q < kPerLane; ++q) a += __expf(x[q] - nm);
        s = a;
        m = nm;
      }
    }
    if (draft && seg < end) {
      const int32_t bucket = seg / kSeg;
      const int32_t lo = __ldg(p.starts + bucket), hi = __ldg(p.starts + bucket + 1);
      if (hi > lo) {
        StageValues<kVec4>(stage, lane, x);
        __syncwarp();
        for (int32_t i = lo + lane; i < hi; i += 32) {
          const int2 e = __ldg(p.pairs + i);
          const int32_t g = e.y >> 5;
          sh.remote[g & (cluster_size - 1)][((g >> p.log_cluster) << 5) | (e.y & 31)] =
              stage[e.x - seg];
        }
        __syncwarp();
      }
    }
    if (top) {
      const int32_t filled = AppendCandidates<kVec4>(x, seg, end, lane, tau, cand, &sh.cand_count);
      if (__syncthreads_or(filled > kCandCap - kStep)) {
        tau = topk::SelectTopK(cand, sh.cand_count, p.top_k, side, hist, sh.sel, &sh.cand_count);
      }
    }
#pragma unroll
    for (int q = 0; q < kPerLane; ++q) x[q] = next[q];
  }
  if (top) {
    __syncthreads();
    const int32_t n = sh.cand_count;
    if (n > p.top_k) topk::SelectTopK(cand, n, p.top_k, side, hist, sh.sel, &sh.cand_count);
  }

  // The CTA's partials.
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
    const int32_t oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (Better(ov, oi, best_v, best_i)) {
      best_v = ov;
      best_i = oi;
    }
    if (p.sum_exp) {
      const float om = __shfl_xor_sync(0xffffffffu, m, o);
      const float os = __shfl_xor_sync(0xffffffffu, s, o);
      Combine(m, s, om, os);
    }
  }
  if (lane == 0) {
    sh.rv[warp] = best_v;
    sh.ri[warp] = best_i;
    sh.rm[warp] = m;
    sh.rs[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      if (Better(sh.rv[w], sh.ri[w], best_v, best_i)) {
        best_v = sh.rv[w];
        best_i = sh.ri[w];
      }
      Combine(m, s, sh.rm[w], sh.rs[w]);
    }
    sh.part.best_v = best_v;
    sh.part.best_i = best_i;
    sh.part.m = m;
    sh.part.s = s;
    sh.part.count = top ? sh.cand_count : 0;
  }
  __syncthreads();
  // Every slot is written (by whichever CTA passed its id), every partial
  // and candidate set final.
  cluster.sync();

  if (draft) {
    float dm = -INFINITY;
    for (int32_t i = threadIdx.x; i < p.slots; i += kThreads) {
      if (ColumnOf(i, rank, p.log_cluster) < p.num_draft) dm = fmaxf(dm, slots[i]);
    }
    dm = BlockMax(dm, sh);
    float ds = 0.0f;
    if (dm != -INFINITY) {
      for (int32_t i = threadIdx.x; i < p.slots; i += kThreads) {
        if (ColumnOf(i, rank, p.log_cluster) < p.num_draft) ds += expf(slots[i] - dm);
      }
    }
    ds = BlockSum(ds, sh);
    if (threadIdx.x == 0) {
      sh.part.dm = dm;
      sh.part.ds = ds;
    }
  } else if (threadIdx.x == 0) {
    sh.part.dm = -INFINITY;
    sh.part.ds = 0.0f;
  }
  cluster.sync();
  if (threadIdx.x == 0) {
    float bv = -INFINITY, M = -INFINITY, S = 0.0f, md = -INFINITY, Sd = 0.0f;
    int32_t bi = INT_MAX, total = 0;
    for (int r = 0; r < cluster_size; ++r) {
      const Partial* q = cluster.map_shared_rank(&sh.part, r);
      if (Better(q->best_v, q->best_i, bv, bi)) {
        bv = q->best_v;
        bi = q->best_i;
      }
      Combine(M, S, q->m, q->s);
      Combine(md, Sd, q->dm, q->ds);
      sh.cand_off[r] = total;
      total += q->count;
    }
    sh.best_v = bv;
    sh.best_i = bi;
    sh.M = M;
    sh.logS = logf(S);
    sh.md = md;
    sh.Sd = Sd;
    sh.total = total;
  }
  __syncthreads();
  if (top && rank == 0) {
    for (int r = 1; r < cluster_size; ++r) {
      const uint64_t* src = cluster.map_shared_rank(cand, r);
      const int32_t count = (r + 1 < cluster_size ? sh.cand_off[r + 1] : sh.total) - sh.cand_off[r];
      for (int32_t i = threadIdx.x; i < count; i += kThreads) cand[sh.cand_off[r] + i] = src[i];
    }
  }
  // No CTA reads another's shared memory past this point.
  cluster.sync();

  uint8_t* out = p.out + t * p.row_pitch;
  if (draft) {
    const float md = sh.md, Sd = sh.Sd;
    if (p.off.probs_fp8) {
      // The largest p is the one at md: exp(0) / Sd.
      const float q = __fdiv_rn(__fdiv_rn(1.0f, Sd), 448.0f);
      const float scale = q > 0.0f ? q : 1.0f;
      if (rank == 0 && threadIdx.x == 0) StoreU32(out + p.off.probs_scale, __float_as_uint(scale));
      for (int32_t i = threadIdx.x; i < p.slots; i += kThreads) {
        const int32_t col = ColumnOf(i, rank, p.log_cluster);
        if (col >= p.num_draft) continue;
        const float pj = __fdiv_rn(expf(slots[i] - md), Sd);
        out[p.off.probs + col] = static_cast<uint8_t>(
            __nv_cvt_float_to_fp8(__fdiv_rn(pj, scale), __NV_SATFINITE, __NV_E4M3));
      }
    } else {
      for (int32_t i = threadIdx.x; i < p.slots; i += kThreads) {
        const int32_t col = ColumnOf(i, rank, p.log_cluster);
        if (col >= p.num_draft) continue;
        const float pj = __fdiv_rn(expf(slots[i] - md), Sd);
        StoreU16(out + p.off.probs + 2 * int64_t{col},
                 __bfloat16_as_ushort(__float2bfloat16_rn(pj)));
      }
    }
  }
  if (rank != 0) return;
  if (p.off.argmax >= 0 && threadIdx.x == 0) {
    // INT_MAX: no value beat -inf (a row of -inf or NaN); the reference says 0.
    StoreU32(out + p.off.argmax, static_cast<uint32_t>(sh.best_i == INT_MAX ? 0 : sh.best_i));
  }
  if (!top) return;
  const int32_t k = p.top_k;
  if (sh.total > k) topk::SelectTopK(cand, sh.total, k, side, hist, sh.sel, &sh.cand_count);
  if (threadIdx.x < k) {
    // The k are distinct: a value's rank is how many beat it.
    const uint64_t c = cand[threadIdx.x];
    int32_t r = 0;
    for (int32_t j = 0; j < k; ++j) r += cand[j] > c;
    if (p.off.top_k_ids >= 0) StoreU32(out + p.off.top_k_ids + 4 * r, topk::IdOf(c));
    if (p.off.top_k_logprobs >= 0) {
      const float lp = (topk::ValueOf(c) - sh.M) - sh.logS;
      StoreU32(out + p.off.top_k_logprobs + 4 * r, __float_as_uint(lp));
    }
  }
}

}  // namespace

cudaError_t TargetOutputsFromLogits(const float* logits, int64_t tokens, int64_t vocab,
                                    int64_t logits_pitch, const void* draft_index,
                                    int64_t num_draft, int32_t top_k,
                                    const TargetOutputOffsets& offsets, uint8_t* out,
                                    int64_t row_pitch, cudaStream_t stream) {
  if (tokens < 0 || vocab < 1 || vocab > (int64_t{1} << 30) || logits_pitch < vocab || top_k < 0 ||
      top_k > std::min<int64_t>(kTargetOutputsMaxTopK, vocab) || num_draft < 0 ||
      num_draft > std::min(kTargetOutputsMaxDraft, vocab) || row_pitch < 0) {
    return cudaErrorInvalidValue;
  }
  const bool top = top_k > 0 && (offsets.top_k_ids >= 0 || offsets.top_k_logprobs >= 0);
  const bool draft = num_draft > 0 && offsets.probs >= 0;
  if (draft && (draft_index == nullptr || (offsets.probs_fp8 && offsets.probs_scale < 0))) {
    return cudaErrorInvalidValue;
  }
  if (tokens == 0 || (!top && !draft && offsets.argmax < 0)) return cudaSuccess;
  if (logits == nullptr || out == nullptr) return cudaErrorInvalidValue;

  // The smallest cluster whose CTAs hold the draft slots. Its width sets
  // how each token's vocabulary is split over CTAs, and so the order of the
  // log-sum-exp and draft sums: it follows the draft vocabulary only, never
  // the token count, so a token's outputs are the same bits in any batch
  // (widening it for batches too small to fill the GPU, as this once did,
  // changed a short sequence's probabilities with its neighbours).
  const int64_t groups = draft ? (num_draft + kColGroup - 1) / kColGroup : 0;
  auto slots_for = [&](int log_n) { return ((groups + (1 << log_n) - 1) >> log_n) * kColGroup; };
  int log_n = 0;
  while (log_n < kMaxLogCluster && slots_for(log_n) * 4 > kMaxSlotBytes) ++log_n;
  const int64_t n = int64_t{1} << log_n;
  if (tokens * n > INT_MAX) return cudaErrorInvalidValue;

  Params p;
  p.logits = logits;
  p.pitch = logits_pitch;
  p.vocab = static_cast<int32_t>(vocab);
  const DraftIndexLayout il = DraftIndexLayoutOf(vocab, num_draft);
  const char* index = static_cast<const char*>(draft_index);
  p.pairs = draft ? reinterpret_cast<const int2*>(index) : nullptr;
  p.starts = draft ? reinterpret_cast<const int32_t*>(index + il.starts) : nullptr;
  p.num_draft = draft ? static_cast<int32_t>(num_draft) : 0;
  p.top_k = top ? top_k : 0;
  p.sum_exp = top && offsets.top_k_logprobs >= 0;
  p.off = offsets;
  p.out = out;
  p.row_pitch = row_pitch;
  const int64_t per_cta = (vocab + n - 1) / n;
  p.range = static_cast<int32_t>((per_cta + kSeg - 1) / kSeg * kSeg);
  p.steps = (p.range + kStep - 1) / kStep;
  p.slots = static_cast<int32_t>(draft ? slots_for(log_n) : 0);
  p.log_cluster = log_n;

  const bool vec4 = reinterpret_cast<uintptr_t>(logits) % 16 == 0 && logits_pitch % 4 == 0;
  void (*kernel)(Params) = vec4 ? TargetOutputsKernel<true> : TargetOutputsKernel<false>;
  const SmemLayout lay = LayoutSmem(p.slots, draft, p.top_k > 0);
  const size_t smem = static_cast<size_t>(std::max<int64_t>(lay.bytes, 16));
  if (cudaError_t e =
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      e != cudaSuccess) {
    return e;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(tokens * n));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(n);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  if (cudaError_t e = cudaLaunchKernelEx(&config, kernel, p); e != cudaSuccess) return e;
  return cudaGetLastError();
}

}  // namespace draftfeed::cuda
