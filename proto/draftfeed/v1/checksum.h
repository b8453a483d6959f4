// The BatchDone checksum, part of the protocol so target and client share one
// definition: FNV-1a 64 folded over the batch's whole payload as little-endian
// 64-bit words (8x faster than byte-wise FNV), a zero-padded word for the tail.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace draftfeed::v1 {

inline uint64_t PayloadChecksum(const void* data, size_t n) {
  constexpr uint64_t kPrime = 0x100000001b3ULL;
  uint64_t h = 0xcbf29ce484222325ULL ^ static_cast<uint64_t>(n);
  const auto* p = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * kPrime;
  }
  if (i < n) {
    uint64_t w = 0;
    std::memcpy(&w, p + i, n - i);
    h = (h ^ w) * kPrime;
  }
  return h;
}

}  // namespace draftfeed::v1
