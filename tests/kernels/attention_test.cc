#include "kernels/cpu/attention.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace draftfeed::cpu {
namespace {

std::vector<float> Random(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<int32_t> Offsets(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

// Dense reference in double: a full T×T score matrix with the block-diagonal
// causal mask applied explicitly (what the kernel must never build).
std::vector<double> NaiveAttention(const std::vector<float>& q, const std::vector<float>& k,
                                   const std::vector<float>& v, const std::vector<int32_t>& lens,
                                   int64_t hq, int64_t hkv, int64_t hd, double scale) {
  const std::vector<int32_t> cu = Offsets(lens);
  const int64_t t_total = cu.back();
  std::vector<int> seq_of(t_total);
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    for (int32_t t = cu[s]; t < cu[s + 1]; ++t) seq_of[t] = static_cast<int>(s);
  }
  std::vector<double> out(t_total * hq * hd, 0.0);
  std::vector<double> scores(t_total);
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kvh = h / (hq / hkv);
    for (int64_t t = 0; t < t_total; ++t) {
      double mx = -INFINITY;
      for (int64_t u = 0; u < t_total; ++u) {
        const bool visible = seq_of[u] == seq_of[t] && u <= t;
        if (!visible) {
          scores[u] = -INFINITY;
          continue;
        }
        double dot = 0;
        for (int64_t d = 0; d < hd; ++d)
          dot += double(q[(t * hq + h) * hd + d]) * k[(u * hkv + kvh) * hd + d];
        scores[u] = dot * scale;
        mx = std::max(mx, scores[u]);
      }
      double sum = 0;
      for (int64_t u = 0; u < t_total; ++u) sum += scores[u] = std::exp(scores[u] - mx);
      for (int64_t u = 0; u < t_total; ++u) {
        for (int64_t d = 0; d < hd; ++d) {
          out[(t * hq + h) * hd + d] += scores[u] / sum * v[(u * hkv + kvh) * hd + d];
        }
      }
    }
  }
  return out;
}

TEST(AttentionTest, TwoTokensByHand) {
  // head_dim 1, scale 1: token 1 scores [q·k0, q·k1] = [0, ln 3], so its
  // weights are [1/4, 3/4] and its output 4/4 + 3·8/4 = 7; token 0 sees only
  // itself. fp32 exp/log round-off: 1e-6.
  const std::vector<float> q = {0.5f, 1.0f}, k = {0.0f, std::log(3.0f)}, v = {4, 8};
  const std::vector<int32_t> cu = {0, 2};
  std::vector<float> out(2);
  VarlenCausalAttention(q.data(), k.data(), v.data(), cu.data(), 1, 1, 1, 1, 1.0f, out.data(), 1);
  EXPECT_NEAR(out[0], 4.0, 1e-6);
  EXPECT_NEAR(out[1], 7.0, 1e-5);
}

TEST(AttentionTest, MatchesDenseMaskedReferenceOnOddSizes) {
  // fp32 dots over ≤ 40 terms, one exp per score and a ≤ 70-term weighted sum
  // of O(1) values: errors stay near 1e-6; 2e-5 absolute leaves a margin.
  for (int64_t hd : {13, 40}) {
    const std::vector<int32_t> lens = {1, 7, 19, 33, 2};
    const int64_t hq = 6, hkv = 2, t_total = 62;
    const std::vector<float> q = Random(t_total * hq * hd, 1), k = Random(t_total * hkv * hd, 2),
                             v = Random(t_total * hkv * hd, 3);
    const std::vector<int32_t> cu = Offsets(lens);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    std::vector<float> out(t_total * hq * hd);
    VarlenCausalAttention(q.data(), k.data(), v.data(), cu.data(), 5, hq, hkv, hd, scale,
                          out.data(), 3);
    const std::vector<double> want = NaiveAttention(q, k, v, lens, hq, hkv, hd, scale);
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_NEAR(out[i], want[i], 2e-5) << "hd " << hd << " at " << i;
  }
}

TEST(AttentionTest, PackedEqualsSeparateAndThreadCountDoesNotMatter) {
  // Every query row is computed on its own, so the bits must agree exactly.
  const std::vector<int32_t> lens = {5, 1, 40, 17};
  const int64_t hq = 4, hkv = 1, hd = 24, t_total = 63;
  const std::vector<float> q = Random(t_total * hq * hd, 4), k = Random(t_total * hkv * hd, 5),
                           v = Random(t_total * hkv * hd, 6);
  const std::vector<int32_t> cu = Offsets(lens);
  const float scale = 1.0f / std::sqrt(24.0f);
  std::vector<float> packed(t_total * hq * hd), packed8(t_total * hq * hd);
  VarlenCausalAttention(q.data(), k.data(), v.data(), cu.data(), 4, hq, hkv, hd, scale,
                        packed.data(), 1);
  VarlenCausalAttention(q.data(), k.data(), v.data(), cu.data(), 4, hq, hkv, hd, scale,
                        packed8.data(), 8);
  EXPECT_EQ(packed, packed8);
  for (size_t s = 0; s < lens.size(); ++s) {
    const int64_t b = cu[s], n = lens[s];
    const std::vector<int32_t> one = {0, lens[s]};
    std::vector<float> alone(n * hq * hd);
    VarlenCausalAttention(q.data() + b * hq * hd, k.data() + b * hkv * hd, v.data() + b * hkv * hd,
                          one.data(), 1, hq, hkv, hd, scale, alone.data(), 2);
    for (int64_t i = 0; i < n * hq * hd; ++i) {
      ASSERT_EQ(alone[i], packed[b * hq * hd + i]) << "sequence " << s << " element " << i;
    }
  }
}

TEST(AttentionTest, GqaQueryHeadsShareTheirKvHead) {
  // Query heads 0..2 read KV head 0 and 3..5 KV head 1: with equal queries,
  // outputs are equal within a group and differ across groups.
  const int64_t hq = 6, hkv = 2, hd = 8, t_total = 9;
  std::vector<float> q(t_total * hq * hd);
  const std::vector<float> qh = Random(t_total * hd, 9);
  for (int64_t t = 0; t < t_total; ++t) {
    for (int64_t h = 0; h < hq; ++h) {
      for (int64_t d = 0; d < hd; ++d) q[(t * hq + h) * hd + d] = qh[t * hd + d];
    }
  }
  const std::vector<float> k = Random(t_total * hkv * hd, 10), v = Random(t_total * hkv * hd, 11);
  const std::vector<int32_t> cu = {0, t_total};
  std::vector<float> out(t_total * hq * hd);
  VarlenCausalAttention(q.data(), k.data(), v.data(), cu.data(), 1, hq, hkv, hd, 0.3f, out.data(),
                        2);
  const int64_t t = t_total - 1;
  auto at = [&](int64_t h, int64_t d) { return out[(t * hq + h) * hd + d]; };
  for (int64_t d = 0; d < hd; ++d) {
    EXPECT_EQ(at(1, d), at(0, d));
    EXPECT_EQ(at(2, d), at(0, d));
    EXPECT_EQ(at(4, d), at(3, d));
    EXPECT_EQ(at(5, d), at(3, d));
  }
  EXPECT_NE(at(0, 0), at(3, 0));
}

}  // namespace
}  // namespace draftfeed::cpu
