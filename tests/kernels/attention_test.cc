#include "kernels/cpu/attention.h"

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
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

// Dense reference in double: a full Tq×Tk score matrix with the mask applied
// explicitly (what the kernel must never build). Query row t of sequence s
// sits at position kv_len_s - q_len_s + (t - cu_q[s]); key row u of sequence
// s' at u - cu_k[s']; t sees u iff s == s' and u's position <= t's.
std::vector<double> NaiveAttention(const std::vector<float>& q, const std::vector<float>& k,
                                   const std::vector<float>& v, const std::vector<int32_t>& q_lens,
                                   const std::vector<int32_t>& kv_lens, int64_t hq, int64_t hkv,
                                   int64_t hd, double scale) {
  const std::vector<int32_t> cu_q = Offsets(q_lens), cu_k = Offsets(kv_lens);
  const int64_t tq = cu_q.back(), tk = cu_k.back();
  std::vector<int> q_seq(tq), k_seq(tk);
  std::vector<int64_t> q_pos(tq), k_pos(tk);
  for (size_t s = 0; s < q_lens.size(); ++s) {
    for (int32_t t = cu_q[s]; t < cu_q[s + 1]; ++t) {
      q_seq[t] = static_cast<int>(s);
      q_pos[t] = kv_lens[s] - q_lens[s] + (t - cu_q[s]);
    }
    for (int32_t u = cu_k[s]; u < cu_k[s + 1]; ++u) {
      k_seq[u] = static_cast<int>(s);
      k_pos[u] = u - cu_k[s];
    }
  }
  std::vector<double> out(tq * hq * hd, 0.0);
  std::vector<double> scores(tk);
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kvh = h / (hq / hkv);
    for (int64_t t = 0; t < tq; ++t) {
      double mx = -INFINITY;
      for (int64_t u = 0; u < tk; ++u) {
        const bool visible = k_seq[u] == q_seq[t] && k_pos[u] <= q_pos[t];
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
      for (int64_t u = 0; u < tk; ++u) sum += scores[u] = std::exp(scores[u] - mx);
      for (int64_t u = 0; u < tk; ++u) {
        for (int64_t d = 0; d < hd; ++d) {
          out[(t * hq + h) * hd + d] += scores[u] / sum * v[(u * hkv + kvh) * hd + d];
        }
      }
    }
  }
  return out;
}

std::vector<double> NaiveAttention(const std::vector<float>& q, const std::vector<float>& k,
                                   const std::vector<float>& v, const std::vector<int32_t>& lens,
                                   int64_t hq, int64_t hkv, int64_t hd, double scale) {
  return NaiveAttention(q, k, v, lens, lens, hq, hkv, hd, scale);
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

// Chunked prefill: a problem of packed sequences, sequence s with q_lens[s]
// queries (its last ones) over kv_lens[s] keys.
struct Problem {
  std::vector<int32_t> q_lens, kv_lens;
  int64_t hq, hkv, hd;
  std::vector<float> q, k, v;
  Problem(std::vector<int32_t> ql, std::vector<int32_t> kl, int64_t hq_, int64_t hkv_, int64_t hd_,
          uint64_t seed)
      : q_lens(std::move(ql)), kv_lens(std::move(kl)), hq(hq_), hkv(hkv_), hd(hd_) {
    q = Random(Offsets(q_lens).back() * hq * hd, seed);
    k = Random(Offsets(kv_lens).back() * hkv * hd, seed + 1);
    v = Random(Offsets(kv_lens).back() * hkv * hd, seed + 2);
  }
  float scale() const { return 1.0f / std::sqrt(static_cast<float>(hd)); }
  std::vector<float> Run(int threads, float scale_override = 0) const {
    const std::vector<int32_t> cu_q = Offsets(q_lens), cu_k = Offsets(kv_lens);
    std::vector<float> out(q.size(), -1.0f);
    VarlenCausalAttention(q.data(), k.data(), v.data(), cu_q.data(), cu_k.data(),
                          static_cast<int64_t>(q_lens.size()), hq, hkv, hd,
                          scale_override != 0 ? scale_override : scale(), out.data(), threads);
    return out;
  }
};

// Bit-for-bit (memcmp: -0 and +0 differ, NaNs of one payload agree).
::testing::AssertionResult SameBits(const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i, b + i, sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << "element " << i << ": " << a[i] << " vs " << b[i];
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(AttentionPrefixTest, MatchesDenseMaskedReference) {
  // Errors, measured: at most ~1e-6 for these O(1) outputs. Each score is an
  // fp32 dot of hd terms (relative error ~sqrt(hd) x 6e-8 in practice, the
  // scores are O(1) after the 1/sqrt(hd) scale), each weight one ~2-ulp exp2
  // plus one rescale per 64-key block, and the output a weighted sum of up to
  // 290 unit-variance values accumulated in fp32: ~sqrt(290) x 6e-8 x a few
  // |v| of 3-4 is ~4e-6. 2e-5 absolute leaves a margin of 5 over that and is
  // still 100x below any real mistake (one key too many or too few moves an
  // output by ~1/len x |v|, >= 1e-2 here).
  for (int64_t hd : {13, 64, 128, 256}) {
    // Prefixes 0, 1 (a 1-key-prefix decode), mid-block, on and off block edges.
    const Problem pb({1, 70, 33, 5, 130, 64}, {1, 200, 33, 69, 290, 129}, 4, 2, hd, 20 + hd);
    const std::vector<float> out = pb.Run(2);
    const std::vector<double> want =
        NaiveAttention(pb.q, pb.k, pb.v, pb.q_lens, pb.kv_lens, pb.hq, pb.hkv, hd, pb.scale());
    for (size_t i = 0; i < out.size(); ++i)
      ASSERT_NEAR(out[i], want[i], 2e-5) << "hd " << hd << " at " << i;
  }
}

TEST(AttentionPrefixTest, SharpSoftmaxMatchesReference) {
  // Scores ~N(0, 8^2): most weights are below exp(-87) and round to 0 in
  // fp32, the rest dominated by a few keys. The output is then a near copy of
  // a few |v| <= 4 values, each through ~|score| x 6e-8 of score error:
  // ~8 x 3 x 6e-8 x 4, ~1e-5 at worst; 5e-5 leaves a margin.
  const Problem pb({90, 200}, {300, 200}, 2, 1, 32, 40);
  const float scale = 8.0f / std::sqrt(32.0f);
  const std::vector<float> out = pb.Run(2, scale);
  const std::vector<double> want =
      NaiveAttention(pb.q, pb.k, pb.v, pb.q_lens, pb.kv_lens, pb.hq, pb.hkv, pb.hd, scale);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], 5e-5) << "at " << i;
}

TEST(AttentionPrefixTest, LastQueriesOverAPrefixEqualTheOnePassRowsBitForBit) {
  // One 300-token sequence (blocks of 64 keys: 4 full and a partial one) in
  // one pass, then its last n queries over a prefix of P keys for every P:
  // each row must come out with the same bits. head_dim 20 = 2 full 8-wide
  // output tiles and a 4-dim tail.
  const int32_t len = 300;
  const Problem full({len}, {len}, 4, 2, 20, 50);
  const std::vector<float> want = full.Run(2);
  const int64_t row = full.hq * full.hd;
  for (int32_t p = 0; p < len; ++p) {
    for (int32_t n : {1, 37, len - p}) {
      if (n > len - p) continue;
      const std::vector<int32_t> cu_q = {0, n}, cu_k = {0, p + n};
      std::vector<float> out(n * row);
      VarlenCausalAttention(full.q.data() + p * row, full.k.data(), full.v.data(), cu_q.data(),
                            cu_k.data(), 1, full.hq, full.hkv, full.hd, full.scale(), out.data(),
                            p % 3);
      ASSERT_TRUE(SameBits(out.data(), want.data() + p * row, n * row))
          << "prefix " << p << ", " << n << " queries";
    }
  }
}

TEST(AttentionPrefixTest, PackedChunksOfSeveralForwardsEqualOnePassBitForBit) {
  // Two sequences prefilled over five forwards as the engine does it: each
  // forward packs the next chunk of both (uneven chunk sizes, some empty) with
  // all K/V up to its end. The chunks' rows must be the one-pass rows.
  const std::vector<int32_t> lens = {260, 131};
  const Problem one({lens[0], lens[1]}, {lens[0], lens[1]}, 6, 3, 24, 60);
  const std::vector<float> want = one.Run(1);
  const int64_t qrow = one.hq * one.hd, krow = one.hkv * one.hd;
  const std::vector<std::vector<int32_t>> chunks = {
      {37, 64}, {64, 0}, {1, 50}, {100, 16}, {58, 1}};  // per forward, per sequence
  std::vector<int32_t> done = {0, 0};
  const std::vector<int32_t> cu_one = Offsets(lens);
  for (size_t f = 0; f < chunks.size(); ++f) {
    std::vector<float> q, k, v;
    std::vector<int32_t> q_lens, kv_lens;
    for (int s = 0; s < 2; ++s) {
      const int32_t b = cu_one[s], n = chunks[f][s], end = done[s] + n;
      q.insert(q.end(), one.q.begin() + (b + done[s]) * qrow, one.q.begin() + (b + end) * qrow);
      k.insert(k.end(), one.k.begin() + b * krow, one.k.begin() + (b + end) * krow);
      v.insert(v.end(), one.v.begin() + b * krow, one.v.begin() + (b + end) * krow);
      q_lens.push_back(n);
      kv_lens.push_back(end);
    }
    const std::vector<int32_t> cu_q = Offsets(q_lens), cu_k = Offsets(kv_lens);
    std::vector<float> out(q.size());
    VarlenCausalAttention(q.data(), k.data(), v.data(), cu_q.data(), cu_k.data(), 2, one.hq,
                          one.hkv, one.hd, one.scale(), out.data(), 2);
    for (int s = 0; s < 2; ++s) {
      ASSERT_TRUE(SameBits(out.data() + cu_q[s] * qrow, want.data() + (cu_one[s] + done[s]) * qrow,
                           q_lens[s] * qrow))
          << "forward " << f << " sequence " << s;
      done[s] += q_lens[s];
    }
  }
  EXPECT_EQ(done, lens);
}

TEST(AttentionPrefixTest, PackedWithPrefixesEqualsAloneAndThreadCountDoesNotMatter) {
  // Sequences with and without prefixes, one with no queries at all.
  const Problem pb({5, 1, 40, 17, 64, 0, 3}, {5, 70, 40, 300, 128, 10, 3}, 4, 1, 16, 70);
  const std::vector<float> packed = pb.Run(1);
  for (int threads : {2, 5})
    EXPECT_TRUE(
        SameBits(pb.Run(threads).data(), packed.data(), static_cast<int64_t>(packed.size())))
        << threads << " threads";
  const std::vector<int32_t> cu_q = Offsets(pb.q_lens), cu_k = Offsets(pb.kv_lens);
  const int64_t qrow = pb.hq * pb.hd, krow = pb.hkv * pb.hd;
  for (size_t s = 0; s < pb.q_lens.size(); ++s) {
    const std::vector<int32_t> one_q = {0, pb.q_lens[s]}, one_k = {0, pb.kv_lens[s]};
    std::vector<float> alone(pb.q_lens[s] * qrow);
    VarlenCausalAttention(pb.q.data() + cu_q[s] * qrow, pb.k.data() + cu_k[s] * krow,
                          pb.v.data() + cu_k[s] * krow, one_q.data(), one_k.data(), 1, pb.hq,
                          pb.hkv, pb.hd, pb.scale(), alone.data(), 2);
    EXPECT_TRUE(SameBits(alone.data(), packed.data() + cu_q[s] * qrow, pb.q_lens[s] * qrow))
        << "sequence " << s;
  }
}

TEST(AttentionPrefixTest, WideGqaGroupsMatchReferenceAndSplitBitForBit) {
  // 6 query heads per KV head (lanes hold 5 rows x 6 heads) and 40 (more than
  // the 32 lanes: two head chunks per row). Tolerance as in
  // MatchesDenseMaskedReference; then the last 50 queries over a 100-key prefix.
  for (const auto& [hq, hkv] : {std::pair<int64_t, int64_t>{12, 2}, {40, 1}}) {
    const Problem pb({150}, {150}, hq, hkv, 16, 110 + hq);
    const std::vector<float> out = pb.Run(2);
    const std::vector<double> want =
        NaiveAttention(pb.q, pb.k, pb.v, pb.q_lens, pb.kv_lens, hq, hkv, pb.hd, pb.scale());
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], want[i], 2e-5) << hq << " at " << i;
    const int64_t row = hq * pb.hd;
    const std::vector<int32_t> cu_q = {0, 50}, cu_k = {0, 150};
    std::vector<float> last(50 * row);
    VarlenCausalAttention(pb.q.data() + 100 * row, pb.k.data(), pb.v.data(), cu_q.data(),
                          cu_k.data(), 1, hq, hkv, pb.hd, pb.scale(), last.data(), 2);
    EXPECT_TRUE(SameBits(last.data(), out.data() + 100 * row, 50 * row)) << hq << " heads";
  }
}

TEST(AttentionPrefixTest, KeysAfterARowNeverReachIt) {
  // The last key's K is NaN and its V inf. Every earlier row, the 20 others in
  // its 64-key block included, must keep the clean run's bits (a masked key
  // weighted 0 would still give 0 x inf = NaN); the last row sees it and is NaN.
  const int64_t len = 150;
  Problem pb({static_cast<int32_t>(len)}, {static_cast<int32_t>(len)}, 2, 2, 16, 80);
  const std::vector<float> clean = pb.Run(2);
  const int64_t qrow = pb.hq * pb.hd, krow = pb.hkv * pb.hd;
  std::fill(pb.k.begin() + (len - 1) * krow, pb.k.end(), std::nanf(""));
  std::fill(pb.v.begin() + (len - 1) * krow, pb.v.end(), INFINITY);
  const std::vector<float> poisoned = pb.Run(2);
  EXPECT_TRUE(SameBits(poisoned.data(), clean.data(), (len - 1) * qrow));
  for (int64_t i = (len - 1) * qrow; i < len * qrow; ++i) EXPECT_TRUE(std::isnan(poisoned[i])) << i;
}

TEST(AttentionPrefixTest, SeqlensOverloadIsTheCaseOfNoPrefix) {
  const Problem pb({3, 90, 64, 1}, {3, 90, 64, 1}, 4, 2, 32, 90);
  const std::vector<int32_t> cu = Offsets(pb.q_lens);
  std::vector<float> out(pb.q.size());
  VarlenCausalAttention(pb.q.data(), pb.k.data(), pb.v.data(), cu.data(), 4, pb.hq, pb.hkv, pb.hd,
                        pb.scale(), out.data(), 2);
  EXPECT_TRUE(SameBits(out.data(), pb.Run(1).data(), static_cast<int64_t>(out.size())));
}

TEST(AttentionPrefixDeathTest, RefusesFewerKeysThanQueries) {
  const Problem pb({2, 5}, {2, 5}, 2, 1, 8, 100);
  const std::vector<int32_t> cu_q = {0, 2, 7}, cu_k = {0, 2, 5};
  std::vector<float> out(pb.q.size());
  EXPECT_DEATH(VarlenCausalAttention(pb.q.data(), pb.k.data(), pb.v.data(), cu_q.data(),
                                     cu_k.data(), 2, 2, 1, 8, 1.0f, out.data(), 1),
               "sequence 1: 5 queries and 3 keys");
  EXPECT_DEATH(VarlenCausalAttention(pb.q.data(), pb.k.data(), pb.v.data(), cu_q.data(),
                                     cu_q.data(), 2, 3, 2, 8, 1.0f, out.data(), 1),
               "num_kv_heads 2 must be positive and divide num_q_heads 3");
}

TEST(AttentionPathTest, EveryInstructionSetGivesTheSameBits) {
  // The reference's bits (and the main job's checksum) must not depend on the
  // machine's SIMD: with contraction off each path does the same IEEE
  // operations per row. Head dims with and without a multiple of 8, GQA, a
  // prefix, several sequences.
  for (int64_t hd : {64, 13, 256}) {
    const std::vector<int32_t> q_lens = {5, 300, 77}, k_lens = {5, 400, 77};
    const int64_t hq = 8, hkv = 2;
    const std::vector<int32_t> cu_q = Offsets(q_lens), cu_k = Offsets(k_lens);
    const std::vector<float> q = Random(cu_q.back() * hq * hd, 4),
                             k = Random(cu_k.back() * hkv * hd, 5),
                             v = Random(cu_k.back() * hkv * hd, 6);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    std::vector<std::vector<float>> outs;
    for (int path : {1, 2, 3}) {
      if (!UseAttentionPathForTesting(path)) continue;
      std::vector<float> out(static_cast<size_t>(cu_q.back() * hq * hd));
      VarlenCausalAttention(q.data(), k.data(), v.data(), cu_q.data(), cu_k.data(), 3, hq, hkv,
                            hd, scale, out.data(), 2);
      outs.push_back(std::move(out));
    }
    ASSERT_TRUE(UseAttentionPathForTesting(0));
    ASSERT_GE(outs.size(), 1u);
    for (size_t i = 1; i < outs.size(); ++i) {
      EXPECT_EQ(std::memcmp(outs[i].data(), outs[0].data(), outs[0].size() * sizeof(float)), 0)
          << "hd " << hd << ": path " << i + 1 << " differs from the baseline";
    }
  }
}

}  // namespace
}  // namespace draftfeed::cpu
