// Warp-level tensor-core helpers (sm_80+: ldmatrix, mma.sync m16n8k16 with
// bf16 inputs and fp32 accumulators, cp.async; sm_89+: mma.sync m16n8k32
// with e4m3 inputs) shared by the GDN, attention, MoE grouped-GEMM and
// portable FP8 GEMM kernels.
// Internal to kernels/: device helpers only, no launchers.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/common.cuh"

namespace draftfeed::cuda::sm80 {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; when !valid the destination is
// zero-filled and src is not read (it must still be a valid address).
__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ldmatrix.x4 (four 8x8 b16 tiles) at shared address `addr`. kMemoryClobber
// keeps the compiler from moving it across other memory accesses, for callers
// whose shared memory is written behind its back (TMA, waited on by an asm
// barrier); without it, the caller's __syncthreads orders it.
template <bool kMemoryClobber = false>
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  if constexpr (kMemoryClobber) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
}
template <bool kMemoryClobber = false>
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  if constexpr (kMemoryClobber) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
}
// The same at a generic pointer into shared memory.
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* p) {
  LdMatrixX4(r, SmemAddr(p));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], const void* p) {
  LdMatrixX4Trans(r, SmemAddr(p));
}

// d[0..3] += A·B, m16n8k16, bf16 in, fp32 accumulate. Fragment layouts (PTX
// ISA), g = lane / 4, q = lane % 4: A regs {(g, 2q..2q+1), (g+8, 2q..),
// (g, 2q+8..), (g+8, 2q+8..)}; B regs {(k 2q..2q+1, n g), (k 2q+8.., n g)};
// C/D {(g, 2q), (g, 2q+1), (g+8, 2q), (g+8, 2q+1)}.
__device__ __forceinline__ void Mma(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d[0..3] += A·B, m16n8k32, e4m3 in, fp32 accumulate (sm_89+; callers guard
// with __CUDA_ARCH__ >= 890). PTX ISA fragments: in bytes exactly Mma's, each
// 32-bit register holding four e4m3 along K: A {(g, 4q..4q+3), (g+8, 4q..),
// (g, 16+4q..), (g+8, 16+4q..)}; B {(k 4q..4q+3, n g), (k 16+4q.., n g)};
// C/D as Mma's. So the ldmatrix calls that load a bf16 k16 step load an e4m3
// k32 step from the same 32 bytes of each row.
__device__ __forceinline__ void MmaE4m3(float* d, const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of (row, 16-byte chunk) in a tile of 128-byte rows: chunk c of
// row r is stored at chunk c ^ (r % 8), so the 8 rows one ldmatrix phase
// reads fall in 8 different bank groups.
__device__ __forceinline__ int Swizzle128(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}

// Two floats (round to nearest) to one register of two bf16, the first in
// the low half.
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t u;
  memcpy(&u, &v, sizeof(u));
  return u;
}

// K k-steps of bf16 A operand (m16n8k16, or wgmma's per-warp rows) from a
// flat fp32 accumulator of 2K n8-tiles, 4 floats each: k-step k packs n-tiles
// 2k and 2k+1, so a product's output over 16K columns feeds the next product
// as its 16K-deep input without leaving registers.
template <int K>
__device__ __forceinline__ void AccumulatorToA(const float* acc, uint32_t (&a)[K][4]) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    a[k][0] = PackBf16(acc[8 * k + 0], acc[8 * k + 1]);
    a[k][1] = PackBf16(acc[8 * k + 2], acc[8 * k + 3]);
    a[k][2] = PackBf16(acc[8 * k + 4], acc[8 * k + 5]);
    a[k][3] = PackBf16(acc[8 * k + 6], acc[8 * k + 7]);
  }
}

}  // namespace draftfeed::cuda::sm80
