// The BatchDone checksum, part of the protocol so target and client share one
// definition. FNV-1a-style multiply-xor over little-endian 64-bit words in
// four interleaved lanes (word i goes to lane i % 4), so the four multiply
// chains run in parallel (~4x the single-chain rate, well above wire speed);
// the tail is zero-padded into a last word, and the lanes are folded in order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace draftfeed::v1 {

inline uint64_t PayloadChecksum(const void* data, size_t n) {
  constexpr uint64_t kPrime = 0x100000001b3ULL;
  const uint64_t seed = 0xcbf29ce484222325ULL ^ static_cast<uint64_t>(n);
  uint64_t h[4] = {seed, seed ^ 1, seed ^ 2, seed ^ 3};
  const auto* p = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, 32);
    for (int l = 0; l < 4; ++l) h[l] = (h[l] ^ w[l]) * kPrime;
  }
  size_t lane = 0;
  for (; i + 8 <= n; i += 8, ++lane) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h[lane] = (h[lane] ^ w) * kPrime;
  }
  if (i < n) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, n - i);
    h[lane] = (h[lane] ^ w) * kPrime;
  }
  uint64_t out = seed;
  for (int l = 0; l < 4; ++l) out = (out ^ h[l]) * kPrime;
  return out;
}

}  // namespace draftfeed::v1
