// Shared by the CUDA kernel families: the bf16 type and a launch check.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace draftfeed::cuda {

using bf16 = __nv_bfloat16;

}  // namespace draftfeed::cuda
