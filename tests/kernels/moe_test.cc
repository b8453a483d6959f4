#include "kernels/cpu/moe.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace draftfeed::cpu {
namespace {

std::vector<float> Random(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

struct Route {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Route RouteOf(const std::vector<float>& logits, int64_t tokens, int64_t experts, int64_t k,
              bool renormalize) {
  Route r{std::vector<int32_t>(static_cast<size_t>(tokens * k), -1),
          std::vector<float>(static_cast<size_t>(tokens * k), NAN)};
  MoeRoute(logits.data(), tokens, experts, k, renormalize, r.ids.data(), r.weights.data());
  return r;
}

TEST(MoeRouteTest, HandComputedSoftmaxTopKAndRenormalisation) {
  // logits (0, ln 2, ln 4, ln 1): p = (1, 2, 4, 1) / 8.
  const std::vector<float> logits = {0.0f, std::log(2.0f), std::log(4.0f), 0.0f};
  const Route raw = RouteOf(logits, 1, 4, 2, false);
  EXPECT_EQ(raw.ids, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(raw.weights[0], 0.5, 1e-6);
  EXPECT_NEAR(raw.weights[1], 0.25, 1e-6);
  const Route norm = RouteOf(logits, 1, 4, 2, true);
  EXPECT_EQ(norm.ids, raw.ids);
  EXPECT_NEAR(norm.weights[0], 2.0 / 3.0, 1e-6);
  EXPECT_NEAR(norm.weights[1], 1.0 / 3.0, 1e-6);
  // k = E keeps every expert; renormalised, the weights sum to 1 in fp32.
  const Route all = RouteOf(logits, 1, 4, 4, true);
  EXPECT_EQ(all.ids, (std::vector<int32_t>{2, 1, 0, 3}));
  EXPECT_NEAR(all.weights[0] + all.weights[1] + all.weights[2] + all.weights[3], 1.0, 1e-6);
}

TEST(MoeRouteTest, ExactTiesGoToTheLowerExpertId) {
  // Token 0: all equal. Token 1: experts 5 and 2 tie for first, 7 and 3 for
  // third; the lower id ranks first in each tie.
  std::vector<float> logits(2 * 8, 0.25f);
  for (int e = 0; e < 8; ++e) logits[8 + e] = -1.0f;
  logits[8 + 5] = logits[8 + 2] = 3.0f;
  logits[8 + 7] = logits[8 + 3] = 1.0f;
  const Route r = RouteOf(logits, 2, 8, 3, false);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2, 2, 5, 3}));
  EXPECT_EQ(r.weights[0], r.weights[1]);
  EXPECT_NEAR(r.weights[0], 1.0 / 8.0, 1e-7);
  EXPECT_EQ(r.weights[3], r.weights[4]);
  const Route n = RouteOf(logits, 2, 8, 3, true);
  EXPECT_NEAR(n.weights[0], 1.0 / 3.0, 1e-7);
}

TEST(MoeRouteTest, RandomLogitsMatchNaiveSoftmaxAndSortedTopK) {
  const int64_t tokens = 37, experts = 19, k = 5;
  const std::vector<float> logits = Random(tokens * experts, 3, 4.0f);
  for (bool renormalize : {false, true}) {
    const Route r = RouteOf(logits, tokens, experts, k, renormalize);
    for (int64_t t = 0; t < tokens; ++t) {
      double z = 0;
      for (int64_t e = 0; e < experts; ++e) z += std::exp(double(logits[t * experts + e]));
      double kept = 0;
      for (int64_t j = 0; j < k; ++j)
        kept += std::exp(double(logits[t * experts + r.ids[t * k + j]]));
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = r.ids[t * k + j];
        // Sorted descending, distinct, and nothing left out beats the k-th.
        if (j > 0) {
          EXPECT_GT(logits[t * experts + r.ids[t * k + j - 1]], logits[t * experts + e]);
        }
        const double p = std::exp(double(logits[t * experts + e])) / (renormalize ? kept : z);
        EXPECT_NEAR(r.weights[t * k + j], p, 1e-6) << "t=" << t << " j=" << j;
      }
      const float kth = logits[t * experts + r.ids[t * k + k - 1]];
      int above = 0;
      for (int64_t e = 0; e < experts; ++e) above += logits[t * experts + e] >= kth;
      EXPECT_EQ(above, k) << "t=" << t;
    }
  }
}

// The experts' output computed directly per (token, slot) in double.
std::vector<double> NaiveExperts(const std::vector<float>& x, int64_t tokens, int64_t hidden,
                                 int64_t inter, const std::vector<float>& gate_up,
                                 const std::vector<float>& down, const Route& r, int64_t k) {
  std::vector<double> y(static_cast<size_t>(tokens * hidden), 0.0);
  std::vector<double> act(static_cast<size_t>(inter));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = r.ids[t * k + j];
      const float* gu = gate_up.data() + e * 2 * inter * hidden;
      for (int64_t i = 0; i < inter; ++i) {
        double g = 0, u = 0;
        for (int64_t d = 0; d < hidden; ++d) {
          g += double(gu[i * hidden + d]) * x[t * hidden + d];
          u += double(gu[(inter + i) * hidden + d]) * x[t * hidden + d];
        }
        act[i] = g / (1.0 + std::exp(-g)) * u;
      }
      const float* dn = down.data() + e * hidden * inter;
      for (int64_t d = 0; d < hidden; ++d) {
        double o = 0;
        for (int64_t i = 0; i < inter; ++i) o += double(dn[d * inter + i]) * act[i];
        y[t * hidden + d] += r.weights[t * k + j] * o;
      }
    }
  }
  return y;
}

// Runs MoeExperts on random weights for the given routing and checks it
// against the naive sum. The fp32 result goes through two dot products of
// hidden and inter terms, a SiLU and a k-term sum; with inputs of magnitude
// <= 1 and these sizes, 2e-5 relative to the output's scale (about 300 ulps)
// covers the rounding, while a wrong expert, gate/up swap or weight is off by
// O(1).
void CheckExperts(int64_t tokens, int64_t experts, int64_t hidden, int64_t inter, int64_t k,
                  const Route& r, int threads) {
  const std::vector<float> x = Random(tokens * hidden, 11 + tokens);
  const std::vector<float> gate_up = Random(experts * 2 * inter * hidden, 12, 0.3f);
  const std::vector<float> down = Random(experts * hidden * inter, 13, 0.3f);
  std::vector<float> y(static_cast<size_t>(tokens * hidden), NAN);
  MoeExperts(x.data(), tokens, hidden, inter, gate_up.data(), down.data(), r.ids.data(),
             r.weights.data(), k, y.data(), threads);
  const std::vector<double> want = NaiveExperts(x, tokens, hidden, inter, gate_up, down, r, k);
  double scale = 0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  ASSERT_GT(scale, 0.0);
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(y[i], want[i], 2e-5 * scale) << "element " << i << " threads=" << threads;
  }
}

TEST(MoeExpertsTest, OddSizesMatchNaive) {
  const int64_t tokens = 53, experts = 7, hidden = 37, inter = 23, k = 3;
  const Route r = RouteOf(Random(tokens * experts, 21, 3.0f), tokens, experts, k, true);
  for (int threads : {1, 3}) CheckExperts(tokens, experts, hidden, inter, k, r, threads);
  CheckExperts(1, 1, 1, 1, 1, RouteOf({0.0f}, 1, 1, 1, true), 1);  // one of everything
}

TEST(MoeExpertsTest, ExpertsThatReceiveNoTokenContributeNothing) {
  // 16 experts, 5 tokens, k = 2: at most 10 are used; the unused ones hold
  // NaN weights, so reading them would poison the output.
  const int64_t tokens = 5, experts = 16, hidden = 24, inter = 10, k = 2;
  Route r{{3, 9, 9, 3, 0, 15, 3, 0, 9, 15}, {0.6f, 0.4f, 0.7f, 0.3f, 0.5f, 0.5f, 0.9f, 0.1f, 1, 0}};
  const std::vector<float> x = Random(tokens * hidden, 31);
  std::vector<float> gate_up = Random(experts * 2 * inter * hidden, 32, 0.3f);
  std::vector<float> down = Random(experts * hidden * inter, 33, 0.3f);
  const std::vector<double> want = NaiveExperts(x, tokens, hidden, inter, gate_up, down, r, k);
  for (int64_t e : {1, 2, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14}) {
    std::fill_n(gate_up.begin() + e * 2 * inter * hidden, 2 * inter * hidden, NAN);
    std::fill_n(down.begin() + e * hidden * inter, hidden * inter, NAN);
  }
  std::vector<float> y(static_cast<size_t>(tokens * hidden), NAN);
  MoeExperts(x.data(), tokens, hidden, inter, gate_up.data(), down.data(), r.ids.data(),
             r.weights.data(), k, y.data(), 2);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(y[i], want[i], 1e-5) << i;
}

TEST(MoeExpertsTest, OneExpertReceivingEveryTokenMatchesItsDenseSwiGlu) {
  // Every token's first slot is expert 2 with weight 1 and its second is
  // expert 0 with weight 0: the output is expert 2's dense MLP exactly as the
  // naive computation gives it, over more tokens than one work item holds.
  const int64_t tokens = 201, experts = 4, hidden = 33, inter = 17, k = 2;
  Route r;
  for (int64_t t = 0; t < tokens; ++t) {
    r.ids.insert(r.ids.end(), {2, 0});
    r.weights.insert(r.weights.end(), {1.0f, 0.0f});
  }
  for (int threads : {1, 4}) CheckExperts(tokens, experts, hidden, inter, k, r, threads);
}

// One rank's experts of an expert-parallel group: MoeExpertRange over just
// those experts' weights is the naive sum of their terms (the other experts'
// slots weighted 0), the ranges add up to MoeExperts within fp32 regrouping,
// and one range of every expert is MoeExperts bit for bit.
TEST(MoeExpertRangeTest, RangesAreTheirExpertsTermsAndSumToTheWhole) {
  const int64_t tokens = 41, experts = 8, hidden = 19, inter = 13, k = 3;
  const Route r = RouteOf(Random(tokens * experts, 51, 3.0f), tokens, experts, k, true);
  const std::vector<float> x = Random(tokens * hidden, 52);
  const std::vector<float> gate_up = Random(experts * 2 * inter * hidden, 53, 0.3f);
  const std::vector<float> down = Random(experts * hidden * inter, 54, 0.3f);
  std::vector<float> whole(static_cast<size_t>(tokens * hidden));
  MoeExperts(x.data(), tokens, hidden, inter, gate_up.data(), down.data(), r.ids.data(),
             r.weights.data(), k, whole.data(), 2);
  std::vector<float> sum(whole.size(), 0.0f);
  const int64_t per_rank = experts / 4;
  for (int64_t first = 0; first < experts; first += per_rank) {
    std::vector<float> y(whole.size(), NAN);
    MoeExpertRange(x.data(), tokens, hidden, inter, gate_up.data() + first * 2 * inter * hidden,
                   down.data() + first * hidden * inter, first, per_rank, r.ids.data(),
                   r.weights.data(), k, y.data(), 3);
    Route mine = r;
    for (size_t i = 0; i < mine.ids.size(); ++i) {
      if (mine.ids[i] < first || mine.ids[i] >= first + per_rank) mine.weights[i] = 0.0f;
    }
    const std::vector<double> want = NaiveExperts(x, tokens, hidden, inter, gate_up, down, mine, k);
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR(y[i], want[i], 1e-5) << "range " << first << " element " << i;
      sum[i] += y[i];
    }
  }
  for (size_t i = 0; i < whole.size(); ++i) ASSERT_NEAR(sum[i], whole[i], 1e-5) << i;
  // One range holding every expert is MoeExperts, bit for bit.
  std::vector<float> all(whole.size());
  MoeExpertRange(x.data(), tokens, hidden, inter, gate_up.data(), down.data(), 0, experts,
                 r.ids.data(), r.weights.data(), k, all.data(), 1);
  EXPECT_EQ(all, whole);
}

TEST(MoeExpertsTest, RowsDependOnlyOnTheirTokenAcrossBatchesAndThreads) {
  // Packed == separate: token t's output from the whole batch is bit-equal to
  // its output alone, for any thread count.
  const int64_t tokens = 90, experts = 6, hidden = 40, inter = 24, k = 2;
  const std::vector<float> x = Random(tokens * hidden, 41);
  const std::vector<float> gate_up = Random(experts * 2 * inter * hidden, 42, 0.3f);
  const std::vector<float> down = Random(experts * hidden * inter, 43, 0.3f);
  const Route r = RouteOf(Random(tokens * experts, 44, 2.0f), tokens, experts, k, false);
  std::vector<float> all(static_cast<size_t>(tokens * hidden));
  MoeExperts(x.data(), tokens, hidden, inter, gate_up.data(), down.data(), r.ids.data(),
             r.weights.data(), k, all.data(), 3);
  for (int64_t t = 0; t < tokens; t += 7) {
    std::vector<float> one(static_cast<size_t>(hidden));
    MoeExperts(x.data() + t * hidden, 1, hidden, inter, gate_up.data(), down.data(),
               r.ids.data() + t * k, r.weights.data() + t * k, k, one.data(), 1);
    for (int64_t d = 0; d < hidden; ++d) ASSERT_EQ(one[d], all[t * hidden + d]) << t << "," << d;
  }
}

}  // namespace
}  // namespace draftfeed::cpu
