// The row gather the cuBLAS grouped-GEMM route needs before its gate_up GEMM
// (declared in moe_cublas.h): the fused kernel of kernels/moe_gemm.cu reads
// x through row_token in its loads instead. One 16-byte vector (8 bf16) per
// thread, consecutive threads along a row, so each warp moves 512 contiguous
// bytes.
#include <algorithm>
#include <cstdint>

#include "bench/micro/moe_cublas.h"

namespace draftfeed::bench {
namespace {

constexpr int kVec = 8;  // bf16 per 16-byte vector
constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    GatherRowsKernel(const uint4* x, int64_t x_stride_vecs, const int32_t* row_token, int64_t rows,
                     int64_t row_vecs, uint4* out) {
  const int64_t total = rows * row_vecs;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t r = i / row_vecs, c = i % row_vecs;
    out[i] = x[row_token[r] * x_stride_vecs + c];
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t MoeGatherRows(const cuda::bf16* x, int64_t x_stride, const int32_t* row_token,
                          int64_t rows, int64_t hidden, cuda::bf16* out, cudaStream_t stream) {
  if (rows < 0 || hidden <= 0 || hidden % kVec != 0 || x_stride < hidden || x_stride % kVec != 0 ||
      !Aligned16(x) || !Aligned16(out)) {
    return cudaErrorInvalidValue;
  }
  const int64_t vecs = rows * (hidden / kVec);
  if (vecs == 0) return cudaSuccess;
  // Enough blocks to fill the GPU several times over; the loop covers the rest.
  const int64_t blocks = std::min<int64_t>((vecs + kThreads - 1) / kThreads, 132 * 16);
  GatherRowsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(x), x_stride / kVec, row_token, rows, hidden / kVec,
      reinterpret_cast<uint4*>(out));
  return cudaGetLastError();
}

}  // namespace draftfeed::bench
