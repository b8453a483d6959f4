// The target outputs' row layout and the checks every stream's request passes.
#include "common/target_outputs.h"

#include <numeric>

#include <gtest/gtest.h>

namespace draftfeed {
namespace {

TEST(TargetOutputsLayout, FollowsTheWireOrder) {
  TargetOutputs o{.argmax = true, .top_k = 3, .draft_vocab = {5, 1, 9, 2, 7}};
  TargetOutputsLayout l = LayoutOf(o);
  EXPECT_EQ(l.argmax, 0);
  EXPECT_EQ(l.top_k_ids, 4);
  EXPECT_EQ(l.top_k_logprobs, 16);
  EXPECT_EQ(l.probs_scale, -1);
  EXPECT_EQ(l.probs, 28);
  EXPECT_EQ(l.bytes, 28 + 5 * 2);
  o.probs_encoding = CaptureEncoding::kFp8E4m3;
  l = LayoutOf(o);
  EXPECT_EQ(l.probs_scale, 28);
  EXPECT_EQ(l.probs, 32);
  EXPECT_EQ(l.bytes, 32 + 5);
  EXPECT_EQ(LayoutOf(TargetOutputs{}).bytes, 0);
  const TargetOutputsLayout only_k = LayoutOf(TargetOutputs{.top_k = 2});
  EXPECT_EQ(only_k.argmax, -1);
  EXPECT_EQ(only_k.top_k_ids, 0);
  EXPECT_EQ(only_k.bytes, 16);
}

absl::Status Check(TargetOutputs o, int64_t vocab = 1000) { return ValidateTargetOutputs(o, vocab); }

TEST(TargetOutputsCheck, NamesTheField) {
  EXPECT_TRUE(Check({.argmax = true, .top_k = 256, .draft_vocab = {999, 0}}).ok());
  EXPECT_TRUE(Check({.top_k = 10}, 10).ok());
  auto message = [](absl::Status s) { return std::string(s.message()); };
  EXPECT_NE(message(Check({.top_k = 257})).find("top_k is 257"), std::string::npos);
  EXPECT_NE(message(Check({.top_k = 11}, 10)).find("top_k is 11: it must be in [0, 10]"),
            std::string::npos);
  EXPECT_NE(message(Check({.top_k = -1})).find("top_k is -1"), std::string::npos);
  EXPECT_NE(message(Check({.draft_vocab = {4, 1000}})).find("draft_vocab[1] is 1000"),
            std::string::npos);
  EXPECT_NE(message(Check({.draft_vocab = {-3}})).find("draft_vocab[0] is -3"), std::string::npos);
  EXPECT_NE(message(Check({.draft_vocab = {8, 2, 8}})).find("lists id 8 twice (at 0 and 2)"),
            std::string::npos);
  std::vector<int32_t> many(kMaxDraftVocab + 1);
  std::iota(many.begin(), many.end(), 0);
  EXPECT_NE(message(Check({.draft_vocab = many}, 1 << 20)).find("at most 65536"),
            std::string::npos);
  many.resize(11);
  EXPECT_NE(message(Check({.draft_vocab = many}, 10)).find("more than the target's vocabulary"),
            std::string::npos);
  const absl::Status bad_encoding =
      Check({.draft_vocab = {1}, .probs_encoding = static_cast<CaptureEncoding>(7)});
  EXPECT_EQ(bad_encoding.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(message(bad_encoding).find("draft_probs_encoding"), std::string::npos);
}

}  // namespace
}  // namespace draftfeed
