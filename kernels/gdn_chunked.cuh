// Internal to the chunked gated delta rule (gdn_prep.cu writes the chunk
// workspace; the scans, gdn.cu's and gdn_scan_wgmma.cu's, read it): the chunk
// constants, the workspace layout, the kernels' parameters, the helpers the
// kernels share, and the launchers of the prep kernel and the wgmma scan. Not
// part of the kernels' interface (gdn.cuh).
#pragma once

#include <cstring>

#include "kernels/gdn.cuh"
#include "kernels/mma_sm80.cuh"

namespace draftfeed::cuda::gdn_chunked {

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

// A warp's chunk output, staged in shared memory as [64 tokens][16 value dims]
// (row pitch ld), to out [token][head][dv] at columns col0..col0+15 of rows
// t0.. : 16-byte stores of whole 32-byte row pieces; rows n.. (past the
// sequence end) are not written. Both scans end a chunk with it.
__device__ __forceinline__ void StoreStagedOutput(const bf16* s_o, int ld, bf16* out, int64_t t0,
                                                  int n, int num_v_heads, int head, int dv,
                                                  int col0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int it = 0; it < kChunk / 16; ++it) {
    const int r = 16 * it + (lane >> 1), half = lane & 1;
    if (r < n) {
      const uint4 v = *reinterpret_cast<const uint4*>(s_o + r * ld + 8 * half);
      *reinterpret_cast<uint4*>(out + ((t0 + r) * num_v_heads + head) * dv + col0 + 8 * half) = v;
    }
  }
}

// Where a scan thread's state element lives in GdnArgs' [Nv][dk][dv] state:
// element e of accumulator n-tile nt (key dims 8nt + 2q + (e & 1), value dim
// col0 + g + 8(e >> 1), q = lane % 4, g = lane / 4) of head `head`. Both scans
// keep Sᵀ in this mma fragment layout.
__device__ __forceinline__ int64_t StateOffset(int head, int dk, int dv, int col0, int nt, int e) {
  const int lane = threadIdx.x & 31;
  return (static_cast<int64_t>(head) * dk + 8 * nt + 2 * (lane & 3) + (e & 1)) * dv + col0 +
         (lane >> 2) + 8 * (e >> 1);
}

// ---------------------------------------------------------------------------
// Gated delta rule: workspace.

// Chunk slots: chunk c of sequence s lives in slot s + ⌊cu[s]/64⌋ + c. That
// is injective (a sequence's chunks end before the next sequence's slots
// begin) and below num_seqs + ⌈T/64⌉, so no prefix sum over the device
// cu_seqlens is needed. A few slots stay unused.
__host__ __device__ __forceinline__ int64_t FirstSlot(int32_t seq, int32_t seq_begin) {
  return seq + seq_begin / kChunk;
}

inline int64_t NumSlots(const GdnArgs& a) {
  return a.num_seqs + (a.num_tokens + kChunk - 1) / kChunk;
}

inline size_t AlignUp(size_t n) { return (n + 255) / 256 * 256; }

struct Workspace {
  bf16* w;   // [slot][Nv][64][dk]
  bf16* u;   // [slot][Nv][64][dv]
  bf16* m;   // [slot][Nv][64][64], lower triangle with diagonal
  float* f;  // [slot][Nv][kFactorFloats]
};

struct WorkspaceLayout {
  size_t w, u, m, f, total;
};

inline WorkspaceLayout Layout(const GdnArgs& a) {
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
  const float* initial_state;  // GdnArgs'; read by the scan's sequence-0 blocks
  float* final_state;          // written by its last sequence's blocks
};

// Kernel 1 (gdn_prep.cu), one block per (chunk slot, value head): the gates,
// norms, Gram matrices, 𝒯 and the U, W, M and row factors of every chunk.
template <int kDk, int kDv>
cudaError_t LaunchPrep(const GdnParams& p, int64_t num_slots, cudaStream_t stream);

// Kernel 2 on wgmma (gdn_scan_wgmma.cu), for key dim 128 and value dims a
// multiple of 64: available where the loaded binary is sm_90a SASS and the
// portable-kernel mode allows Hopper's own kernels.
template <int kDk, int kDv>
inline constexpr bool kHasWgmmaScan = kDk == 128 && kDv % 64 == 0;
bool WgmmaScanAvailable();
inline constexpr int kWgmmaScanStages = 3;
template <int kDv>
cudaError_t LaunchWgmmaScan(const GdnParams& p, cudaStream_t stream);

}  // namespace draftfeed::cuda::gdn_chunked
