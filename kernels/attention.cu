// Varlen causal GQA attention, flash-attention schedule on tensor cores.
//
// One block = one (query tile, query head, sequence). Compute warps own 16
// query rows each; a loader warp brings Q once, then K and V tiles of BN keys
// into two stages each, by TMA, in the 128-byte-swizzled layout that wgmma
// descriptors and ldmatrix both read without bank conflicts. mbarriers tell
// the compute warps that a stage is full and the loader that every compute
// thread is done with it. Per KV tile up to the diagonal: S = Q·Kᵀ, an online
// softmax in fp32 (log2 domain), P rounded to bf16, O += P·V in fp32
// registers. No T×T matrix.
//
// Two tensor-core paths share the tiles, the softmax and the accumulator
// layout (thread (g = lane/4, t = lane%4) of a warp holds rows g and g+8,
// columns 8j+2t and 8j+2t+1 of every 8-column block j):
// - sm_90a: wgmma, 128-row tiles (two warpgroups). S from Q and K in shared
//   memory, O from P in registers and V in shared memory. Each iteration
//   issues S(j) with P(j−1)·V(j−1) and runs the softmax of S(j) while that
//   product is still on the tensor cores. (Making the two warpgroups take
//   turns, FA3's ping-pong, measured no faster on an H200 and is not done.)
// - otherwise (sm_100a, sm_120a, the compute_90 PTX, or DRAFTFEED_PORTABLE_KERNELS):
//   mma.sync.m16n8k16 fed by ldmatrix, 64-row tiles, the same loop done
//   synchronously; at head dim 256, 32-key tiles where 64-key ones need more
//   shared memory than the device has (sm_120: kernels/kernel_paths.cuh).
// Head dims 32/64/96 take an exact untuned kernel (attention_small_heads.cu).
//
// One file past the ~600 lines a file usually holds (its wgmma instruction
// wrappers are kernels/wgmma_sm90.cuh), because it is one op
// family behind one launcher (VarlenCausalAttention): both tensor-core paths
// are one kernel template sharing the tile layout, the shared-memory budget,
// the loader's TMA maps and mbarriers, the online softmax and the accumulator
// layout, and one dispatch checks the arguments and picks among them and the
// small-head kernel. Split, those would become a header of internals.
#include "kernels/attention.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cmath>
#include <type_traits>

#include "kernels/kernel_paths.cuh"
#include "kernels/mma_sm80.cuh"
#include "kernels/tma_sm90.cuh"
#include "kernels/wgmma_sm90.cuh"

namespace draftfeed::cuda {
namespace {

using sm90::kArchWgmma;

// Block shape of each path: compute warps of 16 query rows, then loader warps.
// wgmma: two warpgroups (128 rows) and a whole loader warpgroup, because
// registers move between warpgroups (setmaxnreg): the loader keeps 24, the
// compute warps get 240 (128·24 + 256·240 ≤ 64K). Without setmaxnreg a block
// over 256 threads caps every thread at 168 registers, so the portable path
// runs four compute warps (64 rows) and one loader warp.
template <bool kWgmma>
struct Layout {
  static constexpr int kComputeWarps = kWgmma ? 8 : 4;
  static constexpr int kLoaderWarps = kWgmma ? 4 : 1;
  static constexpr int kBlockM = 16 * kComputeWarps;
  static constexpr int kThreads = (kComputeWarps + kLoaderWarps) * 32;
};
static_assert(4 * 32 * 24 + 8 * 32 * 240 <= 64 * 1024, "setmaxnreg budget");

struct Params {
  bf16* out;
  int64_t out_stride;
  const int32_t* cu_seqlens;
  int q_offset;      // position of query row 0 (AttentionArgs::q_offset)
  int group;         // query heads per KV head
  float scale_log2;  // scale·log2(e): the softmax runs on exp2
};

// ---------------------------------------------------------------------------
// Shared-memory tiles: [rows × HD] bf16 in the 128-byte-swizzled layout
// (sm90::SwizzledOffset), which TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and
// a 64-column box.
using sm90::SwizzledOffset;

template <int HD, int BN, int BM>
constexpr int SmemBytes() {
  // Q, two K stages, two V stages, 9 mbarriers, slack to align to 1024.
  return BM * HD * 2 + 4 * BN * HD * 2 + 9 * 8 + 1024;
}

using sm90::MbarArrive;
using sm90::MbarExpectTx;
using sm90::MbarInit;
using sm90::MbarWait;

// One 64-column × 1-head × rows box of a [tokens, heads, HD] tensor.
__device__ __forceinline__ void TmaLoad(uint32_t dst, const CUtensorMap& map, int col, int head,
                                        int token, uint32_t bar) {
  sm90::TmaLoad3d(dst, map, col, head, token, bar);
}

using sm90::FenceRegs;

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

using sm80::LdMatrixX4;
using sm80::LdMatrixX4Trans;
using sm80::Mma;
using sm80::PackBf16;

// ---------------------------------------------------------------------------
// Portable path: mma.sync.m16n8k16 (bf16 in, fp32 accumulate) from ldmatrix.
template <int HD, int BN, int BM>
struct MmaCore {
  // S(16 rows of this warp × BN) = Q·Kᵀ.
  static __device__ __forceinline__ void IssueQK(float (&s)[BN / 2], uint32_t q_smem,
                                                 uint32_t k_smem, int warp, int lane) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
    // ldmatrix.x4 quadrants: A = (rows 0-7 | 8-15) × (k 0-7 | 8-15);
    // B = (keys 0-7, k 0-7 | 8-15), (keys 8-15, k 0-7 | 8-15).
    const int a_row = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8;
    const int a_col = (lane >> 4) * 8;
    const int b_row = (lane & 7) + (lane >> 4) * 8;
    const int b_col = ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      uint32_t a[4];
      LdMatrixX4</*kMemoryClobber=*/true>(a, q_smem + SwizzledOffset<BM>(a_row, kk * 16 + a_col));
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t b[4];
        LdMatrixX4</*kMemoryClobber=*/true>(
            b, k_smem + SwizzledOffset<BN>(np * 16 + b_row, kk * 16 + b_col));
        Mma(&s[(2 * np) * 4], a, b[0], b[1]);
        Mma(&s[(2 * np + 1) * 4], a, b[2], b[3]);
      }
    }
  }
  // O += P·V; V read transposed: quadrants (keys 0-7 | 8-15) × (dims 0-7 | 8-15).
  template <bool kIssue, bool kFence>
  static __device__ __forceinline__ void IssuePV(float (&o)[HD / 2],
                                                 const uint32_t (&p)[BN / 16][4], uint32_t v_smem,
                                                 int, int lane) {
    if constexpr (!kIssue) return;
    const int row = (lane & 7) + ((lane >> 3) & 1) * 8;
    const int col = (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t b[4];
        LdMatrixX4Trans</*kMemoryClobber=*/true>(
            b, v_smem + SwizzledOffset<BN>(kk * 16 + row, dp * 16 + col));
        Mma(&o[(2 * dp) * 4], p[kk], b[0], b[1]);
        Mma(&o[(2 * dp + 1) * 4], p[kk], b[2], b[3]);
      }
    }
  }
  static __device__ __forceinline__ void WaitQK(float (&)[BN / 2]) {}
  static __device__ __forceinline__ void WaitPV(float (&)[HD / 2], uint32_t (&)[BN / 16][4]) {}
};

// ---------------------------------------------------------------------------
// sm_90a path: wgmma.mma_async (kernels/wgmma_sm90.cuh), one warpgroup = 64 rows.
using sm90::Wgmma;

template <int HD, int BN, int BM>
struct WgmmaCore {
  static __device__ __forceinline__ void Fence() { sm90::WgmmaFence(); }
  static __device__ __forceinline__ void Commit() { sm90::WgmmaCommit(); }
  template <int kPending>
  static __device__ __forceinline__ void Wait() {
    sm90::WgmmaWait<kPending>();
  }
  // K-major operands (Q, K) step 8-row groups by sbo = 1024 and ignore lbo;
  // the N-major V steps 8-key groups by sbo = 1024 and 64-column chunks by lbo.
  static __device__ __forceinline__ uint64_t Desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return sm90::SmemDesc128B(addr, lbo, sbo);
  }
  // Hides a value from loop-invariant code motion, so it is rebuilt each
  // tile instead of held in registers across the main loop.
  static __device__ __forceinline__ uint64_t Opaque(uint64_t x) {
    asm volatile("" : "+l"(x));
    return x;
  }

  static __device__ __forceinline__ void IssueQK(float (&s)[BN / 2], uint32_t q_smem,
                                                 uint32_t k_smem, int warp, int) {
    FenceRegs(s);  // nothing may write s between the fence and the products
    // Built here each tile, not hoisted: 32 loop-invariant descriptors
    // would cost 64 registers.
    const uint64_t a0 = Opaque(Desc(q_smem + (warp / 4) * 64 * 128, 16, 1024));
    const uint64_t b0 = Desc(k_smem, 16, 1024);
    Fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      // Columns 16kk..16kk+15: chunk kk/4, 32 bytes into each 128-byte row
      // (descriptor addresses count 16-byte units).
      const uint64_t a = a0 + (((kk / 4) * (BM * 128) + (kk % 4) * 32) >> 4);
      const uint64_t b = b0 + (((kk / 4) * (BN * 128) + (kk % 4) * 32) >> 4);
      if (kk == 0) {
        Wgmma<BN>::template SS<0>(s, a, b);  // S = Q·Kᵀ, not +=
      } else {
        Wgmma<BN>::template SS<1>(s, a, b);
      }
    }
    Commit();
  }
  // Always commits a group (empty without kIssue), so WaitQK's count holds.
  template <bool kIssue, bool kFence>
  static __device__ __forceinline__ void IssuePV(float (&o)[HD / 2],
                                                 const uint32_t (&p)[BN / 16][4], uint32_t v_smem,
                                                 int, int) {
    if constexpr (kFence) Fence();
    if constexpr (kIssue) {
      // One instruction per 16 keys covers all HD columns (HD/64 chunks).
      const uint64_t b0 = Desc(v_smem, BN * 128, 1024);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        Wgmma<HD>::template RS<1>(o, p[kk], b0 + ((kk * 16 * 128) >> 4));
    }
    Commit();
  }
  static __device__ __forceinline__ void WaitQK(float (&s)[BN / 2]) {
    Wait<1>();
    FenceRegs(s);
  }
  // Also keeps P(j−1) alive until its product is done, so the compiler cannot
  // place P(j) in the registers the tensor cores are still reading.
  static __device__ __forceinline__ void WaitPV(float (&o)[HD / 2], uint32_t (&p)[BN / 16][4]) {
    Wait<0>();
    FenceRegs(o);
    FenceRegs(p);
  }
};

// ---------------------------------------------------------------------------
// The block size is the path's (read back by the launcher from the loaded
// binary as cudaFuncAttributes::maxThreadsPerBlock).
template <int HD, int BN, bool kTryWgmma>
__global__ void __launch_bounds__(Layout<kTryWgmma && kArchWgmma>::kThreads, 1)
    AttentionKernel(const __grid_constant__ CUtensorMap tm_q,
                    const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_v, const Params prm) {
  constexpr bool kWgmma = kTryWgmma && kArchWgmma;
  using L = Layout<kWgmma>;
  constexpr int kBlockM = L::kBlockM;
  constexpr int kComputeWarps = L::kComputeWarps;
  using Core = std::conditional_t<kWgmma, WgmmaCore<HD, BN, kBlockM>, MmaCore<HD, BN, kBlockM>>;
  constexpr uint32_t kQBytes = kBlockM * HD * 2;
  constexpr uint32_t kTileBytes = BN * HD * 2;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t q_smem =
      (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023) & ~uint32_t{1023};
  const uint32_t k_smem = q_smem + kQBytes;
  const uint32_t v_smem = k_smem + 2 * kTileBytes;
  const uint32_t q_full = v_smem + 2 * kTileBytes;
  const auto k_full = [&](int st) { return q_full + 8 + 8 * st; };
  const auto k_empty = [&](int st) { return q_full + 24 + 8 * st; };
  const auto v_full = [&](int st) { return q_full + 40 + 8 * st; };
  const auto v_empty = [&](int st) { return q_full + 56 + 8 * st; };

  // Heads vary fastest and query tiles run last-first, so the longest
  // (farthest from the start) tiles are scheduled first and the query heads
  // sharing a KV head run side by side.
  const int head = blockIdx.x;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * kBlockM;  // query row in the sequence
  const int seq_begin = prm.cu_seqlens[blockIdx.z];
  const int seq_len = prm.cu_seqlens[blockIdx.z + 1] - seq_begin;
  if (q0 >= seq_len) return;
  // Row q0's position, whose keys are sequence rows 0 .. pos0: key tiles,
  // the mask and the KV loads count positions, Q and the output rows. With
  // q_offset > 0 there is one sequence at row 0, so key position = k/v row.
  const int pos0 = prm.q_offset + q0;
  const int num_kv_tiles = (min(pos0 + kBlockM, prm.q_offset + seq_len) + BN - 1) / BN;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    MbarInit(q_full, 1);
    for (int st = 0; st < 2; ++st) {
      MbarInit(k_full(st), 1);
      MbarInit(v_full(st), 1);
      // Every compute thread releases (a lane-0-only arrive would be a
      // branch between wgmma instructions, which ptxas serializes).
      MbarInit(k_empty(st), kComputeWarps * 32);
      MbarInit(v_empty(st), kComputeWarps * 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp >= kComputeWarps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kWgmma) asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
#endif
    // Loader: Q, then K(j) and V(j) once the tile two back has been released.
    // TMA zero-fills rows past the last packed token; rows past this
    // sequence's end are real tokens and the causal mask hides them.
    if (warp == kComputeWarps && lane == 0) {
      const int kv_head = head / prm.group;
      MbarExpectTx(q_full, kQBytes);
      for (int c = 0; c < HD / 64; ++c)
        TmaLoad(q_smem + c * kBlockM * 128, tm_q, c * 64, head, seq_begin + q0, q_full);
      for (int j = 0; j < num_kv_tiles; ++j) {
        const int st = j & 1;
        const uint32_t free_parity = ((j >> 1) & 1) ^ 1;
        MbarWait(k_empty(st), free_parity);
        MbarExpectTx(k_full(st), kTileBytes);
        for (int c = 0; c < HD / 64; ++c)
          TmaLoad(k_smem + st * kTileBytes + c * BN * 128, tm_k, c * 64, kv_head,
                  seq_begin + j * BN, k_full(st));
        MbarWait(v_empty(st), free_parity);
        MbarExpectTx(v_full(st), kTileBytes);
        for (int c = 0; c < HD / 64; ++c)
          TmaLoad(v_smem + st * kTileBytes + c * BN * 128, tm_v, c * 64, kv_head,
                  seq_begin + j * BN, v_full(st));
      }
    }
    return;
  }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kWgmma) asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
#endif

  // Compute warps. This thread's rows: block-relative q0 + row and + 8.
  const int row = 16 * warp + lane / 4;
  const float sl2 = prm.scale_log2;
  float o[HD / 2], s[BN / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  uint32_t p[BN / 16][4] = {};

  MbarWait(q_full, 0);

  // One KV tile; the first has no P(j−1)·V(j−1) to issue.
  const auto step = [&](int j, auto first) {
    constexpr bool kFirst = decltype(first)::value;
    // Both waits come before the issue: a spin loop between wgmma
    // instructions would make ptxas serialize them.
    if (!kFirst) MbarWait(v_full((j - 1) & 1), ((j - 1) >> 1) & 1);
    MbarWait(k_full(j & 1), (j >> 1) & 1);
    Core::IssueQK(s, q_smem, k_smem + (j & 1) * kTileBytes, warp, lane);
    Core::template IssuePV<!kFirst, false>(o, p, v_smem + ((j - 1) & 1) * kTileBytes, warp, lane);
    Core::WaitQK(s);
    MbarArrive(k_empty(j & 1));

    // Causal mask, only on tiles that reach past this warp's first row.
    if ((j + 1) * BN - 1 > pos0 + 16 * warp) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i) {
        const int key = j * BN + (i / 4) * 8 + 2 * (lane % 4) + (i & 1);
        if (key > pos0 + row + 8 * ((i >> 1) & 1)) s[i] = -INFINITY;
      }
    }
    // Online softmax; a row's 4 threads (one quad) share its max.
    float new_max[2] = {row_max[0], row_max[1]};
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) new_max[(i >> 1) & 1] = fmaxf(new_max[(i >> 1) & 1], s[i]);
    float corr[2], offset[2], tile_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffffu, new_max[r], 1));
      new_max[r] = fmaxf(new_max[r], __shfl_xor_sync(0xffffffffu, new_max[r], 2));
      // Every row sees its sequence's first key on tile 0, so new_max is
      // finite and exp2(−inf) = 0 handles the first tile. A tile past a
      // row's diagonal (the block's later rows reach further) leaves it as
      // it was: p = 0, corr = exp2(0) = 1.
      corr[r] = Exp2((row_max[r] - new_max[r]) * sl2);
      row_max[r] = new_max[r];
      offset[r] = -new_max[r] * sl2;
    }
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      s[i] = Exp2(fmaf(s[i], sl2, offset[(i >> 1) & 1]));
      tile_sum[(i >> 1) & 1] += s[i];
    }
    row_sum[0] = row_sum[0] * corr[0] + tile_sum[0];
    row_sum[1] = row_sum[1] * corr[1] + tile_sum[1];
    // P as the A operand of m16n8k16 / wgmma: per 16 keys, rows g | g+8 ×
    // keys 2t | 2t+8.
    uint32_t p_next[BN / 16][4];
    sm80::AccumulatorToA(s, p_next);

    Core::WaitPV(o, p);
    if (!kFirst) MbarArrive(v_empty((j - 1) & 1));
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] *= corr[(i >> 1) & 1];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) p[kk][e] = p_next[kk][e];
    // Settle O and P before the next iteration's wgmma fence.
    FenceRegs(o);
    FenceRegs(p);
  };
  step(0, std::true_type{});
  for (int j = 1; j < num_kv_tiles; ++j) step(j, std::false_type{});
  const int last = num_kv_tiles - 1;
  MbarWait(v_full(last & 1), (last >> 1) & 1);
  Core::template IssuePV<true, true>(o, p, v_smem + (last & 1) * kTileBytes, warp, lane);
  Core::WaitPV(o, p);

  // q0 again, from pos0 and an offset hidden from the optimizer: left to
  // itself it keeps q0 live across the loop beside pos0, which costs the
  // portable hd-256 kernels (at 255 registers) 60 bytes of spills.
  int q_offset = prm.q_offset;
  asm volatile("" : "+r"(q_offset));
  const int q_row0 = pos0 - q_offset;
  bf16* out = prm.out + (seq_begin + q_row0) * prm.out_stride + head * HD + 2 * (lane % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float sum = row_sum[r];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const float inv = 1.f / sum;
    const int qr = row + 8 * r;
    if (q_row0 + qr >= seq_len) continue;
    uint32_t* dst = reinterpret_cast<uint32_t*>(out + qr * prm.out_stride);
#pragma unroll
    for (int nb = 0; nb < HD / 8; ++nb)
      dst[nb * 4] = PackBf16(o[nb * 4 + 2 * r] * inv, o[nb * 4 + 2 * r + 1] * inv);
  }
}

// ---------------------------------------------------------------------------
// Host side.
using sm90::EncodeTiled;
using sm90::EncodeTiledFn;

// [tokens, heads, hd] bf16, read in boxes of 64 columns × 1 head × `rows`
// tokens with the 128-byte swizzle; rows past `tokens` read as zeros.
cudaError_t MakeTensorMap(CUtensorMap* map, const bf16* base, int64_t tokens, int64_t heads,
                          int64_t hd, int64_t head_stride, int64_t token_stride, int rows) {
  const EncodeTiledFn encode = EncodeTiled();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(hd), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(tokens)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride) * sizeof(bf16),
                                 static_cast<cuuint64_t>(token_stride) * sizeof(bf16)};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16*>(base), dims, strides, box,
             elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <int HD, int BN, bool kTryWgmma>
cudaError_t LaunchKernel(const AttentionArgs& a, cudaStream_t stream) {
  using L = Layout<kTryWgmma>;
  const auto kernel = AttentionKernel<HD, BN, kTryWgmma>;
  constexpr int kSmem = SmemBytes<HD, BN, L::kBlockM>();
  const int q_tiles = (a.max_seqlen + L::kBlockM - 1) / L::kBlockM;
  if (q_tiles > 65535) return cudaErrorInvalidValue;
  CUtensorMap tm_q, tm_k, tm_v;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err == cudaSuccess) {
    err = MakeTensorMap(&tm_q, a.q, a.num_tokens, a.num_q_heads, HD, a.q_head_stride, a.q_stride,
                        L::kBlockM);
  }
  // K and V span the prefix too (VarlenCausalAttention has checked the count).
  const int64_t kv_tokens = a.num_kv_tokens != 0 ? a.num_kv_tokens : a.num_tokens;
  if (err == cudaSuccess)
    err = MakeTensorMap(&tm_k, a.k, kv_tokens, a.num_kv_heads, HD, HD, a.k_stride, BN);
  if (err == cudaSuccess)
    err = MakeTensorMap(&tm_v, a.v, kv_tokens, a.num_kv_heads, HD, HD, a.v_stride, BN);
  if (err != cudaSuccess) return err;
  Params prm;
  prm.out = a.out;
  prm.out_stride = a.num_q_heads * HD;
  prm.cu_seqlens = a.cu_seqlens;
  prm.q_offset = a.q_offset;
  prm.group = static_cast<int>(a.num_q_heads / a.num_kv_heads);
  prm.scale_log2 = a.scale * 1.4426950408889634f;
  const dim3 grid(static_cast<unsigned>(a.num_q_heads), q_tiles, a.num_seqs);
  kernel<<<grid, L::kThreads, kSmem, stream>>>(tm_q, tm_k, tm_v, prm);
  return cudaGetLastError();
}

// KV tiles per head dim: wgmma's; the portable kernel's (fewer registers
// than wgmma's); and the portable kernel's where that one's shared memory is
// more than the device allows (head dim 256 on sm_120: 161 KB at 64 keys,
// 97 KB at 32; head dim 128 needs 81 KB at 64 keys, which every GPU has).
template <int HD>
struct Tiles;
template <>
struct Tiles<128> {
  static constexpr int kWgmma = 128, kPortable = 64, kSmall = 64;
};
template <>
struct Tiles<256> {
  static constexpr int kWgmma = 80, kPortable = 64, kSmall = 32;
};

// The wgmma kernel where the loaded binary has it (sm_90a code on a Hopper
// GPU: its block size says so) and HopperKernelsAllowed(), else the portable
// one with the largest of its tiles that fits.
template <int HD>
cudaError_t ChoosePath(AttentionPath* path) {
  using T = Tiles<HD>;
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, AttentionKernel<HD, T::kWgmma, true>);
  if (err != cudaSuccess) return err;
  if (HopperKernelsAllowed() && attr.maxThreadsPerBlock == Layout<true>::kThreads) {
    *path = {true, T::kWgmma, SmemBytes<HD, T::kWgmma, Layout<true>::kBlockM>(),
             Layout<true>::kBlockM};
    return cudaSuccess;
  }
  int limit = 0;
  if ((err = SmemPerBlockLimit(&limit)) != cudaSuccess) return err;
  constexpr int kPortableSmem = SmemBytes<HD, T::kPortable, Layout<false>::kBlockM>();
  if (kPortableSmem <= limit) {
    *path = {false, T::kPortable, kPortableSmem, Layout<false>::kBlockM};
  } else {
    *path = {false, T::kSmall, SmemBytes<HD, T::kSmall, Layout<false>::kBlockM>(),
             Layout<false>::kBlockM};
  }
  return cudaSuccess;
}

template <int HD>
cudaError_t Launch(const AttentionArgs& a, cudaStream_t stream) {
  using T = Tiles<HD>;
  AttentionPath path;
  const cudaError_t err = ChoosePath<HD>(&path);
  if (err != cudaSuccess) return err;
  if (path.wgmma) return LaunchKernel<HD, T::kWgmma, true>(a, stream);
  if (path.kv_tile == T::kPortable) return LaunchKernel<HD, T::kPortable, false>(a, stream);
  return LaunchKernel<HD, T::kSmall, false>(a, stream);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t VarlenCausalAttention(const AttentionArgs& a, cudaStream_t stream) {
  if (a.num_q_heads <= 0 || a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0 ||
      a.num_seqs < 0 || a.num_seqs > 65535 || a.max_seqlen < 0 || a.num_tokens < 0 ||
      a.num_tokens >= (int64_t{1} << 31)) {
    return cudaErrorInvalidValue;
  }
  // A prefix continues exactly one sequence, and k/v hold the prefix and the
  // queries' own rows; positions (and so TMA rows) stay below 2^31.
  const int64_t kv_tokens = a.num_kv_tokens != 0 ? a.num_kv_tokens : a.num_tokens;
  if (a.q_offset < 0 || (a.q_offset > 0 && a.num_seqs != 1) || a.num_kv_tokens < 0 ||
      kv_tokens != a.q_offset + a.num_tokens || kv_tokens >= (int64_t{1} << 31)) {
    return cudaErrorInvalidValue;
  }
  if (a.num_tokens == 0 || a.num_seqs == 0 || a.max_seqlen == 0) return cudaSuccess;
  if (a.head_dim == 32 || a.head_dim == 64 || a.head_dim == 96) {
    return SmallHeadAttention(a, stream);
  }
  // TMA needs 16-byte aligned bases and strides.
  if (!Aligned16(a.q) || !Aligned16(a.k) || !Aligned16(a.v) || !Aligned16(a.out) ||
      a.q_stride % 8 != 0 || a.q_head_stride % 8 != 0 || a.k_stride % 8 != 0 ||
      a.v_stride % 8 != 0 || a.cu_seqlens == nullptr) {
    return cudaErrorInvalidValue;
  }
  switch (a.head_dim) {
    case 128:
      return Launch<128>(a, stream);
    case 256:
      return Launch<256>(a, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t ChooseAttentionPath(int64_t head_dim, AttentionPath* path) {
  switch (head_dim) {
    case 128:
      return ChoosePath<128>(path);
    case 256:
      return ChoosePath<256>(path);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace draftfeed::cuda
