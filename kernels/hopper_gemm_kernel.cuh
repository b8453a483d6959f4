// The kernel behind hopper_gemm.cuh, one template for the FP8 block-scaled
// dense GEMM (an alternative to cuBLASLt's block-scaled mode) and the MoE
// experts' grouped GEMMs in FP8 (which cuBLASLt has no block-scaled grouped
// form of) and in bf16 (where the grouped kernel beats gathering rows for
// cuBLAS): the warp-specialised kernel and its wgmma and copy primitives
// (its tiles, parameters and work decoding: hopper_gemm_tiles.cuh). Internal
// to kernels/, included by hopper_gemm.cu only, which builds the tensor maps,
// checks the arguments and launches it.
//
// Design. A persistent grid (one block per SM) walks work items of 128 rows
// x 256 weight rows. Dense items are numbered in groups of kGroupM row
// blocks, rows fastest, so the ~132 in flight read ~16 row blocks of X and ~8
// column blocks of W, both L2-resident, instead of every wave streaming all
// of W from HBM. MoE items are MoePermute's tiles (up to 128 sorted rows of
// one expert) times column tiles; a tile's column tiles run side by side.
//
// Per block: a loader warpgroup (setmaxnreg gives its registers away) and
// two math warpgroups of 64 rows each. Per 128-wide K block the loader
// brings, into one of kStages stages, A's 128 x 128 bytes (TMA; for the
// gate_up GEMM gathered row by row with cp.async from each sorted row's
// token), two 128-row boxes of W (both 128-byte swizzled, the layout wgmma's
// K-major descriptors read) and the 128 rows' activation scales of that
// group. A math warpgroup computes its 64 x 256 outputs as two halves of 128
// columns (one weight block each): four wgmma m64n128k32 into a scratch
// accumulator, then acc += scratch · s_x[row] · S_w[half]. The block scale
// cannot enter the tensor-core sum, and Hopper's FP8 accumulation keeps
// fewer mantissa bits than fp32, so the partial is promoted every 128 K, as
// the format intends; while one warpgroup promotes, the other's wgmma keeps
// the tensor cores busy. Registers per math thread: 128 accumulators + 64
// scratch. bf16 operands take the same 128-byte K blocks (64 values), with
// no scales: the tensor cores accumulate straight into the fp32 sums, one
// K block's group in flight while the previous stage is released.
//
// The epilogues stage each warp's outputs in shared memory and write whole
// 128-byte lines; stored straight from the accumulators (16 bytes of a row
// per quad, 8 rows an instruction) they held the K = 512 MoE down GEMM to
// 0.75 of its speed now, the dense GEMM under cuBLASLt's, and the FP8
// experts' gate_up (8 bytes of each row) 3-5% under.
// Dense, it now runs 1.04-1.09x cuBLASLt's block-scaled GEMM at the 27B's
// projections, so the engine takes it for them on Hopper; the MLPs' gate_up
// (kDenseGateUp) also saves the SwiGLU pass and the bf16 [gate; up] round
// trip in its epilogue. Both GEMMs are held by the GPU's power cap, not by
// issue, which is why a 128 x 128 tile with two scratch accumulators
// (issuing block kb + 1 before promoting kb) was slower: it reads twice the
// shared memory per FLOP. Cutting L2 reads did not pay either: two-block
// clusters that multicast the weight halves (a block's reads 48 -> 32 KB a
// stage) ran 0.97x, the pair walking its stages together. Starting math
// warpgroup 1 two K blocks behind 0, so that one stores while the other
// multiplies, ran 0.81-0.89x (likely: the lead takes stages from the
// leader's look-ahead). The figures (dense, grouped, the clocks under the
// cap, those variants): docs/performance.md, "Figures behind the code's
// choices" (bench/micro/fp8_gemm_benchmark.cc).
//
// Edges: TMA zero-fills rows past the tensors' ends; the epilogue stores only
// the item's rows and columns < n, and a weight half past n takes scale 0.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/fp8_quantize_group.cuh"
#include "kernels/hopper_gemm_tiles.cuh"
#include "kernels/tma_sm90.cuh"
#include "kernels/vec_io.cuh"
#include "kernels/wgmma_sm90.cuh"

namespace draftfeed::cuda::hopper {

using sm90::kArchWgmma;

// K-major operand, 128-byte swizzle: 8-row groups 1024 bytes apart (sbo),
// lbo unused.
[[maybe_unused]] __device__ __forceinline__ uint64_t Desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | uint64_t{1} << 16 |
         uint64_t{1024 >> 4} << 32 | uint64_t{1} << 62;
}

template <int N>
[[maybe_unused]] __device__ __forceinline__ void FenceRegs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// d (+)= A(64 rows at a) · B(128 rows at b)ᵀ over one 128-byte K block: four
// wgmma m64n128 (k32 e4m3 or k16 bf16), each 32 bytes further along the
// swizzled 128-byte rows (descriptor addresses count 16-byte units).
// kFirstScaleD 0: the first product overwrites d. Callers fence and commit.
template <bool kFp8, int kFirstScaleD>
[[maybe_unused]] __device__ __forceinline__ void IssueBlock(float (&d)[64], uint32_t a,
                                                            uint32_t b) {
  const uint64_t a0 = Desc(a), b0 = Desc(b);
  if constexpr (kFp8) {
    sm90::WgmmaE4m3N128::SS<kFirstScaleD>(d, a0, b0);
  } else {
    sm90::Wgmma<128>::SS<kFirstScaleD>(d, a0, b0);
  }
#pragma unroll
  for (int kk = 1; kk < 4; ++kk) {
    if constexpr (kFp8) {
      sm90::WgmmaE4m3N128::SS<1>(d, a0 + 2 * kk, b0 + 2 * kk);
    } else {
      sm90::Wgmma<128>::SS<1>(d, a0 + 2 * kk, b0 + 2 * kk);
    }
  }
}

// 16 bytes (4 with the second form) global -> shared; zero-filled when !valid.
[[maybe_unused]] __device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src,
                                                           bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void CpAsync4(uint32_t dst, const void* src,
                                                          bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}
// An arrive on the mbarrier at bar once every cp.async this thread has issued
// so far has landed; noinc: it is one of the arrivals bar was initialised to
// expect. The tensor cores read those bytes through the async proxy, so the
// reader fences after its wait (wait_full).
[[maybe_unused]] __device__ __forceinline__ void CpAsyncArriveNoinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// The block size is the path's: 384 in the sm_90a pass, 128 (an empty body)
// elsewhere, read back by HopperGemmsAvailable from the loaded binary.
// kFp8: e4m3 operands with block scales (a K block = 128 values), each
// block's partial promoted into fp32 with its two scales; else bf16 operands
// (a K block = 64 values, the same 128 bytes a row) accumulated straight into
// fp32 by the tensor cores, with no scales.
template <Mode kMode, bool kFp8>
__global__ void __launch_bounds__(kArchWgmma ? kThreads : 128, 1)
    HopperGemmKernel(const __grid_constant__ CUtensorMap tm_x,
                     const __grid_constant__ CUtensorMap tm_w,
                     const __grid_constant__ CUtensorMap tm_s, const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool kGather = kMode == Mode::kMoeGateUp;
  constexpr int kBKElems = kFp8 ? 128 : 64;  // a K block's values: TMA's coordinate unit
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023) & ~uint32_t{1023};
  const uint32_t a_smem = base;
  const uint32_t b_smem = base + kStages * kABytes;
  const uint32_t s_smem = b_smem + kStages * kBBytes;
  const uint32_t bars = s_smem + kStages * kScaleBytes;
  const uint32_t epi_smem = bars + kBarBytes;
  const auto full = [&](int st) { return bars + 8 * st; };
  const auto empty = [&](int st) { return bars + 8 * (kStages + st); };
  const float* s_scales = reinterpret_cast<const float*>(smem_raw + (s_smem - raw));
  constexpr int kScaleSlot = kScaleBytes / 4;  // floats per stage
  // Bytes TMA brings into a stage (the gather brings A and the scales itself).
  constexpr uint32_t kTmaBytes =
      kBBytes + (kGather ? 0 : kABytes) + (kGather || !kFp8 ? 0 : kScaleBox * 4);

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      // The TMA issuer's arrive (with the bytes), plus, gathering, every
      // loader thread's once its copies have landed.
      sm90::MbarInit(full(st), kGather ? 1 + kLoadThreads : 1);
      // Every math thread releases (a one-lane arrive would be a branch
      // between wgmma instructions, which ptxas serializes).
      sm90::MbarInit(empty(st), kMathThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (tid >= kMathThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kLoadRegs));
    const int lt = tid - kMathThreads;
    if (!kGather && lt != 0) return;
    int st = 0;
    uint32_t phase = 0;
    for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
      const Work w = Decode<kMode>(t, p);
      if (!w.valid) continue;
      // Gathering: this thread copies 16-byte chunk lt % 8 of tile rows
      // lt / 8 + 16i, and (FP8) row lt's activation scale.
      const uint8_t* src[8];
      bool ok[8];
      const float* s_src = p.x_scale;
      bool s_ok = false;
      if constexpr (kGather) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = lt / 8 + 16 * i;
          ok[i] = r < w.rows;
          const int64_t token = ok[i] ? __ldg(p.row_token + w.a_row + r) : 0;
          src[i] = p.x + token * p.x_row_bytes + (lt % 8) * 16;
        }
        if constexpr (kFp8) {
          s_ok = lt < w.rows;
          s_src += s_ok ? __ldg(p.row_token + w.a_row + lt) : 0;
        }
      }
      for (int kb = 0; kb < p.k_blocks; ++kb) {
        sm90::MbarWait(empty(st), phase ^ 1);
        if (lt == 0) {
          sm90::MbarExpectTx(full(st), kTmaBytes);
          if constexpr (!kGather) {
            sm90::TmaLoad2d(a_smem + st * kABytes, tm_x, kb * kBKElems, w.a_row, full(st));
            if constexpr (kFp8) {
              sm90::TmaLoad2d(s_smem + st * kScaleBytes, tm_s, w.a_row & ~3, kb, full(st));
            }
          }
          sm90::TmaLoad2d(b_smem + st * kBBytes, tm_w, kb * kBKElems, w.b_row0, full(st));
          sm90::TmaLoad2d(b_smem + st * kBBytes + kBHalfBytes, tm_w, kb * kBKElems, w.b_row1,
                          full(st));
        }
        if constexpr (kGather) {
          // Rows as TMA's 128-byte swizzle lays them out: 16-byte unit u of
          // row r at unit u ^ (r % 8).
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int r = lt / 8 + 16 * i;
            CpAsync16(a_smem + st * kABytes + r * 128 + (((lt % 8) ^ (r % 8)) << 4),
                      src[i] + kb * kBK, ok[i]);
          }
          if constexpr (kFp8) {
            CpAsync4(s_smem + st * kScaleBytes + (w.a_row % 4 + lt) * 4,
                     s_src + kb * p.x_scale_stride, s_ok);
          }
          // Counted into full(st) by the hardware once they have landed, so
          // the thread goes straight on to the next stage: every stage can
          // be in flight. (Waiting for stage kb - 1 before arriving, as this
          // loop once did, kept two in flight: 0.5-0.7% slower at the FP8
          // experts' gate_up, the bf16 one level within 1%.)
          CpAsyncArriveNoinc(full(st));
        }
        if (++st == kStages) {
          st = 0;
          phase ^= 1;
        }
      }
    }
    if constexpr (kGather) asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kMathRegs));

  // Math warpgroups. This thread's rows in the tile: r0 and r0 + 8; its
  // columns in each 8-column group j of a half: 8j + 2(lane % 4) and + 1.
  const int wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int r0 = wg * 64 + warp * 16 + lane / 4;
  constexpr bool kGateUp = kMode == Mode::kMoeGateUp || kMode == Mode::kDenseGateUp;
  if constexpr (kGateUp && kFp8) {
    if (p.act8 != nullptr && blockIdx.x == 0) {
      fp8::ZeroPadRows(p.act8, p.act8_scale, p.act8_rows, p.act8_rows_pad, p.n, tid, kMathThreads);
    }
  }
  int st = 0;
  uint32_t phase = 0;
  // Stage st's operands are in: gathered ones were written by the loader's
  // cp.async (the generic proxy), so fence them before the tensor cores'
  // async-proxy reads.
  const auto wait_full = [&] {
    sm90::MbarWait(full(st), phase);
    if constexpr (kGather) asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  };
  const auto advance = [&] {
    if (++st == kStages) {
      st = 0;
      phase ^= 1;
    }
  };
  for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const Work w = Decode<kMode>(t, p);
    if (!w.valid) continue;
    float acc[2][64];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.f;
    }
    if constexpr (kFp8) {
      for (int kb = 0; kb < p.k_blocks; ++kb) {
        const float sw0 = __ldg(w.ws0 + kb);
        const float sw1 = w.ws1 != nullptr ? __ldg(w.ws1 + kb) : 0.f;
        wait_full();
        const float* sx = s_scales + st * kScaleSlot + w.a_row % 4;  // row 0 of the item
        const float sx0 = sx[r0], sx1 = sx[r0 + 8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float part[64];
          FenceRegs(part);  // nothing may touch part between the fence and the products
          sm90::WgmmaFence();
          IssueBlock<true, 0>(part, a_smem + st * kABytes + wg * 64 * 128,
                              b_smem + st * kBBytes + h * kBHalfBytes);
          sm90::WgmmaCommit();
          sm90::WgmmaWait<0>();
          FenceRegs(part);
          const float sw = h == 0 ? sw0 : sw1;
          const float s0 = sx0 * sw, s1 = sx1 * sw;
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[h][i] = fmaf(part[i], (i & 2) ? s1 : s0, acc[h][i]);
        }
        sm90::MbarArrive(empty(st));
        advance();
      }
    } else {
      // bf16: the tensor cores accumulate K block kb + 1 onto kb's sums
      // while the previous stage is released; one group in flight.
      FenceRegs(acc[0]);
      FenceRegs(acc[1]);
      const auto issue = [&] {
        wait_full();
        sm90::WgmmaFence();
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          IssueBlock<false, 1>(acc[h], a_smem + st * kABytes + wg * 64 * 128,
                               b_smem + st * kBBytes + h * kBHalfBytes);
        }
        sm90::WgmmaCommit();
        const int issued = st;
        advance();
        return issued;
      };
      int prev = issue();
      for (int kb = 1; kb < p.k_blocks; ++kb) {
        const int cur = issue();
        sm90::WgmmaWait<1>();
        sm90::MbarArrive(empty(prev));
        prev = cur;
      }
      sm90::WgmmaWait<0>();
      FenceRegs(acc[0]);
      FenceRegs(acc[1]);
      sm90::MbarArrive(empty(prev));
    }
    // Epilogues stage each warp's outputs in shared memory (stored straight
    // from the accumulator layout, an instruction writes 16 or 8 bytes of
    // each of 8 rows, half or a quarter of a 32-byte sector) and write them
    // back as whole 128-byte rows: 16-byte units XOR-swizzled by row, so
    // both the writes and the 16-byte reads are free of bank conflicts.
    // The same roundings of the same sums: the bits do not change.
    uint8_t* stage = smem_raw + (epi_smem - raw) + (tid / 32) * kEpiWarpBytes;
    const int warp_row = wg * 64 + warp * 16;  // the warp's first row in the tile
    // Staged unit u (16 bytes) of the warp's row lr, read back by lane.
    const auto staged = [&](int lr, int u) {
      return *reinterpret_cast<const uint4*>(stage + lr * 128 + ((u ^ (lr % 8)) << 4));
    };
    // bf16 block c (columns 64c.. of the tile's) from the accumulator-layout
    // pairs pair(r, j) (rows lane/4 + 8r, columns 8j + 2(lane % 4)), written
    // to dst_row(lr) + 8u for the rows keep(lr) and the units below units.
    const auto store_bf16_block = [&](int c, auto pair, auto keep, auto dst_row, int units) {
      __syncwarp();  // the previous block's reads are done
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          *reinterpret_cast<__nv_bfloat162*>(stage + (lane / 4 + 8 * r) * 128 +
                                             ((u ^ (lane / 4)) << 4) + (lane % 4) * 4) =
              pair(r, 8 * c + u);
        }
      }
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int lr = lane / 8 + 4 * i, u = lane % 8;
        if (keep(lr) && u < units) {
          const uint4 v = staged(lr, u);
          bf16* dst = dst_row(lr) + 8 * u;
          if (p.y_vec16) {
            *reinterpret_cast<uint4*>(dst) = v;
          } else {
            uint32_t* d4 = reinterpret_cast<uint32_t*>(dst);
            d4[0] = v.x;
            d4[1] = v.y;
            d4[2] = v.z;
            d4[3] = v.w;
          }
        }
      }
    };
    if constexpr (kGateUp) {
      // Gate in acc[0], up at the same place in acc[1]; n % 128 == 0.
      // The tile's 128 columns of a row are one quantization group, held by
      // the 4 lanes of a quad: its amax is 2 shuffles away. Rows past the
      // tile are computed too (the shuffles want every lane), not stored.
      // Dense, gate and up are first rounded to bf16 as the unfused path
      // stores them, so the result is bit for bit this kernel's dense GEMM
      // followed by SwiGluQuantizeFp8 (the experts use the fp32 sums).
      const auto rounded = [](float x) {
        return kMode == Mode::kDenseGateUp ? __bfloat162float(__float2bfloat16(x)) : x;
      };
      __nv_bfloat162 v[2][16];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const float* g = acc[0] + 4 * j + 2 * r;
          const float* u = acc[1] + 4 * j + 2 * r;
          v[r][j] = __floats2bfloat162_rn(vec::Silu(rounded(g[0])) * rounded(u[0]),
                                          vec::Silu(rounded(g[1])) * rounded(u[1]));
        }
      }
      if (p.y != nullptr) {
        const auto keep = [&](int lr) { return warp_row + lr < w.rows; };
        const auto dst_row = [&](int lr) {
          return p.y + static_cast<int64_t>(w.a_row + warp_row + lr) * p.ldy + w.out_col;
        };
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          store_bf16_block(
              c, [&](int r, int j) { return v[r][j]; }, keep,
              [&](int lr) { return dst_row(lr) + 64 * c; }, 8);
        }
      }
      // (bf16 experts never quantize: the kernel without kFp8 has none of it.)
      if (kFp8 && p.act8 != nullptr) {
        // The 16 rows' 128 e4m3 codes are one staged block: code pair j of
        // row lr at byte 8j + 2(lane % 4), in unit j / 2.
        fp8::GroupScale gs[2];
        __syncwarp();
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float amax = 0.0f;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const float2 f = __bfloat1622float2(v[r][j]);
            amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
          }
          gs[r] = fp8::ScaleOf(fp8::LanesMax<4>(amax));
          const int lr = lane / 4 + 8 * r;
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const float2 f = __bfloat1622float2(v[r][j]);
            *reinterpret_cast<uint16_t*>(stage + lr * 128 + (((j / 2) ^ (lr % 8)) << 4) +
                                         (j % 2) * 8 + (lane % 4) * 2) =
                fp8::PackE4m3x2(fp8::Divide(f.x, gs[r]), fp8::Divide(f.y, gs[r]));
          }
        }
        __syncwarp();
        // Dense: m_pad rows in the tiles, act8_rows of them tokens.
        const auto kept = [&](int lr) {
          const int64_t at = w.a_row + warp_row + lr;
          return warp_row + lr < w.rows && at < p.act8_rows;
        };
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int lr = lane / 8 + 4 * i, u = lane % 8;
          if (kept(lr)) {
            *reinterpret_cast<uint4*>(p.act8 + (w.a_row + warp_row + lr) * p.n + w.out_col +
                                      16 * u) = staged(lr, u);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int lr = lane / 4 + 8 * r;
          if (lane % 4 == 0 && kept(lr)) {
            p.act8_scale[(w.out_col / 128) * p.act8_rows_pad + w.a_row + warp_row + lr] = gs[r].s;
          }
        }
      }
    } else {
      const int cols = p.n - w.out_col;  // cols % 16 == 0: a unit is all in or all out
      const auto keep = [&](int lr) { return warp_row + lr < w.rows; };
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int h = c / 2, c_col = 128 * h + 64 * (c % 2);
        if (c_col >= cols) break;
        store_bf16_block(
            c % 2,
            [&](int r, int j) {
              return __floats2bfloat162_rn(acc[h][4 * j + 2 * r], acc[h][4 * j + 2 * r + 1]);
            },
            keep,
            [&](int lr) {
              return p.y + static_cast<int64_t>(w.a_row + warp_row + lr) * p.ldy + w.out_col +
                     c_col;
            },
            min(8, (cols - c_col) / 8));
      }
    }
  }
#endif
}

}  // namespace draftfeed::cuda::hopper
