// Deterministic random token ids for the service tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace draftfeed::testing {

inline std::vector<int32_t> RandomTokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> d(0, vocab - 1);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = d(rng);
  return t;
}

}  // namespace draftfeed::testing
