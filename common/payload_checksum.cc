#include "common/payload_checksum.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace draftfeed::v1 {
namespace {

constexpr size_t kStripeBytes = 8 * kChecksumLanes;

#if defined(__x86_64__)
// SSE2 is part of x86-64, so this one needs no check. Two lanes per register.
template <bool kCopy>
void StripesSse2(uint64_t* lanes, uint64_t stripe, unsigned char* dst, const unsigned char* src,
                 size_t count) {
  __m128i acc[4], key[4];
  for (int i = 0; i < 4; ++i) {
    acc[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(lanes + 2 * i));
    key[i] = _mm_set_epi64x(static_cast<long long>(LaneKey(2 * i + 1) + stripe * kStripeStep),
                            static_cast<long long>(LaneKey(2 * i) + stripe * kStripeStep));
  }
  const __m128i step = _mm_set1_epi64x(static_cast<long long>(kStripeStep));
  for (size_t s = 0; s < count; ++s, src += kStripeBytes) {
    for (int i = 0; i < 4; ++i) {
      const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * i));
      if constexpr (kCopy) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * i), w);
      const __m128i x = _mm_xor_si128(w, key[i]);
      acc[i] = _mm_add_epi64(acc[i], _mm_add_epi64(_mm_mul_epu32(x, _mm_srli_epi64(x, 32)), w));
      key[i] = _mm_add_epi64(key[i], step);
    }
    if constexpr (kCopy) dst += kStripeBytes;
  }
  for (int i = 0; i < 4; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(lanes + 2 * i), acc[i]);
}

// Four lanes per register; chosen at run time where the CPU has AVX2.
template <bool kCopy>
__attribute__((target("avx2"))) void StripesAvx2(uint64_t* lanes, uint64_t stripe,
                                                 unsigned char* dst, const unsigned char* src,
                                                 size_t count) {
  auto key_at = [stripe](int l) {
    return static_cast<long long>(LaneKey(l) + stripe * kStripeStep);
  };
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + 4));
  __m256i k0 = _mm256_set_epi64x(key_at(3), key_at(2), key_at(1), key_at(0));
  __m256i k1 = _mm256_set_epi64x(key_at(7), key_at(6), key_at(5), key_at(4));
  const __m256i step = _mm256_set1_epi64x(static_cast<long long>(kStripeStep));
  for (size_t s = 0; s < count; ++s, src += kStripeBytes) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    if constexpr (kCopy) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), w0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), w1);
      dst += kStripeBytes;
    }
    const __m256i x0 = _mm256_xor_si256(w0, k0);
    const __m256i x1 = _mm256_xor_si256(w1, k1);
    a0 =
        _mm256_add_epi64(a0, _mm256_add_epi64(_mm256_mul_epu32(x0, _mm256_srli_epi64(x0, 32)), w0));
    a1 =
        _mm256_add_epi64(a1, _mm256_add_epi64(_mm256_mul_epu32(x1, _mm256_srli_epi64(x1, 32)), w1));
    k0 = _mm256_add_epi64(k0, step);
    k1 = _mm256_add_epi64(k1, step);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lanes + 4), a1);
}

std::atomic<int> forced_path{0};  // UseChecksumPathForTesting

void Stripes(uint64_t* lanes, uint64_t stripe, unsigned char* dst, const unsigned char* src,
             size_t count) {
  static const bool have_avx2 = __builtin_cpu_supports("avx2");
  const int forced = forced_path.load(std::memory_order_relaxed);
  if (forced == 2 || (forced == 0 && have_avx2)) {
    dst != nullptr ? StripesAvx2<true>(lanes, stripe, dst, src, count)
                   : StripesAvx2<false>(lanes, stripe, dst, src, count);
  } else {
    dst != nullptr ? StripesSse2<true>(lanes, stripe, dst, src, count)
                   : StripesSse2<false>(lanes, stripe, dst, src, count);
  }
}
bool UsePath(int path) {
  if (path == 2 && !__builtin_cpu_supports("avx2")) return false;
  if (path < 0 || path > 2) return false;
  forced_path.store(path);
  return true;
}
#else
bool UsePath(int path) { return path == 0; }

void StripesScalar(uint64_t* lanes, uint64_t stripe, unsigned char* dst, const unsigned char* src,
                   size_t count) {
  for (size_t s = 0; s < count; ++s, src += kStripeBytes) {
    uint64_t w[kChecksumLanes];
    std::memcpy(w, src, kStripeBytes);
    if (dst != nullptr) {
      std::memcpy(dst, w, kStripeBytes);
      dst += kStripeBytes;
    }
    for (int l = 0; l < kChecksumLanes; ++l) lanes[l] += ChecksumTerm(w[l], stripe + s, l);
  }
}

void Stripes(uint64_t* lanes, uint64_t stripe, unsigned char* dst, const unsigned char* src,
             size_t count) {
  StripesScalar(lanes, stripe, dst, src, count);
}
#endif

}  // namespace

bool UseChecksumPathForTesting(int path) { return UsePath(path); }

void PayloadHasher::Reset() {
  for (uint64_t& l : lanes_) l = 0;
  pending_bytes_ = 0;
  seen_ = 0;
}

void PayloadHasher::Consume(void* dst_v, const void* src_v, size_t n) {
  auto* dst = static_cast<unsigned char*>(dst_v);
  const auto* src = static_cast<const unsigned char*>(src_v);
  uint64_t stripe = (seen_ - pending_bytes_) / kStripeBytes;
  seen_ += n;
  if (pending_bytes_ > 0) {
    const size_t take = std::min(kStripeBytes - pending_bytes_, n);
    std::memcpy(pending_ + pending_bytes_, src, take);
    if (dst != nullptr) {
      std::memcpy(dst, src, take);
      dst += take;
    }
    src += take;
    n -= take;
    pending_bytes_ += take;
    if (pending_bytes_ < kStripeBytes) return;
    Stripes(lanes_, stripe++, nullptr, pending_, 1);
    pending_bytes_ = 0;
  }
  const size_t whole = n / kStripeBytes;
  if (whole > 0) {
    Stripes(lanes_, stripe, dst, src, whole);
    const size_t bytes = whole * kStripeBytes;
    src += bytes;
    if (dst != nullptr) dst += bytes;
    n -= bytes;
  }
  if (n > 0) {
    std::memcpy(pending_, src, n);
    if (dst != nullptr) std::memcpy(dst, src, n);
    pending_bytes_ = n;
  }
}

uint64_t PayloadHasher::Finish() const {
  uint64_t lanes[kChecksumLanes];
  for (int l = 0; l < kChecksumLanes; ++l) lanes[l] = lanes_[l];
  const uint64_t stripe = (seen_ - pending_bytes_) / kStripeBytes;
  for (size_t b = 0, l = 0; b < pending_bytes_; b += 8, ++l) {
    uint64_t w = 0;
    std::memcpy(&w, pending_ + b, std::min<size_t>(8, pending_bytes_ - b));
    lanes[l] += ChecksumTerm(w, stripe, static_cast<int>(l));
  }
  return FinishPayloadChecksum(lanes, seen_);
}

uint64_t PayloadChecksum(const void* data, size_t n) {
  PayloadHasher h;
  h.Update(data, n);
  return h.Finish();
}

uint64_t PayloadChecksumReference(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t lanes[kChecksumLanes] = {};
  for (size_t i = 0; i * 8 < n; ++i) {
    uint64_t w = 0;
    std::memcpy(&w, p + i * 8, std::min<size_t>(8, n - i * 8));
    lanes[i % kChecksumLanes] +=
        ChecksumTerm(w, i / kChecksumLanes, static_cast<int>(i % kChecksumLanes));
  }
  return FinishPayloadChecksum(lanes, n);
}

}  // namespace draftfeed::v1
