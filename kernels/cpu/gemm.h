// CPU reference GEMM in the layout of a linear layer: Y = X·Wᵀ.
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

// Y[M,N] = X[M,K] · W[N,K]ᵀ, all fp32 and row-major with dense rows; Y is
// overwritten. Cache-blocked, on up to num_threads threads (<= 0: all cores).
// Each Y element is the sum over k in ascending order, whatever M, N, the
// thread count or the element's position in a tile, so a row of Y depends only
// on the matching row of X: packed and separate batches give identical bits.
void Gemm(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k,
          int num_threads);

}  // namespace draftfeed::cpu
