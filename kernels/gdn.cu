// Gated DeltaNet prefill: the chunked gated delta rule (transformers'
// torch_chunk_gated_delta_rule, 64-token chunks per sequence) in two kernels.
// (The family's first stage, the causal conv + SiLU, is gdn_conv.cu.)
//
// GdnPrepKernel, one block per (chunk, value head), all chunks at once: gates,
// γ = cumsum(g), the L2 norms, the Gram matrices kkᵀ and qkᵀ on the tensor
// cores, 𝒯 = (I + A)⁻¹ in fp32 (16×16 diagonal blocks by forward substitution,
// then block back-substitution), U = 𝒯·diag(β)·V and W = 𝒯·diag(β‖k‖⁻¹e^γ)·K
// with 𝒯 split into two bf16 halves so that the raw bf16 v and k enter
// unrounded. It writes U, W and M = (q̂k̂ᵀ ⊙ Γ) in bf16 and the per-token row
// factors to the workspace.
//
// GdnScanKernel, one block per (sequence, value head, 64 state columns): walks
// the chunks in order with the state's transpose Sᵀ [dv, dk] in fp32
// registers as an mma accumulator, one warp per 16 value columns (state
// columns are independent, so that split costs nothing). Per chunk:
//   V_newᵀ = Uᵀ − Sᵀ·Wᵀ,  Oᵀ = (Sᵀ·qᵀ)·diag(qf) + V_newᵀ·Mᵀ,
//   Sᵀ ← e^{γ_last}·Sᵀ + V_newᵀ·diag(kf)·k,
// with q and k read raw from the conv output and the norms, the dk^−½ scale
// and the decays folded into qf = ‖q‖⁻¹dk^−½e^γ and kf = ‖k‖⁻¹e^{γ_last−γ}.
// Transposing makes the accumulator of one product the A operand of the next
// without a trip through shared memory. The next chunk's operands stream in
// by cp.async while the current one computes; where two chunk buffers are
// more shared memory than the GPU has (dk = 128 on sm_120), one buffer, loaded
// after the chunk before is done (the same products in the same order, so the
// same bits).
//
// Decays only ever appear as exp(γ_r − γ_s) with s ≤ r, exp(γ) and
// exp(γ_last − γ), all ≤ 1: γ over a chunk can be hundreds negative, so exp(−γ)
// alone would overflow. Padded rows of a sequence's last chunk are
// zero-filled, which equals HF's zero padding.
//
// One file past the ~600 lines a file usually holds, because it is one op
// family behind gdn.cuh: the prep and scan kernels share the chunk constants,
// the workspace that one writes and the other reads (Workspace, Layout,
// kFactorFloats), GdnParams and the ldmatrix lane maps; apart, those would
// become a header of internals that only these two kernels read.
#include "kernels/gdn.cuh"

#include <cstring>
#include <type_traits>

#include "kernels/kernel_paths.cuh"
#include "kernels/mma_sm80.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

constexpr int kChunk = 64;
constexpr float kL2Eps = 1e-6f;
// Per (chunk, head) factor block: qf[64] | kf[64] | e^{γ_last} | 3 pad (16-byte multiple).
constexpr int kFactorFloats = 2 * kChunk + 4;

// ---------------------------------------------------------------------------
// PTX helpers.

using sm80::CpAsync16;
using sm80::CpAsyncCommit;
using sm80::CpAsyncWait;
using sm80::LdMatrixX4;
using sm80::LdMatrixX4Trans;
using sm80::Mma;
using sm80::PackBf16;
using sm80::SmemAddr;

__device__ __forceinline__ float2 UnpackBf16(uint32_t u) {
  __nv_bfloat162 v;
  memcpy(&v, &u, sizeof(u));
  return __bfloat1622float2(v);
}

// x = hi + lo to about 2^-16 relative, both bf16.
__device__ __forceinline__ void SplitBf16(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  memcpy(&hi, &h, sizeof(hi));
  lo = PackBf16(x0 - hf.x, x1 - hf.y);
}

// Lane offsets for ldmatrix.x4 over a 16×16 tile at (row0, col0) of a
// row-major bf16 array. A operand (rows = m, cols = k): regs a0..a3.
__device__ __forceinline__ int LdsmARow(int lane) { return lane & 15; }
__device__ __forceinline__ int LdsmACol(int lane) { return (lane >> 4) * 8; }
// B operand stored [n][k] (non-trans) or accumulator-shaped transposes
// stored [k][n] (trans): regs 0–1 are n-tile 0, regs 2–3 n-tile 1.
//   non-trans [n][k]: row n = (l & 7) + (l >> 4)·8, col k = ((l >> 3) & 1)·8
//   trans     [k][n]: row k = (l & 7) + ((l >> 3) & 1)·8, col n = (l >> 4)·8
__device__ __forceinline__ int LdsmBNRow(int lane) { return (lane & 7) + (lane >> 4) * 8; }
__device__ __forceinline__ int LdsmBNCol(int lane) { return ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int LdsmBTRow(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }
__device__ __forceinline__ int LdsmBTCol(int lane) { return (lane >> 4) * 8; }

// ---------------------------------------------------------------------------
// Gated delta rule: workspace.

// Chunk slots: chunk c of sequence s lives in slot s + ⌊cu[s]/64⌋ + c. That
// is injective (a sequence's chunks end before the next sequence's slots
// begin) and below num_seqs + ⌈T/64⌉, so no prefix sum over the device
// cu_seqlens is needed. A few slots stay unused.
__host__ __device__ __forceinline__ int64_t FirstSlot(int32_t seq, int32_t seq_begin) {
  return seq + seq_begin / kChunk;
}

int64_t NumSlots(const GdnArgs& a) { return a.num_seqs + (a.num_tokens + kChunk - 1) / kChunk; }

size_t AlignUp(size_t n) { return (n + 255) / 256 * 256; }

struct Workspace {
  bf16* w;   // [slot][Nv][64][dk]
  bf16* u;   // [slot][Nv][64][dv]
  bf16* m;   // [slot][Nv][64][64], lower triangle with diagonal
  float* f;  // [slot][Nv][kFactorFloats]
};

struct WorkspaceLayout {
  size_t w, u, m, f, total;
};

WorkspaceLayout Layout(const GdnArgs& a) {
  const size_t items = static_cast<size_t>(NumSlots(a)) * a.num_v_heads;
  WorkspaceLayout l;
  l.w = 0;
  l.u = l.w + AlignUp(items * kChunk * a.key_dim * sizeof(bf16));
  l.m = l.u + AlignUp(items * kChunk * a.value_dim * sizeof(bf16));
  l.f = l.m + AlignUp(items * kChunk * kChunk * sizeof(bf16));
  l.total = l.f + AlignUp(items * kFactorFloats * sizeof(float));
  return l;
}

// Kernel parameters shared by both kernels.
struct GdnParams {
  const bf16* qkv;
  int64_t qkv_stride;
  const bf16* a;
  const bf16* b;
  int64_t ab_stride;
  const float* a_log;
  const float* dt_bias;
  const int32_t* cu;
  int32_t num_seqs;
  int32_t num_k_heads;
  int32_t num_v_heads;
  bf16* out;
  Workspace ws;
};

// ---------------------------------------------------------------------------
// Kernel 1: per (chunk slot, value head).

constexpr int kPrepWarps = 4;  // warp w owns chunk rows [16w, 16w + 16)
constexpr int kPrepThreads = 32 * kPrepWarps;

template <int kDk, int kDv>
struct PrepSmem {
  static constexpr int kQkLd = kDk + 8;  // bf16 row pitch: +16 B keeps ldmatrix conflict-free
  static constexpr int kVLd = kDv + 8;
  static constexpr int kFLd = kChunk + 1;  // fp32 row pitch of A and 𝒯
  static constexpr size_t kQBytes = size_t{kChunk} * kQkLd * sizeof(bf16);
  static constexpr size_t kVBytes = size_t{kChunk} * kVLd * sizeof(bf16);
  static constexpr size_t kFBytes = size_t{kChunk} * kFLd * sizeof(float);
  // Lifetimes: q until the Gram products, then 𝒯 takes its place where it
  // fits; A until 𝒯 is done, then v (loaded only then) takes its place. This
  // keeps the 27B shape at 53 KB, four blocks per SM.
  static constexpr bool kTInQ = kQBytes >= kFBytes;
  static constexpr size_t kAvBytes = kFBytes > kVBytes ? kFBytes : kVBytes;
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + kQBytes;
  static constexpr size_t kAv = kK + kQBytes;
  static constexpr size_t kT = kTInQ ? kQ : kAv + kAvBytes;
  static constexpr size_t kVec = kTInQ ? kAv + kAvBytes : kT + kFBytes;
  // Per-row vectors: g→γ, β, ‖q‖⁻¹, ‖k‖⁻¹, U's and W's column factors.
  static constexpr int kNumVecs = 6;
  static constexpr size_t kBytes = kVec + size_t{kNumVecs} * kChunk * sizeof(float);
};

// out [64][kDim] = (𝒯·diag(col))·B for the calling warp's 16 rows, B [64][kDim]
// bf16 in shared memory with row pitch ld. Only k-steps ks ≤ warp are
// non-zero (𝒯 is lower triangular). 𝒯·diag(col) is split into bf16 hi + lo,
// so with B exact in bf16 the products keep about fp32 accuracy.
template <int kDim>
__device__ __forceinline__ void TriangularProduct(const float* s_t, int t_ld, const float* col,
                                                  const bf16* s_b, int ld, bf16* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q4 = lane & 3, row0 = 16 * warp;
  uint32_t a_hi[4][4], a_lo[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    if (ks <= warp) {
#pragma unroll
      for (int reg = 0; reg < 4; ++reg) {
        const int r = row0 + g + 8 * (reg & 1);
        const int s = 16 * ks + 2 * q4 + 8 * (reg >> 1);
        SplitBf16(s_t[r * t_ld + s] * col[s], s_t[r * t_ld + s + 1] * col[s + 1], a_hi[ks][reg],
                  a_lo[ks][reg]);
      }
    }
  }
#pragma unroll
  for (int pp = 0; pp < kDim / 16; ++pp) {
    float acc[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (ks <= warp) {
        uint32_t b[4];
        LdMatrixX4Trans(b, s_b + (16 * ks + LdsmBTRow(lane)) * ld + 16 * pp + LdsmBTCol(lane));
        Mma(acc[0], a_hi[ks], b[0], b[1]);
        Mma(acc[0], a_lo[ks], b[0], b[1]);
        Mma(acc[1], a_hi[ks], b[2], b[3]);
        Mma(acc[1], a_lo[ks], b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int col0 = 16 * pp + 8 * nt + 2 * q4;
      *reinterpret_cast<uint32_t*>(out + (row0 + g) * kDim + col0) =
          PackBf16(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<uint32_t*>(out + (row0 + g + 8) * kDim + col0) =
          PackBf16(acc[nt][2], acc[nt][3]);
    }
  }
}

template <int kDk, int kDv>
__global__ void __launch_bounds__(kPrepThreads, 4) GdnPrepKernel(GdnParams p) {
  using L = PrepSmem<kDk, kDv>;
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* s_q = reinterpret_cast<bf16*>(smem + L::kQ);
  bf16* s_k = reinterpret_cast<bf16*>(smem + L::kK);
  float* s_a = reinterpret_cast<float*>(smem + L::kAv);
  bf16* s_v = reinterpret_cast<bf16*>(smem + L::kAv);
  float* s_t = reinterpret_cast<float*>(smem + L::kT);
  float* s_gam = reinterpret_cast<float*>(smem + L::kVec);
  float* s_beta = s_gam + kChunk;
  float* s_iq = s_beta + kChunk;
  float* s_ik = s_iq + kChunk;
  float* s_colu = s_ik + kChunk;
  float* s_colw = s_colu + kChunk;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, q4 = lane & 3;
  const int64_t slot = blockIdx.x;
  const int head = blockIdx.y;
  const int kh = head / (p.num_v_heads / p.num_k_heads);

  // Which (sequence, chunk) owns this slot: the last s with FirstSlot(s) <= slot.
  int lo = 0, hi = p.num_seqs;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (FirstSlot(mid, p.cu[mid]) <= slot)
      lo = mid;
    else
      hi = mid;
  }
  const int64_t t0 = p.cu[lo] + (slot - FirstSlot(lo, p.cu[lo])) * kChunk;
  const int64_t seq_end = p.cu[lo + 1];
  if (t0 >= seq_end) return;  // unused slot
  const int n = static_cast<int>(min(static_cast<int64_t>(kChunk), seq_end - t0));

  // Raw q and k rows; rows past the sequence end read 0. v comes later.
  const bf16* q_base = p.qkv + static_cast<int64_t>(kh) * kDk;
  const bf16* k_base = q_base + static_cast<int64_t>(p.num_k_heads) * kDk;
  {
    constexpr int kPieces = kDk / 8;
    for (int i = tid; i < kChunk * kPieces; i += kPrepThreads) {
      const int r = i / kPieces, c = (i % kPieces) * 8;
      const bool valid = r < n;
      const int64_t off = valid ? (t0 + r) * p.qkv_stride + c : 0;
      CpAsync16(s_q + r * L::kQkLd + c, q_base + off, valid);
      CpAsync16(s_k + r * L::kQkLd + c, k_base + off, valid);
    }
    CpAsyncCommit();
  }

  // Gates; padded rows get g = β = 0, so γ stays at γ_{n−1}.
  if (tid < kChunk) {
    float gv = 0.0f, bv = 0.0f;
    if (tid < n) {
      const int64_t i = (t0 + tid) * p.ab_stride + head;
      const float x = __bfloat162float(p.a[i]) + p.dt_bias[head];
      const float softplus = x > 20.0f ? x : log1pf(expf(x));
      gv = -expf(p.a_log[head]) * softplus;
      bv = 1.0f / (1.0f + expf(-__bfloat162float(p.b[i])));
    }
    s_gam[tid] = gv;
    s_beta[tid] = bv;
  }
  __syncthreads();
  if (warp == 0) {  // inclusive scan of g over 64 rows, two per lane
    const float g0 = s_gam[2 * lane], g1 = s_gam[2 * lane + 1];
    float incl = g0 + g1;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const float o = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += o;
    }
    float excl = __shfl_up_sync(0xffffffffu, incl, 1);
    if (lane == 0) excl = 0.0f;
    s_gam[2 * lane] = excl + g0;
    s_gam[2 * lane + 1] = incl;
  }
  CpAsyncWait<0>();
  __syncthreads();

  // L2 norms (threads 0–63: q rows, 64–127: k rows) and the row factors.
  {
    const int r = tid & (kChunk - 1);
    const bf16* row = (tid < kChunk ? s_q : s_k) + r * L::kQkLd;
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < kDk; c += 8) {
      float v[vec::kVec];
      vec::LoadBf16x8(row + c, v);
#pragma unroll
      for (int i = 0; i < vec::kVec; ++i) ss += v[i] * v[i];
    }
    const float inv = 1.0f / sqrtf(ss + kL2Eps);
    const float gam = s_gam[r], gam_last = s_gam[kChunk - 1];
    float* f = p.ws.f + (slot * p.num_v_heads + head) * kFactorFloats;
    if (tid < kChunk) {
      s_iq[r] = inv;
      f[r] = r < n ? inv * (1.0f / sqrtf(static_cast<float>(kDk))) * expf(gam) : 0.0f;
      if (r == 0) f[2 * kChunk] = expf(gam_last);
    } else {
      s_ik[r] = inv;
      f[kChunk + r] = r < n ? inv * expf(gam_last - gam) : 0.0f;
      s_colu[r] = s_beta[r];
      s_colw[r] = s_beta[r] * inv * expf(gam);
    }
  }
  __syncthreads();

  // Gram products for rows [16w, 16w + 16) against columns s ≤ 16w + 15
  // (n-tile pairs jj ≤ warp): G = k kᵀ and P = q kᵀ on the raw bf16 values.
  const int row0 = 16 * warp;
  float acc_g[8][4], acc_p[8][4];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) acc_g[j][c] = acc_p[j][c] = 0.0f;
  }
#pragma unroll
  for (int ks = 0; ks < kDk / 16; ++ks) {
    uint32_t ak[4], aq[4];
    const int arow = row0 + LdsmARow(lane), acol = 16 * ks + LdsmACol(lane);
    LdMatrixX4(ak, s_k + arow * L::kQkLd + acol);
    LdMatrixX4(aq, s_q + arow * L::kQkLd + acol);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      if (jj <= warp) {
        uint32_t b[4];
        LdMatrixX4(b, s_k + (16 * jj + LdsmBNRow(lane)) * L::kQkLd + 16 * ks + LdsmBNCol(lane));
        Mma(acc_g[2 * jj], ak, b[0], b[1]);
        Mma(acc_g[2 * jj + 1], ak, b[2], b[3]);
        Mma(acc_p[2 * jj], aq, b[0], b[1]);
        Mma(acc_p[2 * jj + 1], aq, b[2], b[3]);
      }
    }
  }
  // A_rs = β_r k̂_r·k̂_s Γ_rs (s < r) to shared memory; M_rs = q̂_r·k̂_s Γ_rs
  // (s ≤ r, else 0) to the workspace.
  {
    bf16* m_out = p.ws.m + (slot * p.num_v_heads + head) * kChunk * kChunk;
    const float q_scale = 1.0f / sqrtf(static_cast<float>(kDk));
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = row0 + g + 8 * half;
        const int s = 8 * j + 2 * q4;
        float mv[2] = {0.0f, 0.0f};
        if (j <= 2 * warp + 1) {
          const float gr = s_gam[r], br = s_beta[r], ikr = s_ik[r], iqr = s_iq[r] * q_scale;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int sc = s + e;
            if (sc <= r) {
              const float decay = expf(gr - s_gam[sc]);
              const float iks = s_ik[sc];
              mv[e] = iqr * iks * acc_p[j][2 * half + e] * decay;
              if (sc < r) s_a[r * L::kFLd + sc] = br * ikr * iks * acc_g[j][2 * half + e] * decay;
            }
          }
        }
        *reinterpret_cast<uint32_t*>(m_out + r * kChunk + s) = PackBf16(mv[0], mv[1]);
      }
    }
  }
  __syncthreads();  // A complete; q is dead from here (𝒯 may overwrite it)

  // 𝒯 = (I + A)⁻¹. Diagonal 16×16 blocks by forward substitution, one warp
  // each: lane owns column c = lane % 16 (both half-warps compute it).
  {
    const int c = lane & 15;
    const int b0 = 16 * warp;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float acc = (r == c) ? 1.0f : 0.0f;
#pragma unroll
      for (int s = 0; s < r; ++s) acc -= s_a[(b0 + r) * L::kFLd + b0 + s] * x[s];
      x[r] = acc;
    }
    if (lane < 16) {
#pragma unroll
      for (int r = 0; r < 16; ++r) s_t[(b0 + r) * L::kFLd + b0 + c] = x[r];
    }
  }
  __syncthreads();
  // Off-diagonal blocks, block column j by warp j, top to bottom:
  //   𝒯_ij = −𝒯_ii R_ij,  R_ij = Σ_{k=j}^{i−1} A_ik 𝒯_kj.
  // Everything a warp reads besides the diagonal blocks it wrote itself, so
  // only warp barriers are needed. R_ij is staged in 𝒯_ij's own place. Lane
  // owns row ρ = lane / 2 and 8 columns from c0 = 8·(lane % 2).
  // compute-sanitizer racecheck reports hazards here: with the odd fp32
  // pitch the compiler widens the 8-float row reads to aligned pairs that
  // touch the float just left of the lane's run, in another warp's block;
  // that value is discarded.
  {
    const int rho = lane >> 1, c0 = 8 * (lane & 1), j = warp;
#pragma unroll 1
    for (int i = j + 1; i < 4; ++i) {
      float acc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
#pragma unroll 1
      for (int k = j; k < i; ++k) {
#pragma unroll
        for (int m = 0; m < 16; ++m) {
          const float av = s_a[(16 * i + rho) * L::kFLd + 16 * k + m];
          const float* trow = s_t + (16 * k + m) * L::kFLd + 16 * j + c0;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += av * trow[e];
        }
      }
      float* dst = s_t + (16 * i + rho) * L::kFLd + 16 * j + c0;
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = acc[e];
      __syncwarp();
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
#pragma unroll
      for (int m = 0; m < 16; ++m) {
        const float tv = s_t[(16 * i + rho) * L::kFLd + 16 * i + m];
        const float* rrow = s_t + (16 * i + m) * L::kFLd + 16 * j + c0;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += tv * rrow[e];
      }
      __syncwarp();
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = -acc[e];
      __syncwarp();
    }
  }
  __syncthreads();  // 𝒯 complete; A is dead, v takes its place

  {
    const bf16* v_base =
        p.qkv + 2 * static_cast<int64_t>(p.num_k_heads) * kDk + static_cast<int64_t>(head) * kDv;
    constexpr int kPieces = kDv / 8;
    for (int i = tid; i < kChunk * kPieces; i += kPrepThreads) {
      const int r = i / kPieces, c = (i % kPieces) * 8;
      const bool valid = r < n;
      const int64_t off = valid ? (t0 + r) * p.qkv_stride + c : 0;
      CpAsync16(s_v + r * L::kVLd + c, v_base + off, valid);
    }
    CpAsyncCommit();
  }

  // U = 𝒯·diag(β)·V and W = 𝒯·diag(β‖k‖⁻¹e^γ)·K.
  // W first, while v streams in.
  const int64_t item = slot * p.num_v_heads + head;
  TriangularProduct<kDk>(s_t, L::kFLd, s_colw, s_k, L::kQkLd, p.ws.w + item * kChunk * kDk);
  CpAsyncWait<0>();
  __syncthreads();
  TriangularProduct<kDv>(s_t, L::kFLd, s_colu, s_v, L::kVLd, p.ws.u + item * kChunk * kDv);
}

// ---------------------------------------------------------------------------
// Kernel 2: per (sequence, value head, slice of ≤ 64 state columns).

// kStages chunk buffers: 2 overlaps the next chunk's loads with this one's
// products; 1 (load, then compute) where two do not fit in the device's
// shared memory (dk = 128 on sm_120: 151 KB against 99 KB).
template <int kDk, int kDv, int kStageCount>
struct ScanSmem {
  static constexpr int kSlice = kDv < 64 ? kDv : 64;
  static constexpr int kWarps = kSlice / 16;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kQkLd = kDk + 8;
  static constexpr int kMLd = kChunk + 8;
  static constexpr int kULd = kSlice + 8;
  static constexpr int kOLd = 16 + 8;
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + size_t{kChunk} * kQkLd * sizeof(bf16);
  static constexpr size_t kW = kK + size_t{kChunk} * kQkLd * sizeof(bf16);
  static constexpr size_t kM = kW + size_t{kChunk} * kQkLd * sizeof(bf16);
  static constexpr size_t kU = kM + size_t{kChunk} * kMLd * sizeof(bf16);
  static constexpr size_t kF = kU + size_t{kChunk} * kULd * sizeof(bf16);
  static constexpr size_t kStage = kF + kFactorFloats * sizeof(float);
  static constexpr int kStages = kStageCount;
  static constexpr size_t kO = kStages * kStage;  // per-warp output staging [64][kOLd]
  static constexpr size_t kBytes = kO + size_t{kWarps} * kChunk * kOLd * sizeof(bf16);
  static_assert(kStage % 16 == 0, "stages must stay 16-byte aligned");
};

template <int kDk, int kDv, int kStages>
__global__ void __launch_bounds__(ScanSmem<kDk, kDv, kStages>::kThreads, 1)
    GdnScanKernel(GdnParams p) {
  using L = ScanSmem<kDk, kDv, kStages>;
  // Chunk c's buffer.
  const auto stage = [](int c) { return kStages == 2 ? (c & 1) : 0; };
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, q4 = lane & 3;
  const int seq = blockIdx.x, head = blockIdx.y;
  const int slice0 = blockIdx.z * L::kSlice;
  const int kh = head / (p.num_v_heads / p.num_k_heads);
  const int64_t seq_begin = p.cu[seq], seq_end = p.cu[seq + 1];
  const int num_chunks = static_cast<int>((seq_end - seq_begin + kChunk - 1) / kChunk);
  const int64_t slot0 = FirstSlot(seq, static_cast<int32_t>(seq_begin));
  const bf16* q_base = p.qkv + static_cast<int64_t>(kh) * kDk;
  const bf16* k_base = q_base + static_cast<int64_t>(p.num_k_heads) * kDk;

  auto load_chunk = [&](int c) {
    unsigned char* st = smem + stage(c) * L::kStage;
    const int64_t t0 = seq_begin + static_cast<int64_t>(c) * kChunk;
    const int n = static_cast<int>(min(static_cast<int64_t>(kChunk), seq_end - t0));
    const int64_t item = (slot0 + c) * p.num_v_heads + head;
    constexpr int kQkPieces = kDk / 8;
    bf16* s_q = reinterpret_cast<bf16*>(st + L::kQ);
    bf16* s_k = reinterpret_cast<bf16*>(st + L::kK);
    bf16* s_w = reinterpret_cast<bf16*>(st + L::kW);
    const bf16* w_src = p.ws.w + item * kChunk * kDk;
    for (int i = tid; i < kChunk * kQkPieces; i += L::kThreads) {
      const int r = i / kQkPieces, col = (i % kQkPieces) * 8;
      const bool valid = r < n;
      const int64_t off = valid ? (t0 + r) * p.qkv_stride + col : 0;
      CpAsync16(s_q + r * L::kQkLd + col, q_base + off, valid);
      CpAsync16(s_k + r * L::kQkLd + col, k_base + off, valid);
      CpAsync16(s_w + r * L::kQkLd + col, w_src + r * kDk + col, true);
    }
    bf16* s_m = reinterpret_cast<bf16*>(st + L::kM);
    const bf16* m_src = p.ws.m + item * kChunk * kChunk;
    for (int i = tid; i < kChunk * (kChunk / 8); i += L::kThreads) {
      const int r = i / (kChunk / 8), col = (i % (kChunk / 8)) * 8;
      CpAsync16(s_m + r * L::kMLd + col, m_src + r * kChunk + col, true);
    }
    bf16* s_u = reinterpret_cast<bf16*>(st + L::kU);
    const bf16* u_src = p.ws.u + item * kChunk * kDv + slice0;
    for (int i = tid; i < kChunk * (L::kSlice / 8); i += L::kThreads) {
      const int r = i / (L::kSlice / 8), col = (i % (L::kSlice / 8)) * 8;
      CpAsync16(s_u + r * L::kULd + col, u_src + r * kDv + col, true);
    }
    float* s_f = reinterpret_cast<float*>(st + L::kF);
    const float* f_src = p.ws.f + item * kFactorFloats;
    for (int i = tid; i < kFactorFloats / 4; i += L::kThreads)
      CpAsync16(s_f + 4 * i, f_src + 4 * i, true);
  };

  // Sᵀ rows d0 + {g, g+8} (value dims of this warp), columns 8·nt + 2q + {0, 1} (key dims).
  float st_acc[kDk / 8][4];
#pragma unroll
  for (int nt = 0; nt < kDk / 8; ++nt) {
#pragma unroll
    for (int c = 0; c < 4; ++c) st_acc[nt][c] = 0.0f;
  }
  const int d0 = 16 * warp;  // within the slice
  bf16* s_o = reinterpret_cast<bf16*>(smem + L::kO) + warp * kChunk * L::kOLd;

  if (num_chunks > 0) load_chunk(0);
  CpAsyncCommit();
  for (int c = 0; c < num_chunks; ++c) {
    if constexpr (kStages == 2) {
      if (c + 1 < num_chunks) load_chunk(c + 1);
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();

    const unsigned char* st = smem + stage(c) * L::kStage;
    const bf16* s_q = reinterpret_cast<const bf16*>(st + L::kQ);
    const bf16* s_k = reinterpret_cast<const bf16*>(st + L::kK);
    const bf16* s_w = reinterpret_cast<const bf16*>(st + L::kW);
    const bf16* s_m = reinterpret_cast<const bf16*>(st + L::kM);
    const bf16* s_u = reinterpret_cast<const bf16*>(st + L::kU);
    const float* s_f = reinterpret_cast<const float*>(st + L::kF);

    // Sᵀ as bf16 A fragments (the accumulator layout of n-tiles 2ks, 2ks+1).
    uint32_t sa[kDk / 16][4];
#pragma unroll
    for (int ks = 0; ks < kDk / 16; ++ks) {
      sa[ks][0] = PackBf16(st_acc[2 * ks][0], st_acc[2 * ks][1]);
      sa[ks][1] = PackBf16(st_acc[2 * ks][2], st_acc[2 * ks][3]);
      sa[ks][2] = PackBf16(st_acc[2 * ks + 1][0], st_acc[2 * ks + 1][1]);
      sa[ks][3] = PackBf16(st_acc[2 * ks + 1][2], st_acc[2 * ks + 1][3]);
    }

    // Both products of the old state at once (independent accumulators keep
    // the tensor pipe busy): V_newᵀ ← Sᵀ·Wᵀ and Oᵀ ← Sᵀ·qᵀ, [16 value dims × 64 tokens].
    float vn[8][4], o[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) vn[nt][e] = o[nt][e] = 0.0f;
    }
#pragma unroll
    for (int ks = 0; ks < kDk / 16; ++ks) {
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int off = (16 * jj + LdsmBNRow(lane)) * L::kQkLd + 16 * ks + LdsmBNCol(lane);
        uint32_t bw[4], bq[4];
        LdMatrixX4(bw, s_w + off);
        LdMatrixX4(bq, s_q + off);
        Mma(vn[2 * jj], sa[ks], bw[0], bw[1]);
        Mma(vn[2 * jj + 1], sa[ks], bw[2], bw[3]);
        Mma(o[2 * jj], sa[ks], bq[0], bq[1]);
        Mma(o[2 * jj + 1], sa[ks], bq[2], bq[3]);
      }
    }
    // V_newᵀ = Uᵀ − Sᵀ·Wᵀ, with Uᵀ in accumulator layout from transposed
    // 8×8 loads of U [token][dim].
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      uint32_t u[4];
      LdMatrixX4Trans(
          u, s_u + (16 * jj + (lane & 7) + (lane >> 4) * 8) * L::kULd + d0 + ((lane >> 3) & 1) * 8);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float2 lo = UnpackBf16(u[2 * h]), hi = UnpackBf16(u[2 * h + 1]);
        float* v = vn[2 * jj + h];
        v[0] = lo.x - v[0];
        v[1] = lo.y - v[1];
        v[2] = hi.x - v[2];
        v[3] = hi.y - v[3];
      }
    }

    // The state update first: it is the next chunk's critical path.
    // Sᵀ ← e^{γ_last}·Sᵀ + (V_newᵀ·diag(kf))·k.
    {
      const float decay = s_f[2 * kChunk];
#pragma unroll
      for (int nt = 0; nt < kDk / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st_acc[nt][e] *= decay;
      }
      uint32_t vk[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const float2 kf0 = *reinterpret_cast<const float2*>(s_f + kChunk + 16 * ks + 2 * q4);
        const float2 kf1 = *reinterpret_cast<const float2*>(s_f + kChunk + 16 * ks + 8 + 2 * q4);
        vk[ks][0] = PackBf16(vn[2 * ks][0] * kf0.x, vn[2 * ks][1] * kf0.y);
        vk[ks][1] = PackBf16(vn[2 * ks][2] * kf0.x, vn[2 * ks][3] * kf0.y);
        vk[ks][2] = PackBf16(vn[2 * ks + 1][0] * kf1.x, vn[2 * ks + 1][1] * kf1.y);
        vk[ks][3] = PackBf16(vn[2 * ks + 1][2] * kf1.x, vn[2 * ks + 1][3] * kf1.y);
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int pp = 0; pp < kDk / 16; ++pp) {
          uint32_t b[4];
          LdMatrixX4Trans(b,
                          s_k + (16 * ks + LdsmBTRow(lane)) * L::kQkLd + 16 * pp + LdsmBTCol(lane));
          Mma(st_acc[2 * pp], vk[ks], b[0], b[1]);
          Mma(st_acc[2 * pp + 1], vk[ks], b[2], b[3]);
        }
      }
    }

    // Oᵀ = (Sᵀ·qᵀ)·diag(qf) + V_newᵀ·Mᵀ.
    {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const float2 qf = *reinterpret_cast<const float2*>(s_f + 8 * nt + 2 * q4);
        o[nt][0] *= qf.x;
        o[nt][1] *= qf.y;
        o[nt][2] *= qf.x;
        o[nt][3] *= qf.y;
      }
      uint32_t va[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        va[ks][0] = PackBf16(vn[2 * ks][0], vn[2 * ks][1]);
        va[ks][1] = PackBf16(vn[2 * ks][2], vn[2 * ks][3]);
        va[ks][2] = PackBf16(vn[2 * ks + 1][0], vn[2 * ks + 1][1]);
        va[ks][3] = PackBf16(vn[2 * ks + 1][2], vn[2 * ks + 1][3]);
      }
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int jj = ks; jj < 4; ++jj) {  // M is lower triangular: skip s-blocks above r-blocks
          uint32_t b[4];
          LdMatrixX4(b, s_m + (16 * jj + LdsmBNRow(lane)) * L::kMLd + 16 * ks + LdsmBNCol(lane));
          Mma(o[2 * jj], va[ks], b[0], b[1]);
          Mma(o[2 * jj + 1], va[ks], b[2], b[3]);
        }
      }
      // Stage the warp's [64 tokens × 16 dims] through shared memory, then
      // 16-byte stores of whole 32-byte row pieces.
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int r = 8 * nt + 2 * q4;
        s_o[r * L::kOLd + g] = __float2bfloat16(o[nt][0]);
        s_o[(r + 1) * L::kOLd + g] = __float2bfloat16(o[nt][1]);
        s_o[r * L::kOLd + g + 8] = __float2bfloat16(o[nt][2]);
        s_o[(r + 1) * L::kOLd + g + 8] = __float2bfloat16(o[nt][3]);
      }
      __syncwarp();
      const int64_t t0 = seq_begin + static_cast<int64_t>(c) * kChunk;
      const int n = static_cast<int>(min(static_cast<int64_t>(kChunk), seq_end - t0));
#pragma unroll
      for (int it = 0; it < kChunk / 16; ++it) {
        const int r = 16 * it + (lane >> 1), half = lane & 1;
        if (r < n) {
          const uint4 v = *reinterpret_cast<const uint4*>(s_o + r * L::kOLd + 8 * half);
          *reinterpret_cast<uint4*>(p.out + ((t0 + r) * p.num_v_heads + head) * kDv + slice0 + d0 +
                                    8 * half) = v;
        }
      }
      __syncwarp();
    }
    __syncthreads();  // this stage is refilled two chunks on (one stage: now)
    if constexpr (kStages == 1) {
      if (c + 1 < num_chunks) load_chunk(c + 1);
      CpAsyncCommit();
    }
  }
  CpAsyncWait<0>();
}

// Whether (dk, dv) has a one-stage scan: only where two stages are more than
// the smallest supported GPU's shared memory (kernels/kernel_paths.cuh).
template <int kDk, int kDv>
constexpr bool kHasOneStageScan = ScanSmem<kDk, kDv, 2>::kBytes > kSm120SmemPerBlock;

// Two stages where they fit in the device's shared memory, else one.
template <int kDk, int kDv>
cudaError_t ScanStages(int* stages) {
  int limit = 0;
  const cudaError_t err = SmemPerBlockLimit(&limit);
  if (err != cudaSuccess) return err;
  *stages =
      ScanSmem<kDk, kDv, 2>::kBytes <= static_cast<size_t>(limit) || !kHasOneStageScan<kDk, kDv>
          ? 2
          : 1;
  return cudaSuccess;
}

template <int kDk, int kDv, int kStages>
cudaError_t LaunchScan(const GdnParams& p, cudaStream_t stream) {
  using LS = ScanSmem<kDk, kDv, kStages>;
  const auto kernel = GdnScanKernel<kDk, kDv, kStages>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(LS::kBytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_v_heads),
                  kDv / LS::kSlice);
  kernel<<<grid, LS::kThreads, LS::kBytes, stream>>>(p);
  return cudaGetLastError();
}

template <int kDk, int kDv>
cudaError_t LaunchGdn(const GdnParams& p, int64_t num_tokens, int64_t num_slots,
                      cudaStream_t stream) {
  using LP = PrepSmem<kDk, kDv>;
  int stages = 2;
  cudaError_t err = ScanStages<kDk, kDv>(&stages);
  if (err != cudaSuccess) return err;
  err = cudaFuncSetAttribute(GdnPrepKernel<kDk, kDv>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(LP::kBytes));
  if (err != cudaSuccess) return err;
  const dim3 prep_grid(static_cast<unsigned>(num_slots), static_cast<unsigned>(p.num_v_heads));
  GdnPrepKernel<kDk, kDv><<<prep_grid, kPrepThreads, LP::kBytes, stream>>>(p);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if constexpr (kHasOneStageScan<kDk, kDv>) {
    if (stages == 1) return LaunchScan<kDk, kDv, 1>(p, stream);
  }
  return LaunchScan<kDk, kDv, 2>(p, stream);
}

template <int kDk>
cudaError_t DispatchDv(const GdnArgs& a, const GdnParams& p, int64_t slots, cudaStream_t s) {
  switch (a.value_dim) {
    case 16:
      return LaunchGdn<kDk, 16>(p, a.num_tokens, slots, s);
    case 32:
      return LaunchGdn<kDk, 32>(p, a.num_tokens, slots, s);
    case 64:
      return LaunchGdn<kDk, 64>(p, a.num_tokens, slots, s);
    case 128:
      return LaunchGdn<kDk, 128>(p, a.num_tokens, slots, s);
    default:
      return cudaErrorInvalidValue;
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

size_t GdnWorkspaceBytes(const GdnArgs& args) { return Layout(args).total; }

cudaError_t GdnScanStages(int64_t key_dim, int64_t value_dim, int* stages) {
  const auto dv = [&](auto dk) -> cudaError_t {
    constexpr int kDk = decltype(dk)::value;
    switch (value_dim) {
      case 16:
        return ScanStages<kDk, 16>(stages);
      case 32:
        return ScanStages<kDk, 32>(stages);
      case 64:
        return ScanStages<kDk, 64>(stages);
      case 128:
        return ScanStages<kDk, 128>(stages);
      default:
        return cudaErrorInvalidValue;
    }
  };
  switch (key_dim) {
    case 16:
      return dv(std::integral_constant<int, 16>{});
    case 32:
      return dv(std::integral_constant<int, 32>{});
    case 64:
      return dv(std::integral_constant<int, 64>{});
    case 128:
      return dv(std::integral_constant<int, 128>{});
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t GatedDeltaRule(const GdnArgs& args, void* workspace, cudaStream_t stream) {
  const GdnArgs& a = args;
  if (a.num_tokens < 0 || a.num_seqs <= 0 || a.num_k_heads <= 0 || a.num_v_heads <= 0 ||
      a.num_v_heads % a.num_k_heads != 0 || a.qkv_stride % 8 != 0 || !Aligned16(a.qkv) ||
      !Aligned16(a.out) || reinterpret_cast<uintptr_t>(workspace) % 256 != 0 ||
      a.qkv_stride < 2 * a.num_k_heads * a.key_dim + a.num_v_heads * a.value_dim) {
    return cudaErrorInvalidValue;
  }
  if (a.num_tokens == 0) return cudaSuccess;
  const WorkspaceLayout l = Layout(a);
  unsigned char* base = static_cast<unsigned char*>(workspace);
  GdnParams p;
  p.qkv = a.qkv;
  p.qkv_stride = a.qkv_stride;
  p.a = a.a;
  p.b = a.b;
  p.ab_stride = a.ab_stride;
  p.a_log = a.a_log;
  p.dt_bias = a.dt_bias;
  p.cu = a.cu_seqlens;
  p.num_seqs = a.num_seqs;
  p.num_k_heads = static_cast<int32_t>(a.num_k_heads);
  p.num_v_heads = static_cast<int32_t>(a.num_v_heads);
  p.out = a.out;
  p.ws.w = reinterpret_cast<bf16*>(base + l.w);
  p.ws.u = reinterpret_cast<bf16*>(base + l.u);
  p.ws.m = reinterpret_cast<bf16*>(base + l.m);
  p.ws.f = reinterpret_cast<float*>(base + l.f);
  const int64_t slots = NumSlots(a);
  switch (a.key_dim) {
    case 16:
      return DispatchDv<16>(a, p, slots, stream);
    case 32:
      return DispatchDv<32>(a, p, slots, stream);
    case 64:
      return DispatchDv<64>(a, p, slots, stream);
    case 128:
      return DispatchDv<128>(a, p, slots, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace draftfeed::cuda
