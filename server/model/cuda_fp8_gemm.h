// Fine-grained FP8 GEMMs through cuBLASLt: Y[M, N] (bf16) = X·Wᵀ where X is
// quantized per token and 128-wide K group and W is e4m3 with one fp32 scale
// per 128x128 block; fp32 accumulation, one bf16 rounding of Y. The operand
// layouts are kernels/fp8_gemm_operands.cuh's.
//
// cuBLASLt serves this as VEC128_32F scales on the activations and
// BLK128x128_32F on the weights ("TN", bf16 D). It offers one algorithm
// (its speed: docs/performance.md, "Figures behind the code's choices"),
// refuses M not a multiple of 4 (so M is padded) and is documented for
// sm_90 only, so creation checks that an algorithm exists and says so
// otherwise.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "server/model/cuda_gemm.h"

namespace draftfeed {

class CublasLtFp8Gemm : public CublasLtPlans {
 public:
  // m_pad: a multiple of 4 (Fp8RowsPadded); y has m_pad rows of stride ldy
  // (0: n). A plan (descriptors and the algorithm) is kept per shape; the
  // scale pointers are set on its descriptor at each call (a host-side write).
  absl::Status Run(const uint8_t* xq, const float* x_scale, const uint8_t* wq, const float* w_scale,
                   __nv_bfloat16* y, int64_t m_pad, int64_t n, int64_t k, cudaStream_t stream,
                   int64_t ldy = 0) {
    if (ldy == 0) ldy = n;
    if (m_pad % 4 != 0 || k % 128 != 0 || n % 16 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FP8 GEMM shape ", m_pad, "x", n, "x", k,
          ": needs M a multiple of 4, N of 16 and K of 128 (cuBLASLt's block-scaled mode)"));
    }
    auto key = std::make_tuple(m_pad, n, k, ldy);
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      Plan p;
      DF_CUBLAS_OK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      DF_CUBLAS_OK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
      DF_CUBLAS_OK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
      const cublasLtMatmulMatrixScale_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
      const cublasLtMatmulMatrixScale_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      DF_CUBLAS_OK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                  &a_mode, sizeof a_mode));
      DF_CUBLAS_OK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                  &b_mode, sizeof b_mode));
      DF_RETURN_IF_ERROR(SetScales(p.desc, x_scale, w_scale));
      // W as K×N column-major (transposed), X as K×M, Y as N×M: row-major Y[M, N].
      DF_CUBLAS_OK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_8F_E4M3, k, n, k));
      DF_CUBLAS_OK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_8F_E4M3, k, m_pad, k));
      DF_CUBLAS_OK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, n, m_pad, ldy));
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.c,
                                                              pref_, 1, &result, &found);
      if (s != CUBLAS_STATUS_SUCCESS || found == 0) {
        p.Destroy();
        return absl::FailedPreconditionError(absl::StrCat(
            "cuBLASLt offers no block-scaled FP8 GEMM for ", m_pad, "x", n, "x", k,
            " on this GPU (status ", static_cast<int>(s),
            "): it serves 128x128-block FP8 scales on sm_90 (Hopper) only; serve the bf16 "
            "checkpoint on this GPU"));
      }
      p.algo = result.algo;
      it = plans_.emplace(key, p).first;
    }
    const Plan& plan = it->second;
    DF_RETURN_IF_ERROR(SetScales(plan.desc, x_scale, w_scale));
    const float alpha = 1.0f, beta = 0.0f;
    DF_CUBLAS_OK(cublasLtMatmul(handle_, plan.desc, &alpha, wq, plan.a, xq, plan.b, &beta, y,
                                plan.c, y, plan.c, &plan.algo, workspace_, workspace_bytes_,
                                stream));
    return absl::OkStatus();
  }

 private:
  static absl::Status SetScales(cublasLtMatmulDesc_t desc, const float* x_scale,
                                const float* w_scale) {
    DF_CUBLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                &w_scale, sizeof w_scale));
    DF_CUBLAS_OK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                &x_scale, sizeof x_scale));
    return absl::OkStatus();
  }
};

}  // namespace draftfeed
