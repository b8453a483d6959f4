// Batches the benchmarks share, so engine-only and end-to-end numbers are
// measured on the same shapes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "server/model/engine.h"
#include "server/model/model.h"

namespace draftfeed::bench {

// Sequence lengths uniform in [lo, hi] until the budget is full.
inline std::vector<int32_t> MixedLengths(int64_t tokens, int32_t lo, int32_t hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> d(lo, hi);
  std::vector<int32_t> lens;
  int64_t left = tokens;
  while (left > 0) {
    int32_t n = static_cast<int32_t>(std::min<int64_t>(d(rng), left));
    if (left - n > 0 && left - n < lo) n = static_cast<int32_t>(left);  // no tiny tail
    lens.push_back(n);
    left -= n;
  }
  return lens;
}

inline std::vector<int32_t> RandomTokens(int64_t tokens, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  std::mt19937_64 rng(seed);
  for (auto& t : ids) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return ids;
}

// `k` capture ids: k-1 decoder layers evenly spaced from layer 1, then the
// final norm (-1), as DFlash and EAGLE-3 trainers ask. Models too shallow for
// that (the tiny test models) give their first layers instead.
inline std::vector<int32_t> SpacedLayers(const ModelConfig& c, int32_t k) {
  k = std::max(1, k);
  const int64_t span = c.num_layers - 3;
  std::vector<int32_t> layers;
  for (int32_t i = 0; i + 1 < k; ++i) {
    layers.push_back(span >= k - 1 ? static_cast<int32_t>(1 + i * span / (k - 1))
                                   : static_cast<int32_t>(std::min<int64_t>(i, c.num_layers - 1)));
  }
  layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
  layers.push_back(kFinalLayerId);
  return layers;
}

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace draftfeed::bench
