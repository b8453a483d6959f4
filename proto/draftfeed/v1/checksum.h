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

// Fed in pieces (a batch's chunks, in order), so a client can hash each chunk
// while it is still in cache instead of re-reading the whole batch.
class PayloadHasher {
 public:
  explicit PayloadHasher(size_t total_bytes) { Reset(total_bytes); }

  void Reset(size_t total_bytes) {
    total_ = total_bytes;
    seen_ = 0;
    pending_ = 0;
    const uint64_t seed = 0xcbf29ce484222325ULL ^ static_cast<uint64_t>(total_bytes);
    for (int l = 0; l < 4; ++l) h_[l] = seed ^ static_cast<uint64_t>(l);
    seed_ = seed;
  }

  void Update(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    seen_ += n;
    // Complete a partly filled 32-byte block first.
    while (pending_ > 0 && n > 0) {
      buf_[pending_++] = *p++;
      --n;
      if (pending_ == 32) {
        Block(buf_);
        pending_ = 0;
      }
    }
    for (; n >= 32; n -= 32, p += 32) Block(p);
    for (; n > 0; --n) buf_[pending_++] = *p++;
  }

  // The tail (< 32 bytes) goes word by word into lanes 0.., as PayloadChecksum does.
  uint64_t Finish() const {
    constexpr uint64_t kPrime = 0x100000001b3ULL;
    uint64_t h[4] = {h_[0], h_[1], h_[2], h_[3]};
    size_t i = 0, lane = 0;
    for (; i + 8 <= pending_; i += 8, ++lane) {
      uint64_t w;
      std::memcpy(&w, buf_ + i, 8);
      h[lane] = (h[lane] ^ w) * kPrime;
    }
    if (i < pending_) {
      uint64_t w = 0;
      std::memcpy(&w, buf_ + i, pending_ - i);
      h[lane] = (h[lane] ^ w) * kPrime;
    }
    uint64_t out = seed_;
    for (int l = 0; l < 4; ++l) out = (out ^ h[l]) * kPrime;
    return out;
  }

  size_t bytes_seen() const { return seen_; }
  size_t total_bytes() const { return total_; }

 private:
  void Block(const unsigned char* p) {
    constexpr uint64_t kPrime = 0x100000001b3ULL;
    uint64_t w[4];
    std::memcpy(w, p, 32);
    for (int l = 0; l < 4; ++l) h_[l] = (h_[l] ^ w[l]) * kPrime;
  }

  uint64_t h_[4];
  uint64_t seed_ = 0;
  unsigned char buf_[32];
  size_t pending_ = 0;
  size_t seen_ = 0;
  size_t total_ = 0;
};

inline uint64_t PayloadChecksum(const void* data, size_t n) {
  PayloadHasher h(n);
  h.Update(data, n);
  return h.Finish();
}

// The BatchDone checksum of TRANSPORT_NCCL payloads, which never touch host
// memory: both ends compute it on their GPU (kernels/checksum.cuh), so it is
// a sum and parallelises. Words w_i (little-endian u64, the tail zero-padded)
// are mixed, weighted by the odd number 2i+1 (a flipped bit or two swapped
// words change the sum) and added mod 2^64; the byte count is folded in last.
// constexpr so that the GPU kernel calls this same function (nvcc
// --expt-relaxed-constexpr).
constexpr uint64_t PositionalMix(uint64_t w) {
  w ^= w >> 31;
  w *= 0x9e3779b97f4a7c15ULL;
  w ^= w >> 29;
  return w;
}

inline uint64_t PositionalFinish(uint64_t sum, size_t n) {
  return PositionalMix(sum ^ (static_cast<uint64_t>(n) * 0xff51afd7ed558ccdULL));
}

// CPU reference of the GPU kernel (bit-identical by construction: integer maths).
inline uint64_t PositionalChecksum(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t sum = 0;
  size_t i = 0;
  for (; (i + 1) * 8 <= n; ++i) {
    uint64_t w;
    std::memcpy(&w, p + i * 8, 8);
    sum += PositionalMix(w) * (2 * static_cast<uint64_t>(i) + 1);
  }
  if (i * 8 < n) {
    uint64_t w = 0;
    std::memcpy(&w, p + i * 8, n - i * 8);
    sum += PositionalMix(w) * (2 * static_cast<uint64_t>(i) + 1);
  }
  return PositionalFinish(sum, n);
}

}  // namespace draftfeed::v1
