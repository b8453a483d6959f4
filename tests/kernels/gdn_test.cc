#include "kernels/cpu/gdn.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace draftfeed::cpu {
namespace {

double Silu(double x) { return x / (1.0 + std::exp(-x)); }

std::vector<int32_t> Offsets(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

TEST(CausalConvTest, HandComputedWithSequenceStarts) {
  // Two sequences [2 tokens | 3 tokens], 2 channels, kernel 3; tap 2 is the
  // current token. Pre-activations by hand (taps before a start read 0):
  //   ch0 w = [0.01, 0.1, 1], x = [1, 2 | 3, 4, 5]:
  //     1, 0.1·1 + 2 = 2.1, 3 (restart), 0.1·3 + 4 = 4.3, 0.01·3 + 0.1·4 + 5 = 5.43
  //   ch1 w = [−1, 0.5, 0.25], x = [1, −1 | 2, 2, −2]:
  //     0.25, 0.5 − 0.25 = 0.25, 0.5, 1 + 0.5 = 1.5, −2 + 1 − 0.5 = −1.5
  // fp32 sum of three products then SiLU: 1e-6 relative.
  const std::vector<float> x = {1, 1, 2, -1, 3, 2, 4, 2, 5, -2};   // [T=5, C=2]
  const std::vector<float> w = {0.01f, 0.1f, 1, -1, 0.5f, 0.25f};  // [C=2, K=3]
  const std::vector<int32_t> cu = {0, 2, 5};
  std::vector<float> y(10);
  CausalConv1dSilu(x.data(), w.data(), cu.data(), 2, 2, 3, y.data());
  const double pre[5][2] = {{1, 0.25}, {2.1, 0.25}, {3, 0.5}, {4.3, 1.5}, {5.43, -1.5}};
  for (int t = 0; t < 5; ++t) {
    for (int c = 0; c < 2; ++c) {
      const double want = Silu(pre[t][c]);
      EXPECT_NEAR(y[t * 2 + c], want, 1e-6 * std::fabs(want) + 1e-7) << "t=" << t << " c=" << c;
    }
  }
}

TEST(GdnL2NormTest, EpsInsideTheSqrtAndStridedHeads) {
  // Two tokens x two heads of 2 dims, token stride 6 (the conv output holds
  // q, k and v side by side): only the first 4 floats of each token change.
  std::vector<float> x = {3, 4, 0, 0, 99, 99, 6, 8, 1, 0, 99, 99};
  L2NormHeads(x.data(), 2, 2, 2, 6, 1e-6f, 0.5f);
  EXPECT_NEAR(x[0], 0.5 * 3 / std::sqrt(25 + 1e-6), 1e-7);
  EXPECT_NEAR(x[1], 0.5 * 4 / std::sqrt(25 + 1e-6), 1e-7);
  // An all-zero head stays zero: eps keeps the sqrt away from 0.
  EXPECT_EQ(x[2], 0.0f);
  EXPECT_EQ(x[3], 0.0f);
  EXPECT_NEAR(x[6], 0.5 * 6 / std::sqrt(100 + 1e-6), 1e-7);
  EXPECT_NEAR(x[7], 0.5 * 8 / std::sqrt(100 + 1e-6), 1e-7);
  EXPECT_NEAR(x[8], 0.5 / std::sqrt(1 + 1e-6), 1e-7);
  EXPECT_EQ(x[4], 99);
  EXPECT_EQ(x[11], 99);
  // eps is added to Σx², not clamped on the norm: a tiny vector is shrunk.
  std::vector<float> tiny = {1e-3f, 0};
  L2NormHeads(tiny.data(), 1, 1, 2, 2, 1e-6f, 1.0f);
  EXPECT_NEAR(tiny[0], 1e-3 / std::sqrt(1e-6 + 1e-6), 1e-6);  // 0.7071, not 1
}

TEST(GdnGatesTest, HandComputed) {
  // head 0: A = exp(A_log) = 2, a + dt_bias = 0 → softplus = ln 2, g = −2 ln 2;
  // head 1: a + dt_bias = 25 > 20 → softplus returns 25 exactly, g = −0.5·25;
  // head 2: a + dt_bias = −1 → softplus = ln(1 + e^−1).
  const std::vector<float> a = {0.5f, 24, -1.5f};
  const std::vector<float> b = {0, 2, -3};
  const std::vector<float> a_log = {std::log(2.0f), std::log(0.5f), 0};
  const std::vector<float> dt_bias = {-0.5f, 1, 0.5f};
  std::vector<float> g(3), beta(3);
  GdnGates(a.data(), b.data(), a_log.data(), dt_bias.data(), 1, 3, g.data(), beta.data());
  EXPECT_NEAR(g[0], -2 * std::log(2.0), 1e-6);
  EXPECT_NEAR(g[1], -12.5, 1e-5);
  EXPECT_NEAR(g[2], -std::log1p(std::exp(-1.0)), 1e-6);
  EXPECT_EQ(beta[0], 0.5f);
  EXPECT_NEAR(beta[1], 1 / (1 + std::exp(-2.0)), 1e-7);
  EXPECT_NEAR(beta[2], 1 / (1 + std::exp(3.0)), 1e-7);
}

// A two-token, one-head case of the recurrence (S' = αS, e = β(v − S'ᵀk),
// S = S' + k eᵀ, o = Sᵀq) worked by hand (dk = dv = 2):
//   t0: k=[1,0], q=[1,0], v=[2,3], β=0.5:  e = [1, 1.5], S = [[1, 1.5], [0, 0]],
//       o = Sᵀq = [1, 1.5].
//   t1: α = 0.5, k=[0.6,0.8], q=[0,1], v=[1,−1], β=1:  S' = [[0.5, 0.75], [0, 0]],
//       S'ᵀk = [0.3, 0.45], e = [0.7, −1.45], S = [[0.92, −0.12], [0.56, −1.16]],
//       o = Sᵀq = [0.56, −1.16].
struct HandCase {
  std::vector<float> q = {1, 0, 0, 1};
  std::vector<float> k = {1, 0, 0.6f, 0.8f};
  std::vector<float> v = {2, 3, 1, -1};
  std::vector<float> g = {std::log(0.25f), std::log(0.5f)};  // g0 acts on a zero state
  std::vector<float> beta = {0.5f, 1};
  std::vector<int32_t> cu = {0, 2};
  std::vector<float> o = std::vector<float>(4, NAN);
  DeltaRuleArgs Args() {
    DeltaRuleArgs a;
    a.q = q.data(), a.q_stride = 2, a.k = k.data(), a.k_stride = 2, a.v = v.data();
    a.v_stride = 2, a.g = g.data(), a.beta = beta.data(), a.o = o.data();
    a.cu_seqlens = cu.data(), a.num_seqs = 1, a.num_k_heads = 1, a.num_v_heads = 1;
    a.key_dim = 2, a.value_dim = 2;
    return a;
  }
};

TEST(GatedDeltaRuleTest, TwoTokensByHandRecurrent) {
  HandCase c;
  GatedDeltaRuleRecurrent(c.Args(), 1);
  const double want[4] = {1, 1.5, 0.56, -1.16};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(c.o[i], want[i], 1e-6) << i;
}

TEST(GatedDeltaRuleTest, TwoTokensByHandChunked) {
  for (int64_t chunk : {1, 2, 64}) {
    HandCase c;
    GatedDeltaRuleChunked(c.Args(), chunk, 1);
    const double want[4] = {1, 1.5, 0.56, -1.16};
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(c.o[i], want[i], 1e-6) << i << " chunk " << chunk;
  }
}

// Random GDN operands laid out like the engine's conv output: one [T, C] row
// per token holding q (Nk heads), k (Nk heads) and v (Nv heads) side by side.
struct RandomGdn {
  static constexpr int64_t kNk = 2, kNv = 4, kDk = 16, kDv = 24;
  static constexpr int64_t kC = 2 * kNk * kDk + kNv * kDv;
  std::vector<int32_t> cu;
  int64_t t_total;
  std::vector<float> qkv, g, beta;

  RandomGdn(const std::vector<int32_t>& lens, uint64_t seed)
      : cu(Offsets(lens)), t_total(cu.back()) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uni(1.0f, 16.0f);
    qkv.resize(t_total * kC);
    for (float& x : qkv) x = normal(rng);
    L2NormHeads(qkv.data(), t_total, kNk, kDk, kC, 1e-6f, 1.0f / std::sqrt(float(kDk)));
    L2NormHeads(qkv.data() + kNk * kDk, t_total, kNk, kDk, kC, 1e-6f, 1.0f);
    // Gates as the model makes them: A = U(1, 16) so some heads decay hard
    // (γ over a 64-token chunk reaches hundreds below zero).
    std::vector<float> a(t_total * kNv), b(t_total * kNv), a_log(kNv), dt(kNv);
    for (float& x : a) x = normal(rng);
    for (float& x : b) x = normal(rng);
    for (float& x : a_log) x = std::log(uni(rng));
    for (float& x : dt) x = 0.1f * normal(rng);
    g.resize(t_total * kNv);
    beta.resize(t_total * kNv);
    GdnGates(a.data(), b.data(), a_log.data(), dt.data(), t_total, kNv, g.data(), beta.data());
  }

  DeltaRuleArgs Args(float* o) const {
    DeltaRuleArgs a;
    a.q = qkv.data();
    a.k = qkv.data() + kNk * kDk;
    a.v = qkv.data() + 2 * kNk * kDk;
    a.q_stride = a.k_stride = a.v_stride = kC;
    a.g = g.data();
    a.beta = beta.data();
    a.o = o;
    a.cu_seqlens = cu.data();
    a.num_seqs = static_cast<int64_t>(cu.size()) - 1;
    a.num_k_heads = kNk;
    a.num_v_heads = kNv;
    a.key_dim = kDk;
    a.value_dim = kDv;
    return a;
  }
};

TEST(GatedDeltaRuleTest, ChunkedEqualsRecurrentAloneAndPacked) {
  // The two forms are equal in exact arithmetic; in fp32 they sum in
  // different orders. With unit-norm k and β ≤ 1 the state stays O(‖v‖), the
  // outputs are O(1), and the measured gap is ~1e-6; 5e-5 absolute is a
  // bound with margin that still catches any algebra slip (those are O(1)).
  const std::vector<int32_t> all = {1, 63, 64, 65, 200};
  auto check = [](const std::vector<int32_t>& lens, const char* what) {
    RandomGdn r(lens, 42 + lens.size() * 1000 + lens[0]);
    std::vector<float> rec(r.t_total * RandomGdn::kNv * RandomGdn::kDv, NAN);
    std::vector<float> chk(rec.size(), NAN);
    GatedDeltaRuleRecurrent(r.Args(rec.data()), 2);
    GatedDeltaRuleChunked(r.Args(chk.data()), 64, 3);
    double worst = 0;
    for (size_t i = 0; i < rec.size(); ++i) {
      ASSERT_TRUE(std::isfinite(chk[i])) << what << " element " << i;
      worst = std::max(worst, std::fabs(double(rec[i]) - chk[i]));
    }
    EXPECT_LT(worst, 5e-5) << what;
  };
  for (int32_t len : all) check({len}, "alone");
  check(all, "packed");
}

TEST(GatedDeltaRuleTest, PackedEqualsAloneBitForBit) {
  // Chunks start at every sequence's first token and state never crosses a
  // boundary, so each sequence's arithmetic is the same packed or alone.
  const std::vector<int32_t> lens = {1, 63, 64, 65, 200};
  RandomGdn packed(lens, 7);
  std::vector<float> out_chunk(packed.t_total * RandomGdn::kNv * RandomGdn::kDv);
  std::vector<float> out_rec(out_chunk.size());
  GatedDeltaRuleChunked(packed.Args(out_chunk.data()), 64, 2);
  GatedDeltaRuleRecurrent(packed.Args(out_rec.data()), 2);
  for (size_t s = 0; s < lens.size(); ++s) {
    const int64_t b = packed.cu[s];
    RandomGdn alone = packed;
    alone.cu = {0, lens[s]};
    alone.t_total = lens[s];
    alone.qkv.assign(packed.qkv.begin() + b * RandomGdn::kC,
                     packed.qkv.begin() + (b + lens[s]) * RandomGdn::kC);
    alone.g.assign(packed.g.begin() + b * RandomGdn::kNv,
                   packed.g.begin() + (b + lens[s]) * RandomGdn::kNv);
    alone.beta.assign(packed.beta.begin() + b * RandomGdn::kNv,
                      packed.beta.begin() + (b + lens[s]) * RandomGdn::kNv);
    const int64_t row = RandomGdn::kNv * RandomGdn::kDv;
    std::vector<float> one_chunk(lens[s] * row), one_rec(lens[s] * row);
    GatedDeltaRuleChunked(alone.Args(one_chunk.data()), 64, 1);
    GatedDeltaRuleRecurrent(alone.Args(one_rec.data()), 1);
    for (int64_t i = 0; i < lens[s] * row; ++i) {
      ASSERT_EQ(one_chunk[i], out_chunk[b * row + i]) << "chunked, sequence " << s << " at " << i;
      ASSERT_EQ(one_rec[i], out_rec[b * row + i]) << "recurrent, sequence " << s << " at " << i;
    }
  }
}

TEST(GatedDeltaRuleTest, ValueHeadsReadTheirOwnKeyHeadBlock) {
  // Nv/Nk = 2: value heads 0, 1 read q/k head 0, heads 2, 3 read head 1
  // (contiguous blocks, not modulo). Changing q head 1 must leave value
  // heads 0 and 1 bit-identical and change 2 and 3. (Only q is edited: the
  // rule depends on q and k only through their dot products, so reversing
  // both would change nothing.)
  RandomGdn base({30}, 3);
  RandomGdn edited = base;
  for (int64_t t = 0; t < edited.t_total; ++t) {
    float* q1 = edited.qkv.data() + t * RandomGdn::kC + RandomGdn::kDk;
    std::reverse(q1, q1 + RandomGdn::kDk);
  }
  const int64_t row = RandomGdn::kNv * RandomGdn::kDv;
  std::vector<float> o0(base.t_total * row), o1(base.t_total * row);
  GatedDeltaRuleChunked(base.Args(o0.data()), 64, 1);
  GatedDeltaRuleChunked(edited.Args(o1.data()), 64, 1);
  bool later_heads_changed = false;
  for (int64_t t = 0; t < base.t_total; ++t) {
    for (int64_t j = 0; j < RandomGdn::kNv; ++j) {
      for (int64_t d = 0; d < RandomGdn::kDv; ++d) {
        const int64_t i = t * row + j * RandomGdn::kDv + d;
        if (j < 2) {
          ASSERT_EQ(o0[i], o1[i]) << "value head " << j;
        } else if (o0[i] != o1[i]) {
          later_heads_changed = true;
        }
      }
    }
  }
  EXPECT_TRUE(later_heads_changed);
}

TEST(GatedDeltaRuleTest, StrongDecayStaysFinite) {
  // g = −30 per token: γ over a 64-token chunk is −1920, so exp(−γ) would
  // overflow fp32 and exp(γ) underflows to 0. Outputs must stay finite and
  // equal the recurrence, where every token all but forgets the past.
  RandomGdn r({130}, 11);
  std::fill(r.g.begin(), r.g.end(), -30.0f);
  std::vector<float> rec(r.t_total * RandomGdn::kNv * RandomGdn::kDv), chk(rec.size());
  GatedDeltaRuleRecurrent(r.Args(rec.data()), 1);
  GatedDeltaRuleChunked(r.Args(chk.data()), 64, 1);
  for (size_t i = 0; i < rec.size(); ++i) {
    ASSERT_TRUE(std::isfinite(chk[i])) << i;
    ASSERT_NEAR(chk[i], rec[i], 1e-5) << i;
  }
}

}  // namespace
}  // namespace draftfeed::cpu
