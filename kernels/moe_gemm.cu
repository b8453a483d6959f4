// The grouped expert GEMMs of the MoE family (declared in moe.cuh): every
// expert's rows in one launch, on the tensor cores (mma.sync m16n8k16, bf16
// in, fp32 accumulate).
//
// Design. MoePermute sorts the T·k (token, slot) rows by expert and writes a
// tile map: tile i is kMoeTileRows (128) consecutive rows of one expert (an
// expert's last tile partial), with the expert id and row range. A block
// computes one 128-row tile × one column tile; blockIdx.x = tile·n_tiles +
// column tile, so the blocks resident at once are a few tiles of the same
// expert across all its columns: each gathered activation tile and each
// expert's weights are read from HBM about once and then hit in L2. The grid
// is sized from the worst case (MoeMaxTiles), blocks past the routing's last
// tile exit at once, so nothing waits on the host.
//
// Per block: 128 × 128 outputs, K in steps of 128 bytes (64 bf16 or 128
// e4m3) through a 3-stage cp.async pipeline (rows of 128 bytes in shared
// memory, 16-byte chunks XOR-swizzled by row so ldmatrix is conflict-free);
// 8 warps as 2 × 4, each 64 × 32.
//
// On Hopper both forms take hopper_gemm.cu's wgmma kernel instead (bf16 where
// D and I are multiples of 128). FP8 (fine-grained checkpoints) elsewhere:
// the same tiles in bytes, mma.sync
// m16n8k32 e4m3 (whose fragments are what the same ldmatrix calls load from
// 32-byte K steps), and one K step of 128 values is exactly one scale block:
// its partial sums are folded into the fp32 accumulator times the row's
// activation scale and the weight block's scale, as the block-scaled GEMM
// defines (acc += Σ_g partial_g · s_x[row, g] · S_w[n / 128, g]). The gate_up GEMM gathers its A
// rows (the tokens) through row_token and interleaves its B rows so that each warp's 32 columns are
// 16 gate rows and the 16 matching up rows: a thread then holds gate and up of the same output in
// registers and writes SiLU(gate)·up directly (the [rows, 2I] product never reaches memory). Rows
// and columns past the tile's end load zeros (cp.async zero-fill) and are not stored.
#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/hopper_gemm.cuh"
#include "kernels/mma_sm80.cuh"
#include "kernels/moe.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

using sm80::CpAsync16;
using sm80::CpAsyncCommit;
using sm80::CpAsyncWait;
using sm80::LdMatrixX4;
using sm80::Mma;
using sm80::MmaE4m3;
using sm80::SmemAddr;
using sm80::Swizzle128;

constexpr int kBM = kMoeTileRows;
constexpr int kBN = 128;        // B rows (output columns, or gate + up columns) per block
constexpr int kRowBytes = 128;  // K step: bytes of one smem row
constexpr int kChunks = kRowBytes / 16;
constexpr int kStages = 3;
constexpr int kThreads = 256;
constexpr int kLoadRows = kThreads / kChunks;  // rows one pass of 16-byte chunks covers
constexpr int kLoadsPerThread = kBM / kLoadRows;
constexpr int kSmemBytes = kStages * (kBM + kBN) * kRowBytes;
static_assert(kBM == kBN && kBM % kLoadRows == 0, "one load loop covers A and B");
static_assert(kRowBytes == kMoeFp8Block, "an FP8 K step is one scale block");
static_assert(kRowBytes == 128, "stage rows are Swizzle128's");

enum class Epilogue { kSwiGlu, kPlain };

struct GemmParams {
  const void* a;  // A rows (bf16 or e4m3): a + row·a_stride elements
  int64_t a_stride;
  const int32_t* a_rows;    // gather: A row of sorted row r is a_rows[r]; null: r itself
  const void* w;            // [E][w_rows][k]
  int64_t w_expert_stride;  // w_rows·k
  // FP8 only: A's scale of (row, K block g) at a_scale[g·a_scale_stride + row]
  // (row as gathered), and expert e's weight block (nb, g) at
  // w_scale[e·w_scale_expert_stride + nb·w_scale_stride + g].
  const float* a_scale = nullptr;
  int64_t a_scale_stride = 0;
  const float* w_scale = nullptr;
  int64_t w_scale_stride = 0, w_scale_expert_stride = 0;
  int64_t k;
  int64_t n;      // output columns: I (SwiGLU) or D (plain)
  int64_t inter;  // SwiGLU: the up rows start at w row `inter`
  int n_tiles;
  const int4* tile_map;
  bf16* out;  // [rows][out_stride]
  int64_t out_stride;
};

template <Epilogue kEpilogue, bool kFp8>
__global__ void __launch_bounds__(kThreads, kFp8 ? 1 : 2) GroupedGemmKernel(GemmParams p) {
  constexpr int kElemBytes = kFp8 ? 1 : 2;
  constexpr int kBK = kRowBytes / kElemBytes;  // K elements a step
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* const sa = smem;
  unsigned char* const sb = sa + kStages * kBM * kRowBytes;
  const char* const a_base = static_cast<const char*>(p.a);

  const int64_t tile = blockIdx.x / p.n_tiles;
  const int n_tile = static_cast<int>(blockIdx.x % p.n_tiles);
  const int4 entry = p.tile_map[tile];
  if (entry.x < 0) return;
  const int64_t row0 = entry.y;
  const int rows = entry.z - entry.y;
  const char* const w = static_cast<const char*>(p.w) + entry.x * p.w_expert_stride * kElemBytes;

  // This thread loads chunk `chunk` of rows load_row + kLoadRows·i of A and B.
  const int tid = threadIdx.x;
  const int chunk = tid % kChunks;
  const int load_row = tid / kChunks;
  const char* a_src[kLoadsPerThread];
  const char* b_src[kLoadsPerThread];
  bool a_ok[kLoadsPerThread], b_ok[kLoadsPerThread];
#pragma unroll
  for (int i = 0; i < kLoadsPerThread; ++i) {
    const int r = load_row + kLoadRows * i;
    a_ok[i] = r < rows;
    int64_t src = 0;
    if (a_ok[i]) src = p.a_rows != nullptr ? p.a_rows[row0 + r] : row0 + r;
    a_src[i] = a_base + (src * p.a_stride) * kElemBytes + chunk * 16;
    int64_t w_row;
    if constexpr (kEpilogue == Epilogue::kSwiGlu) {
      // Smem row r of warp column r / 32: lanes' rows 0-15 gate, 16-31 up.
      const int64_t col = static_cast<int64_t>(n_tile) * (kBN / 2) + (r / 32) * 16 + (r % 16);
      b_ok[i] = col < p.n;
      w_row = (r % 32) < 16 ? col : p.inter + col;
    } else {
      w_row = static_cast<int64_t>(n_tile) * kBN + r;
      b_ok[i] = w_row < p.n;
    }
    b_src[i] = w + ((b_ok[i] ? w_row : 0) * p.k) * kElemBytes + chunk * 16;
  }
  const int k_tiles = static_cast<int>((p.k + kBK - 1) / kBK);
  auto load = [&](int stage, int kt) {
    const bool k_ok = static_cast<int64_t>(kt) * kBK + chunk * (16 / kElemBytes) < p.k;
    unsigned char* const da = sa + stage * kBM * kRowBytes;
    unsigned char* const db = sb + stage * kBN * kRowBytes;
#pragma unroll
    for (int i = 0; i < kLoadsPerThread; ++i) {
      const int r = load_row + kLoadRows * i;
      const bool av = a_ok[i] && k_ok, bv = b_ok[i] && k_ok;
      CpAsync16(da + Swizzle128(r, chunk), av ? a_src[i] + kt * kRowBytes : p.a, av);
      CpAsync16(db + Swizzle128(r, chunk), bv ? b_src[i] + kt * kRowBytes : p.w, bv);
    }
  };

  const int lane = tid % 32, warp = tid / 32;
  const int wm = warp % 2, wn = warp / 2;  // warp tile: rows wm·64, columns wn·32
  const int g = lane / 4, q = lane % 4;
  float acc[4][4][4] = {};
  // FP8: this thread's 8 accumulator rows (mi, h) as A's scale rows, and
  // the weight block rows of its gate / up (or plain) columns.
  int32_t scale_row[4][2] = {};  // int32: fewer registers beside the two accumulators
  int32_t w_block[4] = {};
  const float* w_scale = nullptr;
  if constexpr (kFp8) {
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = min(wm * 64 + mi * 16 + g + 8 * h, rows - 1);
        scale_row[mi][h] =
            static_cast<int32_t>(p.a_rows != nullptr ? p.a_rows[row0 + r] : row0 + r);
      }
    }
    w_scale = p.w_scale + entry.x * p.w_scale_expert_stride;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      int64_t wr;  // a weight row of column group j (one 128-row block holds them all)
      if constexpr (kEpilogue == Epilogue::kSwiGlu) {
        const int64_t col = static_cast<int64_t>(n_tile) * (kBN / 2) + wn * 16 + (j % 2) * 8;
        wr = j < 2 ? col : p.inter + col;
      } else {
        wr = static_cast<int64_t>(n_tile) * kBN + wn * 32 + j * 8;
      }
      w_block[j] = static_cast<int32_t>((wr / kMoeFp8Block) * p.w_scale_stride);
    }
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load(s, s);
    CpAsyncCommit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    CpAsyncWait<kStages - 2>();  // stage kt has landed (this thread's part)
    __syncthreads();             // everyone's part; stage kt - 1 is free to refill
    if (kt + kStages - 1 < k_tiles) load((kt + kStages - 1) % kStages, kt + kStages - 1);
    CpAsyncCommit();
    const unsigned char* const as = sa + (kt % kStages) * kBM * kRowBytes;
    const unsigned char* const bs = sb + (kt % kStages) * kBN * kRowBytes;
    float part[kFp8 ? 4 : 1][4][4] = {};
#pragma unroll
    for (int kk = 0; kk < kRowBytes / 32; ++kk) {
      uint32_t af[4][4], bfrag[2][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        const int r = wm * 64 + mi * 16 + (lane & 15);
        LdMatrixX4(af[mi], as + Swizzle128(r, kk * 2 + (lane >> 4)));
      }
#pragma unroll
      for (int pj = 0; pj < 2; ++pj) {
        const int n = wn * 32 + pj * 16 + (lane & 7) + ((lane >> 4) << 3);
        LdMatrixX4(bfrag[pj], bs + Swizzle128(n, kk * 2 + ((lane >> 3) & 1)));
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if constexpr (kFp8) {
            MmaE4m3(part[mi][j], af[mi], bfrag[j / 2][(j % 2) * 2], bfrag[j / 2][(j % 2) * 2 + 1]);
          } else {
            Mma(acc[mi][j], af[mi], bfrag[j / 2][(j % 2) * 2], bfrag[j / 2][(j % 2) * 2 + 1]);
          }
        }
      }
    }
    if constexpr (kFp8) {
      const float* const sx = p.a_scale + static_cast<int64_t>(kt) * p.a_scale_stride;
      float sw[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) sw[j] = __ldg(w_scale + w_block[j] + kt);
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float s = __ldg(sx + scale_row[mi][h]);
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            acc[mi][j][2 * h] += part[mi][j][2 * h] * (s * sw[j]);
            acc[mi][j][2 * h + 1] += part[mi][j][2 * h + 1] * (s * sw[j]);
          }
        }
      }
    }
  }
  CpAsyncWait<0>();

  // Accumulator (mi, j) element 2h + c is row wm·64 + mi·16 + g + 8h, column
  // j·8 + 2q + c of the warp tile (g = lane / 4, q = lane % 4).
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = wm * 64 + mi * 16 + g + 8 * h;
      if (r >= rows) continue;
      bf16* const out = p.out + (row0 + r) * p.out_stride;
      if constexpr (kEpilogue == Epilogue::kSwiGlu) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int64_t col = static_cast<int64_t>(n_tile) * (kBN / 2) + wn * 16 + j * 8 + 2 * q;
          if (col >= p.n) continue;  // n is even, so col + 1 < n too
          const float* gate = acc[mi][j] + 2 * h;
          const float* up = acc[mi][j + 2] + 2 * h;
          *reinterpret_cast<__nv_bfloat162*>(out + col) =
              __floats2bfloat162_rn(vec::Silu(gate[0]) * up[0], vec::Silu(gate[1]) * up[1]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int64_t col = static_cast<int64_t>(n_tile) * kBN + wn * 32 + j * 8 + 2 * q;
          if (col >= p.n) continue;
          *reinterpret_cast<__nv_bfloat162*>(out + col) =
              __floats2bfloat162_rn(acc[mi][j][2 * h], acc[mi][j][2 * h + 1]);
        }
      }
    }
  }
}

// The tile map entries a launch walks: every routing of num_rows rows fits
// in MoeMaxTiles of them, which must fit in the routing's map.
bool RoutedTiles(int64_t num_rows, int num_experts, const MoeRouting& routing, int64_t* tiles) {
  *tiles = MoeMaxTiles(num_rows, num_experts);
  return *tiles <= routing.max_tiles;
}

template <Epilogue kEpilogue, bool kFp8 = false>
cudaError_t Launch(const GemmParams& p, int num_experts, int64_t num_rows,
                   const MoeRouting& routing, cudaStream_t stream) {
  int64_t tiles = 0;
  if (!RoutedTiles(num_rows, num_experts, routing, &tiles)) return cudaErrorInvalidValue;
  const int64_t blocks = tiles * p.n_tiles;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  if (blocks == 0) return cudaSuccess;
  const auto kernel = GroupedGemmKernel<kEpilogue, kFp8>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

bool Aligned16(const void* p) { return vec::Aligned16(p); }

bool ValidShapes(int64_t hidden, int64_t inter, int num_experts, int64_t num_rows) {
  return hidden > 0 && inter > 0 && hidden % 8 == 0 && inter % 8 == 0 && num_experts >= 1 &&
         num_experts <= kMoeMaxExperts && num_rows >= 0 && num_rows <= INT32_MAX;
}

}  // namespace

namespace {

// The two GEMMs' operands, whatever the element type (bf16 or e4m3).
GemmParams GateUpParams(const void* x, int64_t x_stride, const void* gate_up, int64_t hidden,
                        int64_t inter, const MoeRouting& routing, bf16* act) {
  GemmParams p;
  p.a = x;
  p.a_stride = x_stride;
  p.a_rows = routing.row_token;
  p.w = gate_up;
  p.w_expert_stride = 2 * inter * hidden;
  p.k = hidden;
  p.n = inter;
  p.inter = inter;
  p.n_tiles = static_cast<int>((inter + kBN / 2 - 1) / (kBN / 2));
  p.tile_map = reinterpret_cast<const int4*>(routing.tile_map);
  p.out = act;
  p.out_stride = inter;
  return p;
}

GemmParams DownParams(const void* act, const void* down, int64_t hidden, int64_t inter,
                      const MoeRouting& routing, bf16* y) {
  GemmParams p;
  p.a = act;
  p.a_stride = inter;
  p.a_rows = nullptr;
  p.w = down;
  p.w_expert_stride = hidden * inter;
  p.k = inter;
  p.n = hidden;
  p.inter = 0;
  p.n_tiles = static_cast<int>((hidden + kBN - 1) / kBN);
  p.tile_map = reinterpret_cast<const int4*>(routing.tile_map);
  p.out = y;
  p.out_stride = hidden;
  return p;
}

// Row stride of a [rows, k] weight's block scales (fp8_gemm_operands.cuh).
int64_t Fp8Stride(int64_t k) { return ((k + kMoeFp8Block - 1) / kMoeFp8Block + 3) / 4 * 4; }
// hopper_gemm.cu's wgmma kernels take the experts where the GPU runs them
// and the widths are whole 128-column tiles (every Qwen MoE's are; FP8 ones
// must be); the mma.sync kernels below take the rest.
bool UseHopperGemms(int64_t hidden, int64_t inter) {
  return hidden % 128 == 0 && inter % 128 == 0 && HopperGemmsAvailable();
}
bool ValidFp8(int64_t hidden, int64_t inter) {
  return hidden % kMoeFp8Block == 0 && inter % kMoeFp8Block == 0;
}

}  // namespace

cudaError_t MoeGateUpSwiGlu(const bf16* x, int64_t x_stride, const bf16* gate_up, int64_t hidden,
                            int64_t inter, int num_experts, int64_t num_rows,
                            const MoeRouting& routing, bf16* act, cudaStream_t stream) {
  if (!ValidShapes(hidden, inter, num_experts, num_rows) || x_stride < hidden ||
      x_stride % 8 != 0 || !Aligned16(x) || !Aligned16(gate_up) || !Aligned16(act)) {
    return cudaErrorInvalidValue;
  }
  if (UseHopperGemms(hidden, inter)) {
    int64_t tiles = 0;
    if (!RoutedTiles(num_rows, num_experts, routing, &tiles)) return cudaErrorInvalidValue;
    return HopperMoeGateUpSwiGlu(x, x_stride, gate_up, hidden, inter, num_experts, routing.tile_map,
                                 tiles, routing.row_token, act, stream);
  }
  return Launch<Epilogue::kSwiGlu>(GateUpParams(x, x_stride, gate_up, hidden, inter, routing, act),
                                   num_experts, num_rows, routing, stream);
}

cudaError_t MoeDown(const bf16* act, const bf16* down, int64_t hidden, int64_t inter,
                    int num_experts, int64_t num_rows, const MoeRouting& routing, bf16* y,
                    cudaStream_t stream) {
  if (!ValidShapes(hidden, inter, num_experts, num_rows) || !Aligned16(act) || !Aligned16(down) ||
      !Aligned16(y)) {
    return cudaErrorInvalidValue;
  }
  if (UseHopperGemms(hidden, inter)) {
    int64_t tiles = 0;
    if (!RoutedTiles(num_rows, num_experts, routing, &tiles)) return cudaErrorInvalidValue;
    return HopperMoeDown(act, num_rows, down, hidden, inter, num_experts, routing.tile_map, tiles,
                         y, stream);
  }
  return Launch<Epilogue::kPlain>(DownParams(act, down, hidden, inter, routing, y), num_experts,
                                  num_rows, routing, stream);
}

cudaError_t MoeGateUpSwiGluFp8(const uint8_t* xq, const float* x_scale, int64_t x_scale_stride,
                               const uint8_t* gate_up, const float* gate_up_scale, int64_t hidden,
                               int64_t inter, int num_experts, int64_t num_rows,
                               const MoeRouting& routing, bf16* act, cudaStream_t stream,
                               Fp8Activations act8) {
  if (!ValidShapes(hidden, inter, num_experts, num_rows) || !ValidFp8(hidden, inter) ||
      !Aligned16(xq) || !Aligned16(gate_up) || !Aligned16(act) ||
      (act8.q != nullptr && act8.scale == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (UseHopperGemms(hidden, inter)) {
    int64_t tiles = 0;
    if (!RoutedTiles(num_rows, num_experts, routing, &tiles)) return cudaErrorInvalidValue;
    return Fp8MoeGateUpSwiGlu(xq, x_scale, x_scale_stride, gate_up, gate_up_scale, hidden, inter,
                              num_experts, routing.tile_map, tiles, routing.row_token, act, stream,
                              act8, num_rows);
  }
  GemmParams p = GateUpParams(xq, hidden, gate_up, hidden, inter, routing, act);
  p.a_scale = x_scale;
  p.a_scale_stride = x_scale_stride;
  p.w_scale = gate_up_scale;
  p.w_scale_stride = Fp8Stride(hidden);
  p.w_scale_expert_stride = 2 * inter / kMoeFp8Block * p.w_scale_stride;
  const cudaError_t e = Launch<Epilogue::kSwiGlu, true>(p, num_experts, num_rows, routing, stream);
  if (e != cudaSuccess || act8.q == nullptr) return e;
  // The mma.sync path's epilogue does not quantize: the quantizer does, after it.
  return QuantizeActivationsFp8(act, inter, num_rows, inter, act8.q, act8.scale, stream);
}

cudaError_t MoeDownFp8(const uint8_t* actq, const float* act_scale, int64_t act_scale_stride,
                       const uint8_t* down, const float* down_scale, int64_t hidden, int64_t inter,
                       int num_experts, int64_t num_rows, const MoeRouting& routing, bf16* y,
                       cudaStream_t stream) {
  if (!ValidShapes(hidden, inter, num_experts, num_rows) || !ValidFp8(hidden, inter) ||
      !Aligned16(actq) || !Aligned16(down) || !Aligned16(y)) {
    return cudaErrorInvalidValue;
  }
  if (UseHopperGemms(hidden, inter)) {
    int64_t tiles = 0;
    if (!RoutedTiles(num_rows, num_experts, routing, &tiles)) return cudaErrorInvalidValue;
    return Fp8MoeDown(actq, act_scale, act_scale_stride, down, down_scale, hidden, inter,
                      num_experts, routing.tile_map, tiles, y, stream);
  }
  GemmParams p = DownParams(actq, down, hidden, inter, routing, y);
  p.a_scale = act_scale;
  p.a_scale_stride = act_scale_stride;
  p.w_scale = down_scale;
  p.w_scale_stride = Fp8Stride(inter);
  p.w_scale_expert_stride = hidden / kMoeFp8Block * p.w_scale_stride;
  return Launch<Epilogue::kPlain, true>(p, num_experts, num_rows, routing, stream);
}

}  // namespace draftfeed::cuda
