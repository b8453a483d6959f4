// The CPU reference of the target outputs against values worked out by hand
// (in double), and the properties its definitions promise: ties go to the
// lower id, the log-probs are a full-vocabulary log_softmax, the draft probs
// a distribution whose columns follow the draft list's order.
#include "kernels/cpu/target_outputs.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace draftfeed::cpu {
namespace {

struct Outputs {
  std::vector<int32_t> argmax, top_ids;
  std::vector<float> top_logprobs, probs;
};

Outputs Reference(const std::vector<float>& logits, int64_t tokens,
                  const std::vector<int32_t>& draft, int32_t top_k, int threads = 1) {
  const int64_t vocab = static_cast<int64_t>(logits.size()) / tokens;
  const auto vd = static_cast<int64_t>(draft.size());
  Outputs o;
  o.argmax.assign(static_cast<size_t>(tokens), -7);
  o.top_ids.assign(static_cast<size_t>(tokens * top_k), -7);
  o.top_logprobs.assign(static_cast<size_t>(tokens * top_k), 7.0f);
  o.probs.assign(static_cast<size_t>(tokens * vd), 7.0f);
  TargetOutputsFromLogits(logits.data(), tokens, vocab, draft.data(), vd, top_k, o.argmax.data(),
                          o.top_ids.data(), o.top_logprobs.data(), o.probs.data(), threads);
  return o;
}

TEST(TargetOutputsTest, WorkedExample) {
  // l = {1, 3, 3, 0, 2}: m = 3, Σ exp(l - m) = 2 + e^-1 + e^-2 + e^-3, so
  // log_softmax = l - 3.9372698404823354. Ids 1 and 2 tie at the top.
  const std::vector<float> l = {1, 3, 3, 0, 2};
  const Outputs o = Reference(l, 1, {4, 0, 2}, 3);
  EXPECT_EQ(o.argmax[0], 1);
  EXPECT_EQ(o.top_ids, (std::vector<int32_t>{1, 2, 4}));
  const double want_lp[] = {-0.9372698404823354, -0.9372698404823354, -1.9372698404823354};
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(o.top_logprobs[i], want_lp[i], 1e-6) << i;
  // softmax over the draft columns' logits {2, 1, 3}, in the draft's order.
  const double want_p[] = {0.24472847105479764, 0.09003057317038046, 0.6652409557748218};
  for (int j = 0; j < 3; ++j) EXPECT_NEAR(o.probs[j], want_p[j], 1e-7) << j;
}

TEST(TargetOutputsTest, TiesGoToTheLowerId) {
  // Six equal logits: every order is a tie, so ids ascend; each log-prob is
  // -log 6. Then a row whose maximum appears at ids 4 and 1.
  const std::vector<float> flat(6, 0.25f);
  const Outputs a = Reference(flat, 1, {}, 4);
  EXPECT_EQ(a.argmax[0], 0);
  EXPECT_EQ(a.top_ids, (std::vector<int32_t>{0, 1, 2, 3}));
  for (float lp : a.top_logprobs) EXPECT_NEAR(lp, -1.791759469228055, 1e-6);

  const std::vector<float> l = {-1, 5, 2, 2, 5, 2};
  const Outputs b = Reference(l, 1, {}, 5);
  EXPECT_EQ(b.argmax[0], 1);
  EXPECT_EQ(b.top_ids, (std::vector<int32_t>{1, 4, 2, 3, 5}));
}

TEST(TargetOutputsTest, LogprobsAreAFullVocabularyLogSoftmax) {
  // top_k = vocab: every id once, best first, and Σ exp(logprob) = 1.
  constexpr int64_t kVocab = 211, kTokens = 3;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> l(kVocab * kTokens);
  for (float& v : l) v = normal(rng);
  const Outputs o = Reference(l, kTokens, {}, static_cast<int32_t>(kVocab));
  for (int64_t t = 0; t < kTokens; ++t) {
    SCOPED_TRACE(t);
    const int32_t* ids = o.top_ids.data() + t * kVocab;
    const float* lp = o.top_logprobs.data() + t * kVocab;
    std::vector<int32_t> sorted(ids, ids + kVocab);
    std::sort(sorted.begin(), sorted.end());
    std::vector<int32_t> all(kVocab);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(sorted, all);
    EXPECT_EQ(ids[0], o.argmax[t]);
    double total = 0;
    for (int64_t i = 0; i < kVocab; ++i) {
      total += std::exp(static_cast<double>(lp[i]));
      if (i > 0) {
        EXPECT_GE(lp[i - 1], lp[i]);
      }
      // Differences of log-probs are differences of logits.
      EXPECT_NEAR(lp[i] - lp[0], l[t * kVocab + ids[i]] - l[t * kVocab + ids[0]], 1e-5);
    }
    EXPECT_NEAR(total, 1.0, 1e-5);
  }
}

TEST(TargetOutputsTest, ProbsSumToOneAndFollowTheDraftOrder) {
  constexpr int64_t kVocab = 1000, kTokens = 4;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> l(kVocab * kTokens);
  for (float& v : l) v = normal(rng);
  std::vector<int32_t> draft(kVocab);
  std::iota(draft.begin(), draft.end(), 0);
  std::shuffle(draft.begin(), draft.end(), rng);
  draft.resize(97);
  const Outputs o = Reference(l, kTokens, draft, 0);
  // The same columns listed in another order: the same probabilities, moved.
  std::vector<int32_t> reversed(draft.rbegin(), draft.rend());
  const Outputs r = Reference(l, kTokens, reversed, 0);
  const auto vd = static_cast<int64_t>(draft.size());
  for (int64_t t = 0; t < kTokens; ++t) {
    SCOPED_TRACE(t);
    const float* p = o.probs.data() + t * vd;
    double total = 0;
    for (int64_t j = 0; j < vd; ++j) {
      total += p[j];
      EXPECT_FLOAT_EQ(p[j], r.probs[t * vd + (vd - 1 - j)]) << j;
      // p_j / p_0 = exp(l_{d_j} - l_{d_0}).
      EXPECT_NEAR(
          p[j] / p[0],
          std::exp(static_cast<double>(l[t * kVocab + draft[j]]) - l[t * kVocab + draft[0]]),
          1e-5 * p[j] / p[0]);
    }
    EXPECT_NEAR(total, 1.0, 1e-6);
  }
}

TEST(TargetOutputsTest, UnaskedOutputsAreUntouchedAndThreadsDoNotMatter) {
  constexpr int64_t kVocab = 300, kTokens = 9;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> l(kVocab * kTokens);
  for (float& v : l) v = normal(rng);
  const std::vector<int32_t> draft = {299, 0, 150, 7};
  const Outputs one = Reference(l, kTokens, draft, 5, 1);
  const Outputs four = Reference(l, kTokens, draft, 5, 4);
  EXPECT_EQ(one.argmax, four.argmax);
  EXPECT_EQ(one.top_ids, four.top_ids);
  EXPECT_EQ(one.top_logprobs, four.top_logprobs);
  EXPECT_EQ(one.probs, four.probs);

  // Nothing asked but the argmax: the other buffers are null and not read.
  std::vector<int32_t> argmax(kTokens, -1);
  TargetOutputsFromLogits(l.data(), kTokens, kVocab, nullptr, 0, 0, argmax.data(), nullptr, nullptr,
                          nullptr, 2);
  EXPECT_EQ(argmax, one.argmax);
  // top_k 0 with a draft: only the probs.
  std::vector<float> probs(kTokens * draft.size(), -1.0f);
  TargetOutputsFromLogits(l.data(), kTokens, kVocab, draft.data(), 4, 0, nullptr, nullptr, nullptr,
                          probs.data(), 2);
  EXPECT_EQ(probs, one.probs);
}

}  // namespace
}  // namespace draftfeed::cpu
