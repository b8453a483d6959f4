// Mixture-of-experts MLP on the GPU, entirely device-side (no host round trip
// per layer): top-k routing from router logits, the permutation of (token,
// slot) pairs into expert-sorted rows, the grouped expert GEMMs over those
// rows (kernels/moe_gemm.cu), and the weighted un-permute added into the fp32
// residual stream. The call sequence of one MoE layer:
//
//   MoeTopK(logits) -> expert_ids, weights        [T, k]
//   MoePermute(expert_ids) -> MoeRouting          (offsets, tile map, rows)
//   MoeGateUpSwiGlu(x, rows) -> act               [T·k, I] expert-sorted
//   MoeDown(act) -> y                             [T·k, D] expert-sorted
//   MoeCombine(y, weights [, shared expert]) -> residual += ...
//
// Every buffer is carved once from MoeWorkspaceBytes(max_tokens, ...), the
// worst case (every token to the same k experts), so no routing overflows it.
#pragma once

#include "kernels/common.cuh"
#include "kernels/fp8_gemm_operands.cuh"

namespace draftfeed::cuda {

// Expert-sorted rows per grouped-GEMM tile: each expert's rows are cut into
// tiles of this many (the last one partial), and one tile never spans two
// experts.
inline constexpr int kMoeTileRows = 128;
inline constexpr int kMoeMaxExperts = 512;
inline constexpr int kMoeMaxTopK = 16;

// Per token t: p = softmax(logits[t, 0..E)) in fp32, the k largest p in
// descending order (an exact tie goes to the lower expert id), optionally
// renormalised to sum to 1. logits rows are logits_stride elements apart
// (the router GEMM's output may carry more columns, e.g. the shared expert's
// gate). Requires 1 <= k <= min(E, kMoeMaxTopK), E <= kMoeMaxExperts.
cudaError_t MoeTopK(const bf16* logits, int64_t logits_stride, int64_t num_tokens, int num_experts,
                    int top_k, bool renormalize, int32_t* expert_ids, float* weights,
                    cudaStream_t stream);
cudaError_t MoeTopK(const float* logits, int64_t logits_stride, int64_t num_tokens, int num_experts,
                    int top_k, bool renormalize, int32_t* expert_ids, float* weights,
                    cudaStream_t stream);

// The device state that ties the routing to the grouped GEMMs and the
// combine. Rows are the T·k (token, slot) pairs sorted by expert: expert e
// owns rows [offsets[e], offsets[e+1]), its pairs in unspecified order
// (global atomics place them; each row's GEMM result depends only on its own
// inputs, so outputs do not depend on that order).
struct MoeRouting {
  int32_t* counts = nullptr;        // [E] rows per expert
  int32_t* offsets = nullptr;       // [E + 1]
  int32_t* tile_offsets = nullptr;  // [E + 1] expert e's tiles: [tile_offsets[e], ..[e+1])
  int32_t* tile_map = nullptr;   // [max_tiles][4]: expert, first row, end row, 0; expert -1: idle
  int32_t* pair_row = nullptr;   // [T·k] the row of pair t·k + j
  int32_t* row_token = nullptr;  // [T·k] the token of each row
  int64_t max_tiles = 0;         // tile_map's capacity: MoeMaxTiles(max_tokens·k, E)
};

// Upper bound of Σ_e ⌈rows_e / kMoeTileRows⌉ over every routing of `rows`
// rows to `num_experts` experts.
int64_t MoeMaxTiles(int64_t rows, int64_t num_experts);

// Everything one MoE layer's launches use, for up to max_tokens tokens.
struct MoeBuffers {
  int32_t* expert_ids = nullptr;  // [T, k]
  float* weights = nullptr;       // [T, k]
  MoeRouting routing;
  bf16* act = nullptr;  // [T·k, I] the SwiGLU activations, expert-sorted
  bf16* y = nullptr;    // [T·k, D] the experts' outputs, expert-sorted
};
// Its bytes, and its layout over `base` (256-byte aligned, at least
// MoeWorkspaceBytes long). Every routing of max_tokens tokens fits: there are
// always T·k rows, and max_tiles bounds the tiles of the most uneven split.
size_t MoeWorkspaceBytes(int64_t max_tokens, int num_experts, int top_k, int64_t hidden,
                         int64_t inter);
MoeBuffers CarveMoeWorkspace(void* base, int64_t max_tokens, int num_experts, int top_k,
                             int64_t hidden, int64_t inter);

// Groups the pairs by expert: fills every MoeRouting array for num_tokens
// tokens (the tile map's first MoeMaxTiles(num_tokens·k, E) entries, which
// must fit in routing.max_tiles). Ids outside [0, E) are dropped (their
// pair_row is -1 and they add nothing).
cudaError_t MoePermute(const int32_t* expert_ids, int64_t num_tokens, int num_experts, int top_k,
                       const MoeRouting& routing, cudaStream_t stream);

// Expert parallelism: a rank that holds experts [begin, begin + count) maps
// each of the n routed ids to its local index (id - begin), and every other
// id to -1, which MoePermute drops, so the rank's grouped GEMMs and combine
// see only the pairs routed to its experts.
cudaError_t MoeKeepLocalExperts(int32_t* expert_ids, int64_t n, int begin, int count,
                                cudaStream_t stream);

// The grouped GEMMs run over the num_rows = T·k rows MoePermute sorted, one
// block per (tile, column tile) of MoeMaxTiles(num_rows, E) tiles; blocks
// of tiles past the routing's last exit at once.
//
// act[r] = SiLU(x_t·Wg_eᵀ) ⊙ (x_t·Wu_eᵀ), bf16, for every expert-sorted row r
// of expert e, t = row_token[r]: x rows x_stride elements apart ([T, D]);
// gate_up: [E, 2I, D] (per expert rows [0, I) gate, [I, 2I) up); act: [T·k,
// I] dense. fp32 accumulation, the SwiGLU in fp32 on the unrounded
// products, one rounding. D, I and x_stride must be multiples of 8 and x,
// gate_up, act 16-byte aligned (cudaErrorInvalidValue otherwise).
cudaError_t MoeGateUpSwiGlu(const bf16* x, int64_t x_stride, const bf16* gate_up, int64_t hidden,
                            int64_t inter, int num_experts, int64_t num_rows,
                            const MoeRouting& routing, bf16* act, cudaStream_t stream);

// y[r] = act[r]·Wd_eᵀ for every expert-sorted row r of expert e: act [T·k,
// I] dense, down [E, D, I], y [T·k, D] dense; fp32 accumulation, bf16 out.
// Same alignment rules as MoeGateUpSwiGlu.
cudaError_t MoeDown(const bf16* act, const bf16* down, int64_t hidden, int64_t inter,
                    int num_experts, int64_t num_rows, const MoeRouting& routing, bf16* y,
                    cudaStream_t stream);

// The same two GEMMs on fine-grained FP8 operands (fp8_gemm_operands.cuh's
// layouts): x quantized per token and 128 group ([T_pad, D] e4m3, scales
// [D/128][x_scale_stride] indexed by token, gathered through the routing),
// act quantized likewise per expert-sorted row ([rows, I], scales
// [I/128][act_scale_stride]); weights e4m3 [E, 2I, D] / [E, D, I] with fp32
// block scales of row stride Fp8ScaleStride(K), experts
// ⌈rows/128⌉·stride apart. Requires D and I multiples of kMoeFp8Block.
// gate_up with act8 set (16-byte aligned) also writes act quantized for down
// ([pad4(rows), I], scales [I/128][pad4(rows)]): bit for bit
// QuantizeActivationsFp8 of act, from its epilogue where the Hopper kernel
// runs (which then leaves act itself unwritten: down reads act8 only), else
// by that quantizer from act.
inline constexpr int kMoeFp8Block = 128;
cudaError_t MoeGateUpSwiGluFp8(const uint8_t* xq, const float* x_scale, int64_t x_scale_stride,
                               const uint8_t* gate_up, const float* gate_up_scale, int64_t hidden,
                               int64_t inter, int num_experts, int64_t num_rows,
                               const MoeRouting& routing, bf16* act, cudaStream_t stream,
                               Fp8Activations act8 = {});
cudaError_t MoeDownFp8(const uint8_t* actq, const float* act_scale, int64_t act_scale_stride,
                       const uint8_t* down, const float* down_scale, int64_t hidden, int64_t inter,
                       int num_experts, int64_t num_rows, const MoeRouting& routing, bf16* y,
                       cudaStream_t stream);

// residual[t] += Σ_j weights[t, j]·y[pair_row[t·k + j]]
//              (+ sigmoid(shared_gate[t·gate_stride])·shared[t·shared_stride]),
// all in fp32 (the MoE output is not rounded to bf16 before the add). Without
// a shared expert pass shared = shared_gate = nullptr. residual: [T, D]
// dense.
cudaError_t MoeCombine(const bf16* y, const int32_t* pair_row, const float* weights,
                       int64_t num_tokens, int top_k, int64_t hidden, const bf16* shared,
                       int64_t shared_stride, const bf16* shared_gate, int64_t gate_stride,
                       float* residual, cudaStream_t stream);

}  // namespace draftfeed::cuda
