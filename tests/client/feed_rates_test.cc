// FeedStats' and TargetStats' rates from injected times: the window's base
// sample, its bound on samples, and the since-start rates.
#include "client/src/feed_rates.h"

#include <gtest/gtest.h>

namespace draftfeed {
namespace {

using Window1 = RateWindow<1>;

TEST(RateWindowTest, TakesItsBaseFromTheWindowStart) {
  Window1 w(/*window_s=*/10, /*start_s=*/0);
  for (int t = 0; t <= 30; ++t) w.Record(t, {t});  // one count a second for 30 s
  // The base is the newest sample at or before 30 - 10 = 20 s.
  Window1::Rates r = w.Get(30, {30});
  EXPECT_DOUBLE_EQ(r.span_s, 10.0);
  EXPECT_DOUBLE_EQ(r.per_s[0], 1.0);
  // A burst of 50 in the last second shows in the window rate.
  r = w.Get(31, {80});
  EXPECT_DOUBLE_EQ(r.span_s, 10.0);
  EXPECT_DOUBLE_EQ(r.per_s[0], (80.0 - 21.0) / 10.0);
}

TEST(RateWindowTest, SparseSamplesSpanFromTheNewestBeforeTheStart) {
  Window1 w(/*window_s=*/10, /*start_s=*/0);
  w.Record(3, {6});
  w.Record(25, {100});
  // At 30 the window starts at 20: 3 s is the newest sample at or before it.
  Window1::Rates r = w.Get(30, {110});
  EXPECT_DOUBLE_EQ(r.span_s, 27.0);
  EXPECT_DOUBLE_EQ(r.per_s[0], (110.0 - 6.0) / 27.0);
  // At 36 the sample at 25 is at or before 26: it becomes the base.
  r = w.Get(36, {122});
  EXPECT_DOUBLE_EQ(r.span_s, 11.0);
  EXPECT_DOUBLE_EQ(r.per_s[0], 2.0);
}

TEST(RateWindowTest, KeepsAtMostASampleEverySixtyFourthOfTheWindow) {
  Window1 w(/*window_s=*/1.0, /*start_s=*/0);
  for (int64_t i = 0; i < 100'000; ++i) w.Record(i * 1e-4, {i});  // 10 s, a batch every 0.1 ms
  // 64 spacings fill the window, plus its base and the newest sample.
  EXPECT_LE(w.num_samples(), 66u);
  EXPECT_GE(w.num_samples(), 60u);
  const Window1::Rates r = w.Get(10.0, {100'000});
  // A spacing is 1/64 s rounded up to the 0.1 ms between records.
  EXPECT_GE(r.span_s, 1.0);
  EXPECT_LE(r.span_s, 1.0 + 1.0 / 64 + 1e-4);
  EXPECT_NEAR(r.per_s[0], 10'000.0, 10'000.0 * 1e-3);
}

TEST(RateWindowTest, ZeroBeforeTimePasses) {
  Window1 w(/*window_s=*/5, /*start_s=*/2.0);
  const Window1::Rates r = w.Get(2.0, {4});
  EXPECT_EQ(r.span_s, 0.0);
  EXPECT_EQ(r.per_s[0], 0.0);
}

TEST(FeedRatesTest, FeedSinceOpenAndOverTheWindow) {
  FeedWindow w(/*window_s=*/4);
  FeedStats s;
  // 2 batches of 100 tokens (400 bytes each) a second for 10 s.
  for (int t = 1; t <= 10; ++t) {
    s.delivered = 2 * t;
    s.tokens_delivered = 200 * t;
    s.bytes_received = 800 * t;
    w.Record(t, WindowCounts(s));
  }
  // Then 20 s with nothing delivered and one more batch at 30 s.
  s.delivered += 1;
  s.tokens_delivered += 100;
  s.bytes_received += 400;
  SetRates(30.0, w, s);
  EXPECT_DOUBLE_EQ(s.elapsed_s, 30.0);
  EXPECT_DOUBLE_EQ(s.batches_per_s, 21.0 / 30.0);
  EXPECT_DOUBLE_EQ(s.tokens_per_s, 2100.0 / 30.0);
  EXPECT_DOUBLE_EQ(s.bytes_per_s, 8400.0 / 30.0);
  // The base is the sample at 10 s (nothing was recorded since): 20 s.
  EXPECT_DOUBLE_EQ(s.window_s, 20.0);
  EXPECT_DOUBLE_EQ(s.window_batches_per_s, 1.0 / 20.0);
  EXPECT_DOUBLE_EQ(s.window_tokens_per_s, 100.0 / 20.0);
  EXPECT_DOUBLE_EQ(s.window_bytes_per_s, 400.0 / 20.0);
  // At 32 s the newest sample at or before 28 s is still the one at 10 s.
  SetRates(32.0, w, s);
  EXPECT_DOUBLE_EQ(s.window_s, 22.0);
  EXPECT_DOUBLE_EQ(s.window_tokens_per_s, 100.0 / 22.0);
  EXPECT_DOUBLE_EQ(s.tokens_per_s, 2100.0 / 32.0);
  // At 35 s it is the one SetRates took at 30 s, after the last batch.
  SetRates(35.0, w, s);
  EXPECT_DOUBLE_EQ(s.window_s, 5.0);
  EXPECT_EQ(s.window_tokens_per_s, 0.0);
  EXPECT_EQ(s.window_batches_per_s, 0.0);
}

TEST(FeedRatesTest, TargetRatesAreSinceItJoined) {
  // A target that joined at 100 s (AddTarget) and delivers 50 tokens a second.
  TargetWindow w(/*window_s=*/30, /*start_s=*/100);
  TargetStats s;
  for (int t = 101; t <= 140; ++t) {
    s.delivered_batches = t - 100;
    s.delivered_tokens = 50 * (t - 100);
    w.Record(t, WindowCounts(s));
  }
  SetRates(140.0, 100.0, w, s);
  EXPECT_DOUBLE_EQ(s.batches_per_s, 1.0);
  EXPECT_DOUBLE_EQ(s.tokens_per_s, 50.0);
  EXPECT_DOUBLE_EQ(s.window_s, 30.0);
  EXPECT_DOUBLE_EQ(s.window_batches_per_s, 1.0);
  EXPECT_DOUBLE_EQ(s.window_tokens_per_s, 50.0);
  // The moment it joins, nothing has passed: no rate, no division by zero.
  TargetWindow fresh(/*window_s=*/30, /*start_s=*/100);
  TargetStats none;
  SetRates(100.0, 100.0, fresh, none);
  EXPECT_EQ(none.tokens_per_s, 0.0);
  EXPECT_EQ(none.window_s, 0.0);
  EXPECT_EQ(none.window_tokens_per_s, 0.0);
}

}  // namespace
}  // namespace draftfeed
