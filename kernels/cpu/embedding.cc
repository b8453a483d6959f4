#include "kernels/cpu/embedding.h"

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace draftfeed::cpu {
namespace {

float Bf16Bits(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

// IEEE binary16 to binary32, exact (subnormals renormalised).
float Fp16Bits(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return std::bit_cast<float>(sign);
    exp = 127 - 15 + 1;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    return std::bit_cast<float>(sign | (exp << 23) | ((mant & 0x3FFu) << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

void CheckId(int32_t id, int64_t vocab, int64_t i) {
  if (id < 0 || id >= vocab) {
    std::fprintf(stderr, "draftfeed::cpu::Embedding: ids[%lld] = %d outside [0, %lld)\n",
                 static_cast<long long>(i), id, static_cast<long long>(vocab));
    std::abort();
  }
}

template <typename T, typename Widen>
void Gather(const T* table, int64_t vocab, int64_t width, const int32_t* ids, int64_t n, float* out,
            Widen widen) {
  for (int64_t i = 0; i < n; ++i) {
    CheckId(ids[i], vocab, i);
    const T* row = table + static_cast<int64_t>(ids[i]) * width;
    float* dst = out + i * width;
    for (int64_t d = 0; d < width; ++d) dst[d] = widen(row[d]);
  }
}

}  // namespace

void EmbeddingBf16(const uint16_t* table, int64_t vocab, int64_t width, const int32_t* ids,
                   int64_t n, float* out) {
  Gather(table, vocab, width, ids, n, out, Bf16Bits);
}

void EmbeddingFp16(const uint16_t* table, int64_t vocab, int64_t width, const int32_t* ids,
                   int64_t n, float* out) {
  Gather(table, vocab, width, ids, n, out, Fp16Bits);
}

void EmbeddingF32(const float* table, int64_t vocab, int64_t width, const int32_t* ids, int64_t n,
                  float* out) {
  for (int64_t i = 0; i < n; ++i) {
    CheckId(ids[i], vocab, i);
    std::memcpy(out + i * width, table + static_cast<int64_t>(ids[i]) * width,
                static_cast<size_t>(width) * sizeof(float));
  }
}

}  // namespace draftfeed::cpu
