// The work of hopper_gemm_kernel.cuh's kernel: its tile and shared-memory
// constants, the modes, the parameters the launchers fill in, and the
// decoding of a work-item number into a tile's rows, weight rows, scales and
// output columns. Internal to kernels/, included by that kernel only; the
// design is in its header comment.
#pragma once

#include <cstdint>

#include "kernels/common.cuh"

namespace draftfeed::cuda::hopper {

constexpr int kBM = 128, kBN = 256, kBK = 128;
constexpr int kStages = 4;
constexpr int kMathThreads = 256, kLoadThreads = 128;
constexpr int kThreads = kMathThreads + kLoadThreads;
constexpr int kGroupM = 16;
constexpr uint32_t kABytes = kBM * kBK, kBHalfBytes = 128 * kBK, kBBytes = 2 * kBHalfBytes;
// A stage's activation scales: TMA needs a box's innermost start 16-byte
// aligned, so it loads kScaleBox rows from the item's first row rounded down
// to a multiple of 4 (a MoE tile starts anywhere); the stage's slot is padded
// to keep the next one 128-byte aligned.
constexpr int kScaleBox = kBM + 8;
constexpr uint32_t kScaleBytes = 640;
static_assert(kScaleBox * 4 <= kScaleBytes && kScaleBytes % 128 == 0, "scale slot");
// The epilogue stages a warp's outputs 16 rows x 64 columns (128 bytes a
// row) at a time, so that its global stores are whole 128-byte lines.
constexpr int kEpiWarpBytes = 16 * 128;
constexpr uint32_t kBarBytes = 128;  // 2·kStages mbarriers, padded
static_assert(2 * kStages * 8 <= kBarBytes, "mbarrier slot");
// Stages, mbarriers, the 8 math warps' epilogue blocks, slack to align the
// base to 1024 (128B swizzle).
constexpr int kSmemBytes = kStages * (kABytes + kBBytes + kScaleBytes) + kBarBytes +
                           (kMathThreads / 32) * kEpiWarpBytes + 1024;
static_assert(kSmemBytes <= 227 * 1024, "fits the opt-in shared memory of sm_90");
// The loader warpgroup gives registers to the math ones (setmaxnreg).
constexpr int kLoadRegs = 56, kMathRegs = 224;
static_assert(kLoadThreads * kLoadRegs + kMathThreads * kMathRegs <= 64 * 1024,
              "setmaxnreg budget");

// kDense: Y = X·Wᵀ over an M x N grid of tiles. The grouped forms walk
// MoePermute's tile map (tile = up to 128 expert-sorted rows of one expert)
// times column tiles: kMoeDown reads its rows of A in place (TMA); kMoeGateUp
// gathers them (each sorted row is token row_token[r] of X, copied by the
// loader warpgroup with cp.async) and reads gate rows c0.. and up rows
// I + c0.. of the expert as its two weight halves, so that a thread holds
// gate and up of the same output and writes SiLU(gate)·up.
// kDenseGateUp: the dense MLP's [gate; up] projection read as kMoeGateUp
// reads an expert's (gate rows c0.., up rows F + c0..), X by TMA as kDense
// does, and only act8 written: SiLU(gate)·up quantized for down.
enum class Mode { kDense, kMoeDown, kMoeGateUp, kDenseGateUp };

struct Params {
  bf16* y;
  int64_t ldy;
  bool y_vec16;  // y and ldy let every row take 16-byte stores (else 4-byte ones)
  const float* w_scale;
  int64_t w_scale_stride;
  int m;  // dense: rows (m_pad)
  int n;  // output columns
  int m_blocks, n_blocks, k_blocks, tiles;
  int n_scale_rows;  // dense: ceil(n / 128)
  // Grouped forms.
  const int4* tile_map;
  int64_t w_rows_per_expert;      // D (down) or 2I (gate_up)
  int64_t w_scale_expert_stride;  // floats between experts' block scales
  // kMoeGateUp's gather: X's rows x_row_bytes apart (e4m3 or bf16), FP8's
  // scales [k/128][x_scale_stride] by token.
  const uint8_t* x;
  int64_t x_row_bytes;
  const float* x_scale;
  int64_t x_scale_stride;
  const int32_t* row_token;
  // kMoeGateUp, optionally, and kDenseGateUp: act also quantized for the down
  // GEMM, act8_rows rows of n e4m3 with scales [n/128][act8_rows_pad]
  // (fp8_gemm_operands.cuh's layout). kDenseGateUp writes no bf16 (y null).
  uint8_t* act8;
  float* act8_scale;
  int64_t act8_rows, act8_rows_pad;
};

// One work item: a 128-row x 256-column (gate_up: 128 gate + 128 up) tile.
struct Work {
  bool valid;
  int a_row;           // first row of A (dense, down) / of the sorted rows (gate_up)
  int rows;            // rows of A that are this tile's (the rest are not stored)
  int b_row0, b_row1;  // first W row of each 128-row half
  const float* ws0;    // each half's weight-block scales (row of K blocks)
  const float* ws1;    // null: half 1 is past n (scale 0)
  int out_col;
};

[[maybe_unused]] __device__ __forceinline__ void TileCoords(int t, const Params& p, int* mb,
                                                            int* nb) {
  const int per_group = kGroupM * p.n_blocks;
  const int first = (t / per_group) * kGroupM, within = t % per_group;
  const int rows = min(kGroupM, p.m_blocks - first);
  *mb = first + within % rows;
  *nb = within / rows;
}

template <Mode kMode>
[[maybe_unused]] __device__ __forceinline__ Work Decode(int t, const Params& p) {
  Work w;
  const int64_t stride = p.w_scale_stride;
  if constexpr (kMode == Mode::kDenseGateUp) {
    int mb, nb;
    TileCoords(t, p, &mb, &nb);  // n_blocks: F / 128 column tiles
    w.valid = true;
    w.a_row = mb * kBM;
    w.rows = p.m - w.a_row;
    w.b_row0 = nb * 128;
    w.b_row1 = p.n + nb * 128;  // the up rows start at F
    w.ws0 = p.w_scale + nb * stride;
    w.ws1 = p.w_scale + (p.n / 128 + nb) * stride;
    w.out_col = nb * 128;
  } else if constexpr (kMode == Mode::kDense) {
    int mb, nb;
    TileCoords(t, p, &mb, &nb);
    w.valid = true;
    w.a_row = mb * kBM;
    w.rows = p.m - w.a_row;
    w.b_row0 = nb * kBN;
    w.b_row1 = w.b_row0 + 128;
    w.ws0 = p.w_scale + 2 * nb * stride;
    w.ws1 = 2 * nb + 1 < p.n_scale_rows ? w.ws0 + stride : nullptr;
    w.out_col = nb * kBN;
  } else {
    const int4 e = p.tile_map[t / p.n_blocks];
    const int nt = t % p.n_blocks;
    w.valid = e.x >= 0;
    w.a_row = e.y;
    w.rows = e.z - e.y;
    const float* wse = p.w_scale + e.x * p.w_scale_expert_stride;
    const int w0 = static_cast<int>(e.x * p.w_rows_per_expert);
    if constexpr (kMode == Mode::kMoeDown) {
      w.b_row0 = w0 + nt * kBN;
      w.b_row1 = w.b_row0 + 128;
      w.ws0 = wse + 2 * nt * stride;
      w.ws1 = nt * kBN + 128 < p.n ? w.ws0 + stride : nullptr;
      w.out_col = nt * kBN;
    } else {
      const int c0 = nt * 128;
      w.b_row0 = w0 + c0;
      w.b_row1 = w0 + p.n + c0;  // the up rows start at I
      w.ws0 = wse + (c0 / 128) * stride;
      w.ws1 = wse + ((p.n + c0) / 128) * stride;
      w.out_col = c0;
    }
  }
  return w;
}

}  // namespace draftfeed::cuda::hopper
