// The CPU engine against transformers over one 3,000-token sequence per model
// family (long_goldens.h), run in one forward and in the forwards chunked
// prefill cuts it into: PlanForwardChunks at budgets of 512 and 1000 tokens
// (cuts on the 64-token grid, at other points of it for each budget: 448,
// 960, 1472, ... and 960, 1920, 2880), and by hand at awkward cuts off the
// grid (kAwkwardCuts), the engine carrying the sequence's K/V, conv tails and
// GDN states from forward to forward. Each against the fp32 goldens within
// goldens.h's fp32 bound: its argument (the same function in fp32, only the
// rounding order differs) does not depend on the length, and each test
// prints the errors it measured, slot by slot. The short goldens stop
// at 130 tokens, two GDN chunks; these reach 47 of them and 2,999 keys of
// attention. Planned chunks must also equal the one pass bit for bit
// (chunked_prefill_test's argument: a cut on the 64-token grid changes no
// sum's order). Skips, naming the command, until the goldens are made.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/service/forward_chunks.h"
#include "tests/server/model/long_goldens.h"

namespace draftfeed::testing {
namespace {

// Values of `got` whose bits differ from `want`'s; the first is reported.
size_t BitMismatches(const std::vector<float>& got, const std::vector<float>& want,
                     const std::string& what) {
  size_t n = 0;
  if (got.size() != want.size()) {
    ADD_FAILURE() << what << ": " << got.size() << " values, one pass has " << want.size();
    return want.size();
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && n++ == 0) {
      ADD_FAILURE() << what << ": value " << i << " is " << got[i] << ", one pass " << want[i];
    }
  }
  return n;
}

double MaxRelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  return worst / std::max(scale, 1e-30);
}

// The file is what the tests below assume: the layers make_long_goldens.py
// captures, a sequence long enough to need several forwards, and rows either
// side of every cut the tests can make (every multiple of 64 and the
// awkward cuts).
TEST_P(LongGoldensTest, GoldensLayout) {
  const int32_t n = static_cast<int32_t>(goldens_.num_layers);
  EXPECT_EQ(goldens_.layers, (std::vector<int32_t>{0, n / 2, n - 1, kFinalLayerId}));
  const int32_t len = static_cast<int32_t>(goldens_.ids.size());
  EXPECT_GE(len, 2048);
  for (const int32_t id : goldens_.ids) {
    ASSERT_TRUE(id >= 0 && id < loaded_.model->config.vocab_size) << "token id " << id;
  }
  std::vector<int32_t> cuts = kAwkwardCuts;
  for (int32_t c = kSplitAlign; c < len; c += kSplitAlign) cuts.push_back(c);
  ExpectRowsAround(cuts);
  std::cout << GetParam() << ": " << len << " tokens, " << goldens_.rows.size()
            << " rows stored, layers";
  for (int64_t k = 0; k < k_; ++k) std::cout << " " << SlotName(k);
  std::cout << "\n";
}

TEST_P(LongGoldensTest, OnePassMatchesFp32Goldens) {
  const std::vector<float>& out = OnePass();
  ASSERT_FALSE(out.empty());
  const std::vector<Err> errs = ExpectMatchesFp32(out, "one pass");
  std::cout << ErrTable(GetParam(), absl::StrCat("one pass vs HF fp32 at the stored rows (tolerance max_abs <= ",
                                     kRelTol, " * max|ref| + ", kAbsTol, ")"),
                        SlotNames(), errs)
            << std::flush;
}

TEST_P(LongGoldensTest, PlannedChunksEqualOnePassAndMatchFp32Goldens) {
  const std::vector<float>& one = OnePass();
  ASSERT_FALSE(one.empty());
  for (const int64_t budget : {512, 1000}) {
    SCOPED_TRACE(::testing::Message() << "budget " << budget);
    const std::vector<ForwardChunk> chunks = PlanForwardChunks(batch_.lens, budget);
    const std::vector<int32_t> cuts = CutsOfLongSequence(batch_, chunks);
    ASSERT_GE(cuts.size(), 2u) << "the long sequence should span several forwards";
    for (const int32_t c : cuts) EXPECT_EQ(c % kSplitAlign, 0) << "planned cut at " << c;
    ExpectRowsAround(cuts);
    absl::StatusOr<std::vector<float>> got =
        RunChunksFloat(*loaded_.engine, batch_, chunks, goldens_.layers);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(BitMismatches(*got, one, "budget " + std::to_string(budget)), 0u);
    const std::vector<Err> errs = ExpectMatchesFp32(*got, "budget " + std::to_string(budget));
    std::cout << ErrTable(GetParam(),
                          "in " + std::to_string(chunks.size()) + " forwards of <= " +
                              std::to_string(budget) + " tokens vs HF fp32",
                          SlotNames(), errs)
              << std::flush;
  }
}

// Off the grid the delta rule's 64-token chunks regroup (the same recurrence
// in fp32 in another order), so a hybrid model's states move by fp32
// roundings: held to the goldens' bound and, against the one pass, to
// chunked_prefill_test's 1e-4 of the largest state; a model without GDN
// layers computes the same sums in the same order, bit for bit.
TEST_P(LongGoldensTest, AwkwardCutsMatchFp32Goldens) {
  const std::vector<float>& one = OnePass();
  ASSERT_FALSE(one.empty());
  ExpectRowsAround(kAwkwardCuts);
  const std::vector<ForwardChunk> chunks = CutLongSequence(batch_, kAwkwardCuts);
  absl::StatusOr<std::vector<float>> got =
      RunChunksFloat(*loaded_.engine, batch_, chunks, goldens_.layers);
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<Err> errs = ExpectMatchesFp32(*got, "awkward cuts");
  const auto& types = loaded_.model->config.layer_types;
  if (std::count(types.begin(), types.end(), LayerKind::kLinearAttention) > 0) {
    EXPECT_LT(MaxRelativeError(*got, one), 1e-4);
    EXPECT_NE(*got, one) << "unaligned cuts changed nothing: is the carry in use?";
  } else {
    EXPECT_EQ(BitMismatches(*got, one, "awkward cuts"), 0u);
  }
  std::cout << ErrTable(GetParam(), "cut at 1, 63, 65, 1000, 2047, 2999 vs HF fp32",
                        SlotNames(), errs)
            << std::flush;
}

INSTANTIATE_TEST_SUITE_P(Families, LongGoldensTest,
                         ::testing::Values("qwen35_text", "qwen3", "qwen35_moe", "qwen3_moe"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace draftfeed::testing
