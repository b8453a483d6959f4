// Gated DeltaNet prefill, kernel 1 of the chunked gated delta rule (gdn.cu
// says what the two kernels compute): GdnPrepKernel, one block per (chunk,
// value head), all chunks at once.
#include <type_traits>

#include "kernels/gdn_chunked.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda::gdn_chunked {
namespace {

// ---------------------------------------------------------------------------
// Kernel 1: per (chunk slot, value head).

constexpr int kPrepWarps = 4;  // warp w owns chunk rows [16w, 16w + 16)
constexpr int kPrepThreads = 32 * kPrepWarps;

template <int kDk, int kDv>
struct PrepSmem {
  static constexpr int kQkLd = kDk + 8;  // bf16 row pitch: +16 B keeps ldmatrix conflict-free
  static constexpr int kVLd = kDv + 8;
  static constexpr int kFLd = kChunk + 1;  // fp32 row pitch of A
  // 𝒯's pitch, 8 mod 32: the products' fragment reads (rows g, g + 8 and
  // column pairs 2q) are 64-bit and conflict-free within each half-warp.
  static constexpr int kTLd = kChunk + 8;
  static constexpr size_t kQBytes = size_t{kChunk} * kQkLd * sizeof(bf16);
  static constexpr size_t kVBytes = size_t{kChunk} * kVLd * sizeof(bf16);
  static constexpr size_t kFBytes = size_t{kChunk} * kFLd * sizeof(float);
  static constexpr size_t kTBytes = size_t{kChunk} * kTLd * sizeof(float);
  // Lifetimes: q until the Gram products, then 𝒯 takes its place (the
  // region is sized for both); A until 𝒯 is done, then v (loaded only then)
  // takes its place. This keeps the 27B shape at 54 KB, four blocks per SM.
  static constexpr size_t kQRegion = kQBytes > kTBytes ? kQBytes : kTBytes;
  static constexpr size_t kAvBytes = kFBytes > kVBytes ? kFBytes : kVBytes;
  static constexpr size_t kQ = 0;
  static constexpr size_t kT = kQ;
  static constexpr size_t kK = kQ + kQRegion;
  static constexpr size_t kAv = kK + kQBytes;
  static constexpr size_t kVec = kAv + kAvBytes;
  // Per-row vectors: g→γ, β, ‖q‖⁻¹, ‖k‖⁻¹, U's and W's column factors.
  static constexpr int kNumVecs = 6;
  static constexpr size_t kBytes = kVec + size_t{kNumVecs} * kChunk * sizeof(float);
};

// out [64][kDim] = (𝒯·diag(col))·B, B [64][kDim] bf16 in shared memory with
// row pitch ld. 𝒯 is lower triangular, so row block rb (16 rows) has k-steps
// ks ≤ rb only: work 1, 2, 3, 4 for the four blocks. Warp w takes row blocks
// w and 3 − w (five k-steps either way) over half the columns (warps 0 and 1
// the first half, 3 and 2 the second), so the warps finish together; at
// kDim = 16 (one column block) warp w takes row block w. Each output keeps
// its sum order (ks ascending, hi before lo), so the split changes no bit.
// 𝒯·diag(col) is split into bf16 hi + lo, so with B exact in bf16 the
// products keep about fp32 accuracy.
template <int kDim>
__device__ __forceinline__ void TriangularProduct(const float* s_t, int t_ld, const float* col,
                                                  const bf16* s_b, int ld, bf16* out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q4 = lane & 3;
  constexpr bool kPaired = kDim >= 32;
  constexpr int kPpPerWarp = kPaired ? kDim / 32 : kDim / 16;
  const int pp0 = kPaired && warp >= 2 ? kDim / 32 : 0;
  const int rb0 = warp, rb1 = 3 - warp;
  // The warp's (row block, k-step) pairs as slots: block rb0's k-steps 0..rb0,
  // then (paired) block rb1's 0..rb1: five slots, or rb0 + 1 of four unpaired.
  // Slot indices stay compile-time so the fragments stay in registers.
  constexpr int kSlots = kPaired ? 5 : 4;
  const auto slot_block = [&](int sl) { return sl <= rb0 ? 0 : 1; };
  const auto slot_ks = [&](int sl) { return sl <= rb0 ? sl : sl - rb0 - 1; };
  const auto slot_used = [&](int sl) { return kPaired || sl <= rb0; };
  uint32_t a_hi[kSlots][4], a_lo[kSlots][4];
#pragma unroll
  for (int sl = 0; sl < kSlots; ++sl) {
    if (slot_used(sl)) {
      const int rb = slot_block(sl) == 0 ? rb0 : rb1, ks = slot_ks(sl);
#pragma unroll
      for (int reg = 0; reg < 4; ++reg) {
        const int r = 16 * rb + g + 8 * (reg & 1);
        const int s = 16 * ks + 2 * q4 + 8 * (reg >> 1);
        const float2 t = *reinterpret_cast<const float2*>(s_t + r * t_ld + s);
        const float2 c = *reinterpret_cast<const float2*>(col + s);
        SplitBf16(t.x * c.x, t.y * c.y, a_hi[sl][reg], a_lo[sl][reg]);
      }
    }
  }
#pragma unroll
  for (int pi = 0; pi < kPpPerWarp; ++pi) {
    const int pp = pp0 + pi;
    float acc0[2][4] = {}, acc1[2][4] = {};
#pragma unroll
    for (int sl = 0; sl < kSlots; ++sl) {
      if (slot_used(sl)) {
        uint32_t b[4];
        LdMatrixX4Trans(
            b, s_b + (16 * slot_ks(sl) + LdsmBTRow(lane)) * ld + 16 * pp + LdsmBTCol(lane));
        if (slot_block(sl) == 0) {
          Mma(acc0[0], a_hi[sl], b[0], b[1]);
          Mma(acc0[0], a_lo[sl], b[0], b[1]);
          Mma(acc0[1], a_hi[sl], b[2], b[3]);
          Mma(acc0[1], a_lo[sl], b[2], b[3]);
        } else {
          Mma(acc1[0], a_hi[sl], b[0], b[1]);
          Mma(acc1[0], a_lo[sl], b[0], b[1]);
          Mma(acc1[1], a_hi[sl], b[2], b[3]);
          Mma(acc1[1], a_lo[sl], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int bi = 0; bi < (kPaired ? 2 : 1); ++bi) {
      const int row0 = 16 * (bi == 0 ? rb0 : rb1);
      const float(&acc)[2][4] = bi == 0 ? acc0 : acc1;
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
  __syncthreads();  // A complete; q is dead from here (𝒯 takes its place)

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
      for (int r = 0; r < 16; ++r) s_t[(b0 + r) * L::kTLd + b0 + c] = x[r];
    }
  }
  __syncthreads();
  // Off-diagonal blocks, block column j by warp j, top to bottom:
  //   𝒯_ij = −𝒯_ii R_ij,  R_ij = Σ_{k=j}^{i−1} A_ik 𝒯_kj,
  // as 16×16×16 tensor-core products on fp32 operands split into bf16
  // hi + lo, summed as hi·hi + hi·lo + lo·hi: about 2^-16 relative, finer than
  // the bf16 U and W that 𝒯 feeds. As scalar FMAs from shared memory these
  // blocks were prep's largest consumer of shared-memory bandwidth. Everything
  // a warp reads besides the diagonal blocks it wrote itself, so only warp
  // barriers are needed. R_ij is staged in 𝒯_ij's own place.
  {
    const int j = warp;
    // A operand: the 16×16 fp32 block at `blk` (pitch ld), split.
    const auto load_a = [&](const float* blk, int ld, uint32_t(&hi)[4], uint32_t(&lo)[4]) {
#pragma unroll
      for (int reg = 0; reg < 4; ++reg) {
        const int r = g + 8 * (reg & 1), c = 2 * q4 + 8 * (reg >> 1);
        SplitBf16(blk[r * ld + c], blk[r * ld + c + 1], hi[reg], lo[reg]);
      }
    };
    // R += A·B over one k block, B the 16×16 fp32 block at `blk` (pitch
    // kTLd), both n-tiles of 8 columns.
    const auto mma3 = [&](float(&acc)[2][4], const uint32_t(&ah)[4], const uint32_t(&al)[4],
                          const float* blk) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        uint32_t bh[2], bl[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int k = 2 * q4 + 8 * h, n = 8 * nt + g;
          SplitBf16(blk[k * L::kTLd + n], blk[(k + 1) * L::kTLd + n], bh[h], bl[h]);
        }
        Mma(acc[nt], al, bh[0], bh[1]);
        Mma(acc[nt], ah, bl[0], bl[1]);
        Mma(acc[nt], ah, bh[0], bh[1]);
      }
    };
    // The accumulator's 16×16 block to `blk` (pitch kTLd), times `sign`.
    const auto store = [&](float* blk, const float(&acc)[2][4], float sign) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          *reinterpret_cast<float2*>(blk + (g + 8 * half) * L::kTLd + 8 * nt + 2 * q4) =
              make_float2(sign * acc[nt][2 * half], sign * acc[nt][2 * half + 1]);
        }
      }
    };
#pragma unroll 1
    for (int i = j + 1; i < 4; ++i) {
      float acc[2][4] = {};
#pragma unroll 1
      for (int k = j; k < i; ++k) {
        uint32_t ah[4], al[4];
        load_a(s_a + 16 * i * L::kFLd + 16 * k, L::kFLd, ah, al);
        mma3(acc, ah, al, s_t + 16 * k * L::kTLd + 16 * j);
      }
      float* dst = s_t + 16 * i * L::kTLd + 16 * j;
      store(dst, acc, 1.0f);
      __syncwarp();
      float acc2[2][4] = {};
      uint32_t th[4], tl[4];
      load_a(s_t + 16 * i * L::kTLd + 16 * i, L::kTLd, th, tl);
      mma3(acc2, th, tl, dst);
      __syncwarp();
      store(dst, acc2, -1.0f);
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
  TriangularProduct<kDk>(s_t, L::kTLd, s_colw, s_k, L::kQkLd, p.ws.w + item * kChunk * kDk);
  CpAsyncWait<0>();
  __syncthreads();
  TriangularProduct<kDv>(s_t, L::kTLd, s_colu, s_v, L::kVLd, p.ws.u + item * kChunk * kDv);
}

}  // namespace

template <int kDk, int kDv>
cudaError_t LaunchPrep(const GdnParams& p, int64_t num_slots, cudaStream_t stream) {
  using LP = PrepSmem<kDk, kDv>;
  cudaError_t err =
      cudaFuncSetAttribute(GdnPrepKernel<kDk, kDv>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(LP::kBytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(num_slots), static_cast<unsigned>(p.num_v_heads));
  GdnPrepKernel<kDk, kDv><<<grid, kPrepThreads, LP::kBytes, stream>>>(p);
  return cudaGetLastError();
}

// The head dims gdn.cu dispatches: key and value dims of 16, 32, 64, 128.
#define DF_GDN_PREP(DK, DV) \
  template cudaError_t LaunchPrep<DK, DV>(const GdnParams&, int64_t, cudaStream_t);
#define DF_GDN_PREP_DV(DK) \
  DF_GDN_PREP(DK, 16) DF_GDN_PREP(DK, 32) DF_GDN_PREP(DK, 64) DF_GDN_PREP(DK, 128)
DF_GDN_PREP_DV(16)
DF_GDN_PREP_DV(32)
DF_GDN_PREP_DV(64)
DF_GDN_PREP_DV(128)
#undef DF_GDN_PREP_DV
#undef DF_GDN_PREP

}  // namespace draftfeed::cuda::gdn_chunked
