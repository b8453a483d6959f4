// The portable block-scaled FP8 GEMM of fp8_gemm_portable.cuh.
//
// Design. A block computes one 128 x 128 tile of Y: 128 rows of X, 128 rows
// of W (so exactly one weight scale block row, n_tile), K in steps of 128
// bytes, which is one scale group. Each step's A and B tiles (16 KB each) go
// through a 3-stage cp.async pipeline (97.5 KB: within sm_120's 99 KB a block),
// rows of 128 bytes whose 16-byte chunks are XOR-swizzled by row so that
// ldmatrix reads them without bank conflicts. 8 warps as 2 x 4, each 64 x 32
// of the tile: per 32-byte K slice 4 + 2 ldmatrix.x4 and 16 mma.sync
// m16n8k32 e4m3 into an fp32 partial (the e4m3 fragments are, byte for byte,
// the bf16 k16 ones: mma_sm80.cuh); after the step's 4 slices the partial is
// folded into the accumulator, acc = fma(partial, s_x[row, g]·S_w[n_tile, g],
// acc). Both live in registers (128 floats a thread), hence one block of 256
// threads an SM by registers; rows past m_pad and W rows past n load zeros
// (cp.async zero-fill) and are not stored. The step's 128 activation scales
// ride in the same stage (512 bytes), so the fold reads them from shared memory.
//
// Blocks walk the tiles in groups of kGroupTiles row tiles, the row tile
// fastest: the blocks resident at once share a few X row tiles and a band of
// W, which L2 keeps, instead of streaming all of W (or all of X) per wave.
// The order of the tiles changes nothing in any element's sum.
#include "kernels/fp8_gemm_portable.cuh"

#include <algorithm>

#include "kernels/mma_sm80.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

using sm80::CpAsync16;
using sm80::CpAsyncCommit;
using sm80::CpAsyncWait;
using sm80::LdMatrixX4;
using sm80::MmaE4m3;
using sm80::Swizzle128;

constexpr int kTile = 128;  // rows of X and of W a block; bytes of K a stage (one scale group)
constexpr int kChunks = kTile / 16;
constexpr int kStages = 3;
constexpr int kThreads = 256;
constexpr int kLoadRows = kThreads / kChunks;  // rows one pass of 16-byte chunks covers
constexpr int kLoadsPerThread = kTile / kLoadRows;
constexpr int kOperandBytes = kTile * kTile;  // one operand's tile in a stage
constexpr int kScaleChunks = kTile * 4 / 16;  // a step's activation scales in 16-byte chunks
constexpr int kStageBytes = 2 * kOperandBytes + kTile * 4;
constexpr int kSmemBytes = kStages * kStageBytes;
constexpr int kGroupTiles = 8;
static_assert(kTile == 128, "stage rows are Swizzle128's, a K step one 128-wide scale group");
static_assert(kSmemBytes <= 99 * 1024, "sm_120 opts a block into 99 KB of shared memory");

struct Params {
  const uint8_t* xq;
  const float* x_scale;  // [k_blocks][m_pad]
  const uint8_t* wq;
  const float* w_scale;  // [n_tiles][w_scale_stride]
  int64_t w_scale_stride;
  bf16* y;
  int64_t ldy;
  int m_pad, n, k_blocks;
  int m_tiles, n_tiles;
};

__global__ void __launch_bounds__(kThreads, 1) PortableFp8GemmKernel(Params p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  extern __shared__ __align__(128) unsigned char smem[];

  // The tile: groups of kGroupTiles row tiles (the last group maybe fewer),
  // row tile fastest within a group.
  const int per_group = kGroupTiles * p.n_tiles;
  const int group = static_cast<int>(blockIdx.x) / per_group;
  const int first_m = group * kGroupTiles;
  const int group_rows = min(kGroupTiles, p.m_tiles - first_m);
  const int local = static_cast<int>(blockIdx.x) - group * per_group;
  const int m0 = (first_m + local % group_rows) * kTile;
  const int n_tile = local / group_rows;
  const int n0 = n_tile * kTile;
  const int64_t k = static_cast<int64_t>(p.k_blocks) * kTile;

  // This thread copies chunk `chunk` of rows load_row + kLoadRows·i of both
  // tiles (rows from the first past the end load zeros), and thread t <
  // kScaleChunks 4 of the step's 128 activation scales (rows m0 + 4t..).
  // Base pointers and counts, not one pointer a row: the accumulators and
  // partials take 128 of the thread's registers already.
  const int tid = threadIdx.x;
  const int chunk = tid % kChunks;
  const int load_row = tid / kChunks;
  const uint8_t* const a_base = p.xq + (m0 + load_row) * k + chunk * 16;
  const uint8_t* const b_base = p.wq + (n0 + load_row) * k + chunk * 16;
  const int a_rows = (p.m_pad - m0 - load_row + kLoadRows - 1) / kLoadRows;  // loads in range
  const int b_rows = (p.n - n0 - load_row + kLoadRows - 1) / kLoadRows;
  const bool scale_ok = m0 + 4 * tid < p.m_pad;
  auto load = [&](int stage, int kb) {
    unsigned char* const da = smem + stage * kStageBytes;
    unsigned char* const db = da + kOperandBytes;
    const int64_t kb_bytes = static_cast<int64_t>(kb) * kTile;
#pragma unroll
    for (int i = 0; i < kLoadsPerThread; ++i) {
      const int at = Swizzle128(load_row + kLoadRows * i, chunk);
      const int64_t step = static_cast<int64_t>(i) * kLoadRows * k + kb_bytes;
      CpAsync16(da + at, i < a_rows ? a_base + step : p.xq, i < a_rows);
      CpAsync16(db + at, i < b_rows ? b_base + step : p.wq, i < b_rows);
    }
    if (tid < kScaleChunks) {
      const float* const src = p.x_scale + static_cast<int64_t>(kb) * p.m_pad + m0 + 4 * tid;
      CpAsync16(db + kOperandBytes + 16 * tid, scale_ok ? src : p.x_scale, scale_ok);
    }
  };

  const int lane = tid % 32, warp = tid / 32;
  const int wm = warp % 2, wn = warp / 2;  // warp tile: rows wm·64, columns wn·32
  const int g = lane / 4, q = lane % 4;
  const float* const w_scale = p.w_scale + n_tile * p.w_scale_stride;

  float acc[4][4][4] = {};
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < p.k_blocks) load(s, s);
    CpAsyncCommit();
  }
  for (int kb = 0; kb < p.k_blocks; ++kb) {
    CpAsyncWait<kStages - 2>();  // stage kb has landed (this thread's part)
    __syncthreads();             // everyone's part; the stage of kb - 1 is free to refill
    if (kb + kStages - 1 < p.k_blocks) load((kb + kStages - 1) % kStages, kb + kStages - 1);
    CpAsyncCommit();
    const unsigned char* const as = smem + (kb % kStages) * kStageBytes;
    const unsigned char* const bs = as + kOperandBytes;
    const float* const sx = reinterpret_cast<const float*>(bs + kOperandBytes);
    const float sw = __ldg(w_scale + kb);
    float part[4][4][4] = {};
#pragma unroll
    for (int kk = 0; kk < kTile / 32; ++kk) {
      // B: 16 W rows a call, two n8 fragments; A: 16 rows x 32 bytes a
      // fragment (its matrices: rows 0-7 / 8-15 x the slice's two chunks),
      // loaded as used so that only one is live.
      uint32_t bfrag[2][4];
#pragma unroll
      for (int pj = 0; pj < 2; ++pj) {
        const int w_row = wn * 32 + pj * 16 + (lane & 7) + ((lane >> 4) << 3);
        LdMatrixX4(bfrag[pj], bs + Swizzle128(w_row, kk * 2 + ((lane >> 3) & 1)));
      }
#pragma unroll
      for (int mi = 0; mi < 4; ++mi) {
        uint32_t af[4];
        LdMatrixX4(af, as + Swizzle128(wm * 64 + mi * 16 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          MmaE4m3(part[mi][j], af, bfrag[j / 2][(j % 2) * 2], bfrag[j / 2][(j % 2) * 2 + 1]);
        }
      }
    }
    // Fused multiply-add, spelled out: the same rounding for every element.
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float scale = __fmul_rn(sx[wm * 64 + mi * 16 + g + 8 * (e / 2)], sw);
          acc[mi][j][e] = __fmaf_rn(part[mi][j][e], scale, acc[mi][j][e]);
        }
      }
    }
  }
  CpAsyncWait<0>();

  // Accumulator (mi, j) element 2h + c is row wm·64 + mi·16 + g + 8h, column
  // wn·32 + j·8 + 2q + c of the tile; n is a multiple of 16, so a pair is
  // wholly in or out.
#pragma unroll
  for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + wm * 64 + mi * 16 + g + 8 * h;
      if (r >= p.m_pad) continue;
      bf16* const out = p.y + static_cast<int64_t>(r) * p.ldy;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int col = n0 + wn * 32 + j * 8 + 2 * q;
        if (col >= p.n) continue;
        *reinterpret_cast<__nv_bfloat162*>(out + col) =
            __floats2bfloat162_rn(acc[mi][j][2 * h], acc[mi][j][2 * h + 1]);
      }
    }
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // never launched: e4m3 mma.sync needs sm_89, and the launcher checks
#endif
}

}  // namespace

bool PortableFp8GemmAvailable() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (major * 10 + minor < 89) return false;
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, PortableFp8GemmKernel) != cudaSuccess) {
    cudaGetLastError();  // no code for this GPU in the binary
    return false;
  }
  return true;
}

cudaError_t Fp8BlockGemmPortable(const uint8_t* xq, const float* x_scale, const uint8_t* wq,
                                 const float* w_scale, int64_t w_scale_stride, bf16* y, int64_t ldy,
                                 int64_t m_pad, int64_t n, int64_t k, cudaStream_t stream) {
  if (m_pad < 0 || m_pad % 4 != 0 || n <= 0 || n % 16 != 0 || k <= 0 || k % kTile != 0 || ldy < n ||
      ldy % 2 != 0 || w_scale_stride < k / kTile || m_pad >= (int64_t{1} << 31) ||
      n >= (int64_t{1} << 31) || k / kTile >= (int64_t{1} << 31) || !vec::Aligned16(xq) ||
      !vec::Aligned16(wq) || !vec::Aligned16(x_scale) ||
      reinterpret_cast<uintptr_t>(w_scale) % 4 != 0 || reinterpret_cast<uintptr_t>(y) % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  if (m_pad == 0) return cudaSuccess;
  const int64_t m_tiles = (m_pad + kTile - 1) / kTile, n_tiles = (n + kTile - 1) / kTile;
  // Tile indices, and kGroupTiles · n_tiles, in int.
  if (m_tiles * n_tiles >= (int64_t{1} << 31) || kGroupTiles * n_tiles >= (int64_t{1} << 31)) {
    return cudaErrorInvalidValue;
  }
  if (!PortableFp8GemmAvailable()) return cudaErrorNotSupported;
  cudaError_t err = cudaFuncSetAttribute(PortableFp8GemmKernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const Params prm{xq,
                   x_scale,
                   wq,
                   w_scale,
                   w_scale_stride,
                   y,
                   ldy,
                   static_cast<int>(m_pad),
                   static_cast<int>(n),
                   static_cast<int>(k / kTile),
                   static_cast<int>(m_tiles),
                   static_cast<int>(n_tiles)};
  PortableFp8GemmKernel<<<static_cast<unsigned>(m_tiles * n_tiles), kThreads, kSmemBytes, stream>>>(
      prm);
  return cudaGetLastError();
}

}  // namespace draftfeed::cuda
