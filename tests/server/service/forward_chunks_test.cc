// PlanForwardChunks: every token planned once, in order, no chunk over the
// budget, cuts aligned, and the carry flags chain the parts of each sequence.
#include "server/service/forward_chunks.h"

#include <random>
#include <vector>

#include <gtest/gtest.h>

namespace draftfeed {
namespace {

using Lens = std::vector<int32_t>;

// Rebuilds the batch from the chunks, checking what each chunk promises.
void CheckPlan(const Lens& lens, int64_t budget, const std::vector<ForwardChunk>& chunks) {
  int64_t total = 0;
  for (int32_t l : lens) total += l;
  ASSERT_FALSE(chunks.empty());
  Lens rebuilt;
  int64_t in_sequence = 0;  // tokens of the sequence being rebuilt, so far
  bool open = false;        // the previous chunk carried its last part
  int64_t token = 0;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const ForwardChunk& ch = chunks[c];
    SCOPED_TRACE(testing::Message() << "chunk " << c);
    EXPECT_EQ(ch.token_begin, token);
    ASSERT_FALSE(ch.seq_lens.empty());
    int64_t sum = 0;
    for (int32_t l : ch.seq_lens) {
      EXPECT_GE(l, 1);
      sum += l;
    }
    EXPECT_EQ(ch.tokens(), sum);
    EXPECT_LE(ch.tokens(), budget);
    EXPECT_EQ(ch.resume_tokens, open ? in_sequence : 0);
    for (size_t i = 0; i < ch.seq_lens.size(); ++i) {
      if (i == 0 && open) {
        rebuilt.back() += ch.seq_lens[0];
      } else {
        rebuilt.push_back(ch.seq_lens[i]);
      }
    }
    in_sequence = ch.seq_lens.size() == 1 && open ? in_sequence + ch.seq_lens[0]
                                                  : ch.seq_lens.back();
    if (ch.carry_last && budget >= kSplitAlign) {
      EXPECT_EQ(in_sequence % kSplitAlign, 0) << "cut at " << in_sequence;
    }
    open = ch.carry_last;
    token = ch.token_end;
  }
  EXPECT_FALSE(open) << "the last chunk carries a sequence on";
  EXPECT_EQ(token, total);
  EXPECT_EQ(rebuilt, lens);
}

TEST(ForwardChunksTest, BatchWithinTheBudgetIsOneChunk) {
  const Lens lens = {100, 28, 1};
  const auto chunks = PlanForwardChunks(lens, 129);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0].seq_lens, lens);
  EXPECT_EQ(chunks[0].resume_tokens, 0);
  EXPECT_FALSE(chunks[0].carry_last);
}

TEST(ForwardChunksTest, LongSequenceIsCutAtAlignedPoints) {
  const auto chunks = PlanForwardChunks(Lens{1000}, 300);
  // 256 + 256 + 256 + 232: each cut the last multiple of 64 under 300.
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[0].seq_lens, Lens{256});
  EXPECT_EQ(chunks[1].resume_tokens, 256);
  EXPECT_EQ(chunks[2].resume_tokens, 512);
  EXPECT_EQ(chunks[3].resume_tokens, 768);
  EXPECT_EQ(chunks[3].seq_lens, Lens{232});
  EXPECT_TRUE(chunks[2].carry_last);
  EXPECT_FALSE(chunks[3].carry_last);
  CheckPlan({1000}, 300, chunks);
}

TEST(ForwardChunksTest, ShortSequencesPackBesideALongOne) {
  const Lens lens = {10, 700, 5, 3};
  const auto chunks = PlanForwardChunks(lens, 256);
  // 10 and 192 of the 700 (the last aligned cut in 246 tokens), then 256 of
  // it, then its last 252; the 4 tokens left are too few to cut the 5 in.
  EXPECT_EQ(chunks[0].seq_lens, (Lens{10, 192}));
  EXPECT_TRUE(chunks[0].carry_last);
  EXPECT_EQ(chunks[1].seq_lens, Lens{256});
  EXPECT_EQ(chunks[1].resume_tokens, 192);
  EXPECT_EQ(chunks[2].resume_tokens, 448);
  EXPECT_EQ(chunks[2].seq_lens, Lens{252});
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[3].seq_lens, (Lens{5, 3}));
  CheckPlan(lens, 256, chunks);
}

TEST(ForwardChunksTest, ChunkEndsEarlyRatherThanCutUnaligned) {
  // 250 tokens in, 6 left in the chunk: too few for an aligned cut, so the
  // 100-token sequence starts the next chunk whole.
  const auto chunks = PlanForwardChunks(Lens{250, 100}, 256);
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].seq_lens, Lens{250});
  EXPECT_FALSE(chunks[0].carry_last);
  EXPECT_EQ(chunks[1].seq_lens, Lens{100});
  EXPECT_EQ(chunks[1].resume_tokens, 0);
}

TEST(ForwardChunksTest, TinyBudgetsCutAnywhere) {
  const auto chunks = PlanForwardChunks(Lens{7, 3}, 4);
  CheckPlan({7, 3}, 4, chunks);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[1].seq_lens, (Lens{3, 1}));
  EXPECT_EQ(chunks[1].resume_tokens, 4);
  EXPECT_TRUE(chunks[1].carry_last);
  EXPECT_EQ(chunks[2].resume_tokens, 1);
}

TEST(ForwardChunksTest, RandomBatchesKeepEveryPromise) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t budget = std::uniform_int_distribution<int64_t>(1, 600)(rng);
    Lens lens(std::uniform_int_distribution<int>(1, 8)(rng));
    for (int32_t& l : lens) l = std::uniform_int_distribution<int32_t>(1, 2000)(rng);
    SCOPED_TRACE(testing::Message() << "trial " << trial << " budget " << budget);
    CheckPlan(lens, budget, PlanForwardChunks(lens, budget));
    if (HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace draftfeed
