// The fp8_e4m3 capture encoder on the GPU: a [T, K, H] bf16 capture into the
// wire layout of common/fp8_capture.h (per token K*H e4m3 codes, layer-major,
// then K little-endian fp32 scales), bit for bit what EncodeFp8CaptureBf16
// writes on the host: the same amax (fmaxf over the row's magnitudes), scale
// (IEEE amax / 448, 1 where that is not > 0), division (__fdiv_rn, never a
// reciprocal) and round-to-nearest-even satfinite conversion.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common.cuh"

namespace draftfeed::cuda {

// `capture` [T, K, H] bf16, token-major; `out` T * (K*H + 4K) bytes, which
// must not overlap it. Any alignment.
cudaError_t EncodeFp8Capture(const bf16* capture, int64_t num_tokens, int64_t num_layers,
                             int64_t hidden, uint8_t* out, cudaStream_t stream);

}  // namespace draftfeed::cuda
