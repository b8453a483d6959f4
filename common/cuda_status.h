// CUDA runtime errors as absl::Status, one wording for every CUDA user (the
// engine, the NCCL peer): "CUDA error in <what>: <cudaGetErrorString>".
#pragma once

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace draftfeed {

inline absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat("CUDA error in ", what, ": ", cudaGetErrorString(e)));
}

inline absl::Status CudaStatus(cudaError_t e, const char* what) {
  return e == cudaSuccess ? absl::OkStatus() : CudaError(e, what);
}

}  // namespace draftfeed

// Returns the CUDA error of `expr`, named by its text, from the enclosing
// function (which returns absl::Status or StatusOr).
#define DF_CUDA(expr)                                                                \
  do {                                                                               \
    const cudaError_t df_cuda_e_ = (expr);                                           \
    if (df_cuda_e_ != cudaSuccess) return ::draftfeed::CudaError(df_cuda_e_, #expr); \
  } while (0)
