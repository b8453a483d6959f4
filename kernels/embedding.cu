#include "kernels/embedding.cuh"

#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

using vec::kVec;

// col counts 16-byte vectors of the row (8 elements).
struct GatherVec {
  const int32_t* ids;
  const bf16* table;
  int64_t width;
  float* out;

  __device__ void operator()(int64_t t, int64_t col) const {
    float v[kVec];
    vec::LoadBf16x8(table + static_cast<int64_t>(ids[t]) * width + col * kVec, v);
    vec::StoreF32x8(out + t * width + col * kVec, v);
  }
};

struct GatherScalar {
  const int32_t* ids;
  const bf16* table;
  int64_t width;
  float* out;

  __device__ void operator()(int64_t t, int64_t i) const {
    out[t * width + i] = __bfloat162float(table[static_cast<int64_t>(ids[t]) * width + i]);
  }
};

}  // namespace

cudaError_t EmbeddingLookup(const int32_t* ids, int64_t num_tokens, const bf16* table,
                            int64_t width, float* out, cudaStream_t stream) {
  if (num_tokens < 0 || width < 0) return cudaErrorInvalidValue;
  if (width % kVec == 0 && vec::Aligned16(table) && vec::Aligned16(out)) {
    return vec::LaunchRows(GatherVec{ids, table, width, out}, num_tokens, width / kVec, stream);
  }
  return vec::LaunchRows(GatherScalar{ids, table, width, out}, num_tokens, width, stream);
}

}  // namespace draftfeed::cuda
