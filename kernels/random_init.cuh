// Deterministic pseudo-random fill on the device, for random-weight models at
// real sizes (no 54 GB host buffer, no upload).
#pragma once

#include "kernels/common.cuh"

namespace draftfeed::cuda {

// p[i] = bf16(offset + scale·u_i), u_i uniform in [−√3, √3) (unit variance)
// from a counter-based hash of (seed, i): the same on every run and device.
cudaError_t FillRandomBf16(bf16* p, int64_t n, uint64_t seed, float scale, float offset,
                           cudaStream_t stream);
// The same in fp32 (A_log, dt_bias).
cudaError_t FillRandomF32(float* p, int64_t n, uint64_t seed, float scale, float offset,
                          cudaStream_t stream);
// Row r of a [rows, cols] tensor: p = bf16(offset + scale·exp(row_log_sigma·n_r)·u_i),
// n_r ~ N(0, 1) hashed from (seed, r) (Box-Muller), u_i as above: rows of
// unequal norm (a random MoE router whose experts are unevenly loaded).
cudaError_t FillRowScaledRandomBf16(bf16* p, int64_t rows, int64_t cols, uint64_t seed, float scale,
                                    float offset, float row_log_sigma, cudaStream_t stream);
// p[i] = log(lo + (hi − lo)·u_i), u_i uniform in [0, 1) from the same hash (a
// log-uniform, as for GDN's A_log = log(U(1, 16))).
cudaError_t FillLogUniformBf16(bf16* p, int64_t n, uint64_t seed, float lo, float hi,
                               cudaStream_t stream);
cudaError_t FillLogUniformF32(float* p, int64_t n, uint64_t seed, float lo, float hi,
                              cudaStream_t stream);

}  // namespace draftfeed::cuda
