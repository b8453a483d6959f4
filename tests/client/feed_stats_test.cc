// Feed::Stats() against real targets (a TargetService on a CPU engine over
// loopback gRPC): the rates agree with the totals they come from, per target
// as for the feed, and Close() leaves the final numbers. The arithmetic of the
// window is tested with chosen times in feed_rates_test.cc; these tests
// assert relations that hold however long the batches took.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "draftfeed/client.h"
#include "tests/server/service/loopback_target.h"
#include "tests/server/service/test_tokens.h"

namespace draftfeed {
namespace {

using testing::LoopbackTarget;
using testing::RandomTokens;

// a == b up to the rounding of one division and one multiplication.
void ExpectRoundTrips(double rate, double seconds, int64_t total) {
  EXPECT_NEAR(rate * seconds, static_cast<double>(total), 1e-9 * static_cast<double>(total) + 1e-9)
      << rate << " * " << seconds;
}

// Submits and takes `n` batches of 1 + 7i tokens; returns the bytes Next() handed out.
int64_t Stream(Feed& feed, int vocab, int n, int seed) {
  int64_t bytes = 0;
  for (int i = 0; i < n; ++i) {
    const int32_t len = 1 + 7 * i;
    auto id = feed.Submit(RandomTokens(len, vocab, seed + i), {len});
    EXPECT_TRUE(id.ok()) << id.status();
    auto b = feed.Next();
    EXPECT_TRUE(b.ok()) << b.status();
    if (b.ok()) bytes += static_cast<int64_t>(b->num_bytes);
  }
  return bytes;
}

int64_t TokensOf(int n) { return n + 7 * n * (n - 1) / 2; }

TEST(FeedStatsTest, RatesSinceOpenAndOverAWindowHoldingTheRun) {
  LoopbackTarget server;
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = {1, -1};
  opt.stats_window_s = 600;  // longer than the run: the window's base is the feed's start
  auto feed = Feed::Open(opt);
  ASSERT_TRUE(feed.ok()) << feed.status();
  const int64_t bytes = Stream(**feed, static_cast<int>(server.model().config.vocab_size), 5, 7);
  const FeedStats s = (*feed)->Stats();
  ASSERT_EQ(s.delivered, 5);
  ASSERT_EQ(s.tokens_delivered, TokensOf(5));
  EXPECT_EQ(s.bytes_received, bytes);  // bf16, nothing re-sent
  EXPECT_FALSE(s.closed);
  ASSERT_GT(s.elapsed_s, 0);
  EXPECT_DOUBLE_EQ(s.batches_per_s, 5 / s.elapsed_s);
  EXPECT_DOUBLE_EQ(s.tokens_per_s, TokensOf(5) / s.elapsed_s);
  EXPECT_DOUBLE_EQ(s.bytes_per_s, bytes / s.elapsed_s);
  // The window's base is the sample of zeros at Open, so it spans the run.
  EXPECT_DOUBLE_EQ(s.window_s, s.elapsed_s);
  ExpectRoundTrips(s.window_batches_per_s, s.window_s, 5);
  ExpectRoundTrips(s.window_tokens_per_s, s.window_s, TokensOf(5));
  ExpectRoundTrips(s.window_bytes_per_s, s.window_s, bytes);

  ASSERT_EQ(s.targets.size(), 1u);
  const TargetStats& t = s.targets[0];
  EXPECT_EQ(t.state, "live");
  EXPECT_EQ(t.delivered_batches, 5);
  EXPECT_EQ(t.delivered_tokens, TokensOf(5));
  // Since it joined, which for a target of Open is within the feed's run.
  EXPECT_GT(t.window_s, 0);
  EXPECT_LE(t.window_s, s.elapsed_s);
  EXPECT_DOUBLE_EQ(t.tokens_per_s, t.window_tokens_per_s);
  EXPECT_DOUBLE_EQ(t.batches_per_s, t.window_batches_per_s);
  ExpectRoundTrips(t.window_tokens_per_s, t.window_s, TokensOf(5));
  ExpectRoundTrips(t.window_batches_per_s, t.window_s, 5);
}

TEST(FeedStatsTest, ATargetAddedLaterCountsFromWhenItJoined) {
  LoopbackTarget a, b;
  FeedOptions opt;
  opt.targets = {a.address()};
  opt.layers = {0};
  opt.stats_window_s = 600;
  auto feed = Feed::Open(opt);
  ASSERT_TRUE(feed.ok()) << feed.status();
  const int vocab = static_cast<int>(a.model().config.vocab_size);
  Stream(**feed, vocab, 3, 11);
  ASSERT_TRUE((*feed)->AddTarget(b.address()).ok());
  Stream(**feed, vocab, 6, 21);
  const FeedStats s = (*feed)->Stats();
  ASSERT_EQ(s.targets.size(), 2u);
  EXPECT_EQ(s.targets[0].address, a.address());
  EXPECT_EQ(s.targets[1].address, b.address());
  int64_t tokens = 0, batches = 0;
  for (const TargetStats& t : s.targets) {
    tokens += t.delivered_tokens;
    batches += t.delivered_batches;
    ExpectRoundTrips(t.window_tokens_per_s, t.window_s, t.delivered_tokens);
    EXPECT_DOUBLE_EQ(t.tokens_per_s, t.window_tokens_per_s);
  }
  EXPECT_EQ(batches, 9);
  EXPECT_EQ(tokens, s.tokens_delivered);
  // b's window (and since-start) is from AddTarget, after a's first batches.
  EXPECT_LT(s.targets[1].window_s, s.targets[0].window_s);
}

TEST(FeedStatsTest, StatsAfterCloseAreTheFinalNumbers) {
  LoopbackTarget server;
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = {2};
  auto feed = Feed::Open(opt);
  ASSERT_TRUE(feed.ok()) << feed.status();
  Stream(**feed, static_cast<int>(server.model().config.vocab_size), 4, 3);
  // One left outstanding: Close cancels it, and the final numbers say so.
  ASSERT_TRUE((*feed)->Submit(RandomTokens(9, 64, 1), {9}).ok());
  ASSERT_TRUE((*feed)->Close().ok());
  const FeedStats first = (*feed)->Stats();
  EXPECT_TRUE(first.closed);
  EXPECT_EQ(first.delivered, 4);
  EXPECT_EQ(first.tokens_delivered, TokensOf(4));
  EXPECT_EQ(first.cancelled, 1);
  EXPECT_EQ(first.outstanding, 0);
  EXPECT_DOUBLE_EQ(first.tokens_per_s, TokensOf(4) / first.elapsed_s);
  ASSERT_EQ(first.targets.size(), 1u);
  // The target may have finished the cancelled batch before Close took it.
  EXPECT_GE(first.targets[0].delivered_batches, 4);
  EXPECT_LE(first.targets[0].delivered_batches, 5);
  // Frozen: the clock has moved on, the numbers have not.
  const FeedStats again = (*feed)->Stats();
  EXPECT_EQ(again.elapsed_s, first.elapsed_s);
  EXPECT_EQ(again.tokens_per_s, first.tokens_per_s);
  EXPECT_EQ(again.window_s, first.window_s);
  EXPECT_EQ(again.window_tokens_per_s, first.window_tokens_per_s);
  EXPECT_EQ(again.targets[0].window_s, first.targets[0].window_s);
  EXPECT_EQ(again.targets[0].state, first.targets[0].state);
  EXPECT_TRUE((*feed)->Close().ok());  // a second Close keeps them
  EXPECT_EQ((*feed)->Stats().elapsed_s, first.elapsed_s);
}

TEST(FeedStatsTest, TheWindowMustBeAPositiveNumberOfSeconds) {
  for (double w : {0.0, -1.0, std::nan(""), static_cast<double>(INFINITY)}) {
    FeedOptions opt;
    opt.targets = {"127.0.0.1:1"};  // never reached: the options are checked first
    opt.layers = {0};
    opt.stats_window_s = w;
    auto feed = Feed::Open(opt);
    ASSERT_FALSE(feed.ok()) << w;
    EXPECT_EQ(feed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(feed.status().message().find("FeedOptions.stats_window_s"), std::string::npos)
        << feed.status();
  }
}

}  // namespace
}  // namespace draftfeed
