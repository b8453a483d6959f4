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
// This file holds the mma.sync scan kernel and the family's launchers; the
// prep kernel is gdn_prep.cu; the scan on wgmma (sm_90a, dk = 128, the same
// products in the same order, so the same bits) is gdn_scan_wgmma.cu; what
// they share (the chunk constants, the workspace prep writes and the scans
// read, GdnParams, the ldmatrix lane maps) is gdn_chunked.cuh.
#include "kernels/gdn.cuh"

#include <cstring>
#include <type_traits>

#include "kernels/gdn_chunked.cuh"
#include "kernels/kernel_paths.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

using gdn_chunked::CpAsync16;
using gdn_chunked::CpAsyncCommit;
using gdn_chunked::CpAsyncWait;
using gdn_chunked::FirstSlot;
using gdn_chunked::GdnParams;
using gdn_chunked::kChunk;
using gdn_chunked::kFactorFloats;
using gdn_chunked::LaunchPrep;
using gdn_chunked::Layout;
using gdn_chunked::LdMatrixX4;
using gdn_chunked::LdMatrixX4Trans;
using gdn_chunked::LdsmACol;
using gdn_chunked::LdsmARow;
using gdn_chunked::LdsmBNCol;
using gdn_chunked::LdsmBNRow;
using gdn_chunked::LdsmBTCol;
using gdn_chunked::LdsmBTRow;
using gdn_chunked::Mma;
using gdn_chunked::NumSlots;
using gdn_chunked::PackBf16;
using gdn_chunked::SmemAddr;
using gdn_chunked::StateOffset;
using gdn_chunked::StoreStagedOutput;
using gdn_chunked::UnpackBf16;
using gdn_chunked::WorkspaceLayout;

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
  // This thread's state elements in GdnArgs' [Nv][dk][dv] layout.
  const auto state_index = [&](int nt, int e) {
    return StateOffset(head, kDk, kDv, slice0 + d0, nt, e);
  };
  if (seq == 0 && p.initial_state != nullptr) {
#pragma unroll
    for (int nt = 0; nt < kDk / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st_acc[nt][e] = p.initial_state[state_index(nt, e)];
    }
  }

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
      StoreStagedOutput(s_o, L::kOLd, p.out, t0, n, p.num_v_heads, head, kDv, slice0 + d0);
      __syncwarp();
    }
    __syncthreads();  // this stage is refilled two chunks on (one stage: now)
    if constexpr (kStages == 1) {
      if (c + 1 < num_chunks) load_chunk(c + 1);
      CpAsyncCommit();
    }
  }
  CpAsyncWait<0>();
  // A padded row of the last chunk adds nothing (kf = 0) and decays nothing
  // (g = 0), so this is the state after the sequence's last token.
  if (seq == p.num_seqs - 1 && p.final_state != nullptr) {
#pragma unroll
    for (int nt = 0; nt < kDk / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) p.final_state[state_index(nt, e)] = st_acc[nt][e];
    }
  }
}

// Whether (dk, dv) has a one-stage scan: only where two stages are more than
// the smallest supported GPU's shared memory (kernels/kernel_paths.cuh).
template <int kDk, int kDv>
constexpr bool kHasOneStageScan = ScanSmem<kDk, kDv, 2>::kBytes > kSm120SmemPerBlock;

// The wgmma scan where it takes the dims and the binary and mode allow it;
// else the mma.sync scan, two stages where they fit in the device's shared
// memory, one where not.
template <int kDk, int kDv>
cudaError_t ScanPath(GdnScanPath* path) {
  if constexpr (gdn_chunked::kHasWgmmaScan<kDk, kDv>) {
    if (gdn_chunked::WgmmaScanAvailable()) {
      *path = {true, gdn_chunked::kWgmmaScanStages};
      return cudaSuccess;
    }
  }
  int limit = 0;
  const cudaError_t err = SmemPerBlockLimit(&limit);
  if (err != cudaSuccess) return err;
  const bool two =
      ScanSmem<kDk, kDv, 2>::kBytes <= static_cast<size_t>(limit) || !kHasOneStageScan<kDk, kDv>;
  *path = {false, two ? 2 : 1};
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
cudaError_t LaunchGdn(const GdnParams& p, int64_t num_slots, cudaStream_t stream) {
  GdnScanPath path;
  cudaError_t err = ScanPath<kDk, kDv>(&path);
  if (err != cudaSuccess) return err;
  if ((err = LaunchPrep<kDk, kDv>(p, num_slots, stream)) != cudaSuccess) return err;
  if constexpr (gdn_chunked::kHasWgmmaScan<kDk, kDv>) {
    if (path.wgmma) return gdn_chunked::LaunchWgmmaScan<kDv>(p, stream);
  }
  if constexpr (kHasOneStageScan<kDk, kDv>) {
    if (path.stages == 1) return LaunchScan<kDk, kDv, 1>(p, stream);
  }
  return LaunchScan<kDk, kDv, 2>(p, stream);
}

// fn(integral_constant<kDk>, integral_constant<kDv>) for the head dims the
// kernels are built for (16, 32, 64, 128 each); cudaErrorInvalidValue else.
template <typename Fn>
cudaError_t WithHeadDims(int64_t key_dim, int64_t value_dim, Fn&& fn) {
  const auto dv = [&](auto dk) -> cudaError_t {
    switch (value_dim) {
      case 16:
        return fn(dk, std::integral_constant<int, 16>{});
      case 32:
        return fn(dk, std::integral_constant<int, 32>{});
      case 64:
        return fn(dk, std::integral_constant<int, 64>{});
      case 128:
        return fn(dk, std::integral_constant<int, 128>{});
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

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

size_t GdnWorkspaceBytes(const GdnArgs& args) { return Layout(args).total; }

cudaError_t ChooseGdnScanPath(int64_t key_dim, int64_t value_dim, GdnScanPath* path) {
  return WithHeadDims(key_dim, value_dim, [&](auto dk, auto dv) {
    return ScanPath<decltype(dk)::value, decltype(dv)::value>(path);
  });
}

cudaError_t GatedDeltaRule(const GdnArgs& args, void* workspace, cudaStream_t stream) {
  const GdnArgs& a = args;
  if (a.num_tokens < 0 || a.num_seqs <= 0 || a.num_k_heads <= 0 || a.num_v_heads <= 0 ||
      a.num_v_heads % a.num_k_heads != 0 || a.qkv_stride % 8 != 0 || !Aligned16(a.qkv) ||
      !Aligned16(a.out) || reinterpret_cast<uintptr_t>(workspace) % 256 != 0 ||
      a.qkv_stride < 2 * a.num_k_heads * a.key_dim + a.num_v_heads * a.value_dim) {
    return cudaErrorInvalidValue;
  }
  // The last sequence's blocks write final_state while sequence 0's may not
  // have read initial_state yet: only one block per state slice may own both.
  const size_t state_bytes =
      static_cast<size_t>(a.num_v_heads * a.key_dim * a.value_dim) * sizeof(float);
  const uintptr_t in_begin = reinterpret_cast<uintptr_t>(a.initial_state);
  const uintptr_t out_begin = reinterpret_cast<uintptr_t>(a.final_state);
  if (a.initial_state != nullptr && a.final_state != nullptr && a.num_seqs > 1 &&
      in_begin < out_begin + state_bytes && out_begin < in_begin + state_bytes) {
    return cudaErrorInvalidValue;
  }
  if (a.num_tokens == 0) {  // every sequence empty: the state passes through
    if (a.final_state == nullptr) return cudaSuccess;
    if (a.initial_state != nullptr && a.num_seqs == 1) {
      return a.initial_state == a.final_state
                 ? cudaSuccess
                 : cudaMemcpyAsync(a.final_state, a.initial_state, state_bytes,
                                   cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemsetAsync(a.final_state, 0, state_bytes, stream);
  }
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
  p.initial_state = a.initial_state;
  p.final_state = a.final_state;
  const int64_t slots = NumSlots(a);
  return WithHeadDims(a.key_dim, a.value_dim, [&](auto dk, auto dv) {
    return LaunchGdn<decltype(dk)::value, decltype(dv)::value>(p, slots, stream);
  });
}

}  // namespace draftfeed::cuda
