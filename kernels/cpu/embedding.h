// CPU reference embedding gather: rows of a [vocab, width] table to fp32.
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

// out[i, :] = table[ids[i], :] widened to fp32, for i < n. Ids must lie in
// [0, vocab) (callers validate input first; this aborts otherwise).
void EmbeddingBf16(const uint16_t* table, int64_t vocab, int64_t width, const int32_t* ids,
                   int64_t n, float* out);
void EmbeddingFp16(const uint16_t* table, int64_t vocab, int64_t width, const int32_t* ids,
                   int64_t n, float* out);
void EmbeddingF32(const float* table, int64_t vocab, int64_t width, const int32_t* ids, int64_t n,
                  float* out);

}  // namespace draftfeed::cpu
