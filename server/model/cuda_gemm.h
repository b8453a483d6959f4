// bf16 GEMMs through cuBLASLt: Y[M, N] = X[M, K]·W[N, K]ᵀ, row-major, fp32
// accumulation; one plan (descriptors + heuristic algorithm) cached per shape.
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

namespace draftfeed {

#define DF_CUBLAS_OK(expr)                                                          \
  do {                                                                              \
    cublasStatus_t df_s_ = (expr);                                                  \
    if (df_s_ != CUBLAS_STATUS_SUCCESS) {                                           \
      return absl::InternalError(                                                   \
          absl::StrCat("cuBLASLt error ", static_cast<int>(df_s_), " in ", #expr)); \
    }                                                                               \
  } while (0)

// What every cuBLASLt GEMM of the engine holds: the handle, the workspace
// preference and one plan (descriptors + algorithm) per shape, keyed by
// (M, N, K, Y's row stride); the plans are freed with it.
class CublasLtPlans {
 public:
  CublasLtPlans() = default;
  CublasLtPlans(const CublasLtPlans&) = delete;
  CublasLtPlans& operator=(const CublasLtPlans&) = delete;
  ~CublasLtPlans() {
    for (auto& [key, plan] : plans_) plan.Destroy();
    if (pref_) cublasLtMatmulPreferenceDestroy(pref_);
    if (handle_) cublasLtDestroy(handle_);
  }

  absl::Status Init(void* workspace, size_t workspace_bytes) {
    workspace_ = workspace;
    workspace_bytes_ = workspace_bytes;
    DF_CUBLAS_OK(cublasLtCreate(&handle_));
    DF_CUBLAS_OK(cublasLtMatmulPreferenceCreate(&pref_));
    DF_CUBLAS_OK(cublasLtMatmulPreferenceSetAttribute(pref_,
                                                      CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &workspace_bytes_, sizeof(workspace_bytes_)));
    return absl::OkStatus();
  }

 protected:
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    void Destroy() {
      if (desc) cublasLtMatmulDescDestroy(desc);
      for (cublasLtMatrixLayout_t l : {a, b, c}) {
        if (l) cublasLtMatrixLayoutDestroy(l);
      }
    }
  };
  using PlanKey = std::tuple<int64_t, int64_t, int64_t, int64_t>;

  cublasLtHandle_t handle_ = nullptr;
  cublasLtMatmulPreference_t pref_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<PlanKey, Plan> plans_;
};

// Y[M, N] = X[M, K]·W[N, K]ᵀ, row-major bf16, fp32 accumulation. In cuBLAS's
// column-major terms that is Yᵀ[N, M] = (W as K×N)ᵀ · (X as K×M): a "TN" GEMM.
class CublasLtGemm : public CublasLtPlans {
 public:
  ~CublasLtGemm() {
    for (auto& [key, plan] : f32_plans_) plan.Destroy();
  }

  // Time the candidate algorithms of each new shape once and keep the fastest
  // (cuBLASLt's first heuristic pick is often a few % off the best).
  void set_autotune(bool on) { autotune_ = on; }

  // `ldy` (0: n) is Y's row stride, so a GEMM can fill some columns of a
  // wider output (the bf16 tail of a partly FP8 fused projection).
  absl::Status Run(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int64_t m,
                   int64_t n, int64_t k, cudaStream_t stream, int64_t ldy = 0) {
    return RunAs(CUDA_R_16BF, x, w, y, m, n, k, stream, ldy == 0 ? n : ldy, plans_, tuned_);
  }

  // The same with an fp32 Y: lm_head's logits, whose softmax a bf16 rounding
  // (2^-8 relative, ~0.1 absolute at logit 30) would blur.
  absl::Status RunF32(const __nv_bfloat16* x, const __nv_bfloat16* w, float* y, int64_t m,
                      int64_t n, int64_t k, cudaStream_t stream) {
    return RunAs(CUDA_R_32F, x, w, y, m, n, k, stream, n, f32_plans_, f32_tuned_);
  }

 private:
  using Tuned = std::map<std::tuple<int64_t, int64_t, int64_t>, cublasLtMatmulAlgo_t>;

  absl::Status RunAs(cudaDataType_t y_type, const void* x, const void* w, void* y, int64_t m,
                     int64_t n, int64_t k, cudaStream_t stream, int64_t ldy,
                     std::map<PlanKey, Plan>& plans, Tuned& tuned) {
    auto key = std::make_tuple(m, n, k, ldy);
    auto it = plans.find(key);
    if (it == plans.end()) {
      Plan p;
      DF_CUBLAS_OK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      DF_CUBLAS_OK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
      DF_CUBLAS_OK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
      DF_CUBLAS_OK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, k));
      DF_CUBLAS_OK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
      DF_CUBLAS_OK(cublasLtMatrixLayoutCreate(&p.c, y_type, n, m, ldy));
      if (absl::Status s = ChooseAlgo(p, x, w, y, m, n, k, stream, tuned); !s.ok()) {
        p.Destroy();
        return s;
      }
      it = plans.emplace(key, p).first;
    }
    const Plan& plan = it->second;
    const float alpha = 1.0f, beta = 0.0f;
    DF_CUBLAS_OK(cublasLtMatmul(handle_, plan.desc, &alpha, w, plan.a, x, plan.b, &beta, y, plan.c,
                                y, plan.c, &plan.algo, workspace_, workspace_bytes_, stream));
    return absl::OkStatus();
  }

  // Shapes whose M differs only a little share the tuned algorithm (checked
  // for the exact layout), so a trainer's varying batch sizes tune rarely.
  static int64_t Bucket(int64_t m) { return (m + 2047) / 2048; }

  absl::Status ChooseAlgo(Plan& p, const void* x, const void* w, void* y, int64_t m, int64_t n,
                          int64_t k, cudaStream_t stream, Tuned& tuned_algos) {
    auto tuned = tuned_algos.find(std::make_tuple(Bucket(m), n, k));
    if (tuned != tuned_algos.end()) {
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(handle_, p.desc, p.a, p.b, p.c, p.c, &tuned->second, &check) ==
          CUBLAS_STATUS_SUCCESS) {
        p.algo = tuned->second;
        return absl::OkStatus();
      }
    }
    constexpr int kCandidates = 8;
    cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
    int found = 0;
    DF_RETURN_IF_ERROR(SinglePassCandidates(p, autotune_ ? kCandidates : 1, results, &found));
    if (found == 0) {
      return absl::InternalError(absl::StrCat("cuBLASLt has no algorithm for ", m, "x", n, "x", k,
                                              " that sums K in one pass (split-K 1)"));
    }
    p.algo = results[0].algo;
    if (autotune_ && found > 1) {
      cudaEvent_t start, stop;
      cudaEventCreate(&start);
      cudaEventCreate(&stop);
      const float alpha = 1.0f, beta = 0.0f;
      float best = 1e30f;
      for (int i = 0; i < found; ++i) {
        float total = 0;
        bool ok = true;
        for (int rep = 0; rep < 4 && ok; ++rep) {  // first run warms up
          cudaEventRecord(start, stream);
          ok = cublasLtMatmul(handle_, p.desc, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c,
                              &results[i].algo, workspace_, workspace_bytes_,
                              stream) == CUBLAS_STATUS_SUCCESS;
          cudaEventRecord(stop, stream);
          cudaEventSynchronize(stop);
          float ms = 0;
          cudaEventElapsedTime(&ms, start, stop);
          if (rep > 0) total += ms;
        }
        if (ok && total < best) {
          best = total;
          p.algo = results[i].algo;
        }
      }
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
    }
    tuned_algos[std::make_tuple(Bucket(m), n, k)] = p.algo;
    return absl::OkStatus();
  }

  // Batch invariance: only algorithms that sum each output over K in one
  // pass. A split-K algorithm adds its partial sums in another order, and
  // cuBLASLt's heuristic picks one by M (a 96-column GEMM, the GDN gates'
  // in_proj_ba, gets split-K 3 at M = 1,500 and 1 at 5,200), so a token's
  // bits would follow the size of its batch. Among single-pass algorithms
  // the tile shape does not change a row's bits (tests/kernels/cuda/
  // gemm_batch_invariance_cuda_test.cc), so neither the M bucket nor the
  // timed choice below (which may differ from one start to the next) does.
  // Where the heuristic offers none, its first pick is taken with split-K
  // forced to 1, if cuBLASLt accepts that.
  absl::Status SinglePassCandidates(Plan& p, int want, cublasLtMatmulHeuristicResult_t* out,
                                    int* found) {
    constexpr int kAsk = 32;
    cublasLtMatmulHeuristicResult_t all[kAsk] = {};
    int offered = 0;
    DF_CUBLAS_OK(cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.c, p.c, pref_, kAsk,
                                                all, &offered));
    *found = 0;
    for (int i = 0; i < offered && *found < want; ++i) {
      if (SplitK(all[i].algo) == 1) out[(*found)++] = all[i];
    }
    if (*found == 0 && offered > 0) {
      cublasLtMatmulHeuristicResult_t forced = all[0];
      const int32_t one = 1;
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoConfigSetAttribute(&forced.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one,
                                               sizeof one) == CUBLAS_STATUS_SUCCESS &&
          cublasLtMatmulAlgoCheck(handle_, p.desc, p.a, p.b, p.c, p.c, &forced.algo, &check) ==
              CUBLAS_STATUS_SUCCESS) {
        out[(*found)++] = forced;
      }
    }
    return absl::OkStatus();
  }
  static int32_t SplitK(const cublasLtMatmulAlgo_t& algo) {
    int32_t splits = 1;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits,
                                             sizeof splits, &written) != CUBLAS_STATUS_SUCCESS) {
      return 0;  // unknown: not taken
    }
    return splits;
  }

  bool autotune_ = true;
  Tuned tuned_;
  std::map<PlanKey, Plan> f32_plans_;
  Tuned f32_tuned_;
};

}  // namespace draftfeed
