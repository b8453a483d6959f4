// The BatchDone checksum, part of the protocol so target and client share one
// definition, for every transport (gRPC and NCCL alike).
//
// The payload's n bytes are read as little-endian 64-bit words w_i (the last
// one zero-padded), grouped in stripes of 8: word i is lane i % 8 of stripe
// i / 8. Each word adds
//
//     x_i = w_i ^ (LaneKey(i % 8) + (i / 8) * kStripeStep)
//     term_i = lo32(x_i) * hi32(x_i) + w_i            (mod 2^64)
//
// to its lane's sum, and the eight sums are folded in lane order with the
// byte count: FinishPayloadChecksum. The key depends on the word's position,
// so moved or swapped data changes the sum; w_i itself is added so that a
// change the product cannot see (x_i with a zero half) still shows.
//
// Why this shape: a 32x32->64 multiply per word is one SIMD instruction per
// four words (AVX2 vpmuludq), so the client hashes each chunk while copying it
// out of gRPC's buffers at memcpy speed (8x the multiply-chain hash this
// replaced: docs/performance.md, "Figures behind the code's choices"); and the lanes are
// plain sums, so a GPU computes them in parallel (kernels/checksum.cuh) and
// NCCL payloads, and a CUDA target's gRPC payloads, are checked where they are.
//
// This header is constexpr and intrinsic-free and depends on nothing, so the GPU
// kernel (kernels/checksum.cu) and the host hasher (common/payload_checksum.h)
// share one definition.
#pragma once

#include <cstddef>
#include <cstdint>

namespace draftfeed::v1 {

inline constexpr int kChecksumLanes = 8;
inline constexpr uint64_t kStripeStep = 0x9e3779b97f4a7c15ULL;

// A bijective 64-bit mixer (xor-shift, odd multiply, xor-shift).
constexpr uint64_t Mix(uint64_t w) {
  w ^= w >> 31;
  w *= 0xbf58476d1ce4e5b9ULL;
  w ^= w >> 29;
  return w;
}

constexpr uint64_t LaneKey(int lane) { return Mix(static_cast<uint64_t>(lane + 1) * kStripeStep); }

// Word `w` under `key` = LaneKey(lane) + stripe * kStripeStep.
constexpr uint64_t KeyedTerm(uint64_t w, uint64_t key) {
  const uint64_t x = w ^ key;
  return (x & 0xffffffffULL) * (x >> 32) + w;
}

// Word `w` at index i = stripe * 8 + lane.
constexpr uint64_t ChecksumTerm(uint64_t w, uint64_t stripe, int lane) {
  return KeyedTerm(w, LaneKey(lane) + stripe * kStripeStep);
}

// `lanes`: the kChecksumLanes sums, in lane order.
constexpr uint64_t FinishPayloadChecksum(const uint64_t* lanes, uint64_t n) {
  uint64_t h = Mix(n * 0xff51afd7ed558ccdULL + 0x2545f4914f6cdd1dULL);
  for (int l = 0; l < kChecksumLanes; ++l) h = Mix(h ^ lanes[l]) + static_cast<uint64_t>(l);
  return h;
}

}  // namespace draftfeed::v1
