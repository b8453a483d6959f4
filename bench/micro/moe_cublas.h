// The MoE expert GEMMs through cuBLAS's grouped GEMM (cublasGemmGroupedBatchedEx,
// cuBLAS 12.5+): the alternative to the fused kernels of kernels/moe_gemm.cu, which
// draftfeed-bench-kernels times beside them (moe_cublas_benchmark.cc) and
// tests/kernels/cuda/moe_cublas_cuda_test.cc checks against them. The engine does not
// use it.
//
// What this route needs that the fused kernels do not, each a cost the benchmark's
// "route" figure includes:
//  - the per-expert row offsets on the host: cuBLAS takes every problem's m, n, k as host
//    arrays, so once per layer the routing travels to the host and the stream waits for it
//    (the fused kernels read the tile map on the device);
//  - device arrays of each expert's A, B and C pointers, uploaded per call;
//  - x gathered into expert order first (MoeGatherRows): a GEMM reads its A rows in place,
//    the fused gate_up gathers them in its loads;
//  - the gate_up product written out ([rows, 2I] bf16) and read back by a separate SwiGLU
//    (kernels/elementwise.cuh), gate and up rounded to bf16 before the SiLU where the fused
//    kernel applies it to the fp32 accumulators.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/common.cuh"

namespace draftfeed::bench {

// out[r] = x[row_token[r]] for r < rows: x [*, x_stride] bf16, out [rows, hidden] dense.
// hidden and x_stride multiples of 8, x and out 16-byte aligned (cudaErrorInvalidValue
// otherwise). Defined in moe_gather.cu.
cudaError_t MoeGatherRows(const cuda::bf16* x, int64_t x_stride, const int32_t* row_token,
                          int64_t rows, int64_t hidden, cuda::bf16* out, cudaStream_t stream);

// One grouped GEMM over expert-sorted rows: for every expert e with rows,
//   y[offsets[e] .. offsets[e+1]) = a[offsets[e] .. offsets[e+1]) · W_eᵀ,
// a [rows, a_stride] bf16, W [E, n, k] bf16 (row-major, as the checkpoints store
// experts), y [rows, y_stride] bf16; fp32 accumulation (CUBLAS_COMPUTE_32F), one rounding
// to bf16. One group per expert that has rows (an expert without rows is left out rather
// than passed as an empty problem).
class CublasGroupedGemm {
 public:
  CublasGroupedGemm() = default;
  ~CublasGroupedGemm() {
    if (handle_ != nullptr) cublasDestroy(handle_);
    cudaFree(device_ptrs_);
  }
  CublasGroupedGemm(const CublasGroupedGemm&) = delete;
  CublasGroupedGemm& operator=(const CublasGroupedGemm&) = delete;

  // The handle, and device room for up to max_experts problems' pointers.
  cublasStatus_t Init(int max_experts) {
    if (max_experts < 1) return CUBLAS_STATUS_INVALID_VALUE;
    if (const cublasStatus_t s = cublasCreate(&handle_); s != CUBLAS_STATUS_SUCCESS) return s;
    max_experts_ = max_experts;
    if (cudaMalloc(&device_ptrs_, 3 * sizeof(void*) * max_experts) != cudaSuccess) {
      device_ptrs_ = nullptr;
      return CUBLAS_STATUS_ALLOC_FAILED;
    }
    return CUBLAS_STATUS_SUCCESS;
  }

  // Builds the host arrays from `offsets` (host, num_experts + 1 entries) and uploads the
  // pointer arrays on `stream`. cuBLAS's column-major view: y_eᵀ [n, rows_e] =
  // W_e [k, n]ᵀ · a_eᵀ [k, rows_e], so W is its transposed A and a its B.
  cublasStatus_t Plan(const int32_t* offsets, int num_experts, const cuda::bf16* a,
                      int64_t a_stride, const cuda::bf16* w, int64_t n, int64_t k, cuda::bf16* y,
                      int64_t y_stride, cudaStream_t stream) {
    if (handle_ == nullptr || num_experts < 1 || num_experts > max_experts_ || n < 1 || k < 1 ||
        a_stride < k || y_stride < n || n > INT32_MAX || k > INT32_MAX || a_stride > INT32_MAX ||
        y_stride > INT32_MAX) {
      return CUBLAS_STATUS_INVALID_VALUE;
    }
    m_.clear();
    rows_.clear();
    ptrs_.assign(3 * static_cast<size_t>(num_experts), nullptr);
    int g = 0;
    for (int e = 0; e < num_experts; ++e) {
      const int32_t rows = offsets[e + 1] - offsets[e];
      if (rows < 0) return CUBLAS_STATUS_INVALID_VALUE;
      if (rows == 0) continue;
      rows_.push_back(rows);
      ptrs_[g] = const_cast<cuda::bf16*>(w) + e * n * k;
      ptrs_[num_experts + g] = const_cast<cuda::bf16*>(a) + offsets[e] * a_stride;
      ptrs_[2 * num_experts + g] = y + offsets[e] * y_stride;
      ++g;
    }
    groups_ = g;
    stride_ = num_experts;
    m_.assign(g, static_cast<int>(n));
    k_.assign(g, static_cast<int>(k));
    lda_.assign(g, static_cast<int>(k));
    ldb_.assign(g, static_cast<int>(a_stride));
    ldc_.assign(g, static_cast<int>(y_stride));
    ta_.assign(g, CUBLAS_OP_T);
    tb_.assign(g, CUBLAS_OP_N);
    alpha_.assign(g, 1.0f);
    beta_.assign(g, 0.0f);
    group_size_.assign(g, 1);
    if (g == 0) return CUBLAS_STATUS_SUCCESS;
    // Pageable source: the copy is staged before this returns, so ptrs_ may change after.
    if (cudaMemcpyAsync(device_ptrs_, ptrs_.data(), ptrs_.size() * sizeof(void*),
                        cudaMemcpyHostToDevice, stream) != cudaSuccess) {
      return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    return CUBLAS_STATUS_SUCCESS;
  }

  // The planned GEMMs, in one call on `stream`.
  cublasStatus_t Run(cudaStream_t stream) const {
    if (groups_ == 0) return CUBLAS_STATUS_SUCCESS;
    if (const cublasStatus_t s = cublasSetStream(handle_, stream); s != CUBLAS_STATUS_SUCCESS) {
      return s;
    }
    void** const p = device_ptrs_;
    return cublasGemmGroupedBatchedEx(
        handle_, ta_.data(), tb_.data(), m_.data(), rows_.data(), k_.data(), alpha_.data(),
        const_cast<const void* const*>(p), CUDA_R_16BF, lda_.data(),
        const_cast<const void* const*>(p + stride_), CUDA_R_16BF, ldb_.data(), beta_.data(),
        p + 2 * stride_, CUDA_R_16BF, ldc_.data(), groups_, group_size_.data(), CUBLAS_COMPUTE_32F);
  }

  // Experts with rows in the last plan: the problems of one call.
  int groups() const { return groups_; }

 private:
  cublasHandle_t handle_ = nullptr;
  int max_experts_ = 0;
  void** device_ptrs_ = nullptr;  // [3][stride_]: every group's W_e, then a_e, then y_e
  std::vector<void*> ptrs_;
  int groups_ = 0, stride_ = 0;
  std::vector<int> m_, rows_, k_, lda_, ldb_, ldc_, group_size_;
  std::vector<cublasOperation_t> ta_, tb_;
  std::vector<float> alpha_, beta_;
};

}  // namespace draftfeed::bench
