#include "kernels/cpu/rope.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace draftfeed::cpu {
namespace {

TEST(SequencePositionsTest, RestartAtEverySequence) {
  const std::vector<int32_t> cu = {0, 3, 5, 9};
  std::vector<int32_t> pos(9, -1);
  SequencePositions(cu.data(), 3, pos.data());
  EXPECT_EQ(pos, (std::vector<int32_t>{0, 1, 2, 0, 1, 0, 1, 2, 3}));
}

TEST(RopeTest, PartialRotationByHand) {
  // head_dim 8, rotary_dim 4, θ = 1e4: inv_freq = [1, 1e4^−½ = 0.01], so at
  // position 1 the pair (0, 2) turns by 1 rad and (1, 3) by 0.01 rad. Values
  // worked out in double; fp32 cos/sin/multiply-add stay within 1e-6.
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<int32_t> pos = {1};
  ApplyRope(x.data(), 1, 1, 8, 4, pos.data(), 1e4f);
  EXPECT_NEAR(x[0], -1.9841106485555495, 1e-6);
  EXPECT_NEAR(x[2], 2.4623779024123156, 1e-6);
  EXPECT_NEAR(x[1], 1.959900667496664, 1e-6);
  EXPECT_NEAR(x[3], 4.019799668334994, 1e-6);
  // Dims at and past rotary_dim pass through bit for bit.
  EXPECT_EQ(x[4], 5);
  EXPECT_EQ(x[5], 6);
  EXPECT_EQ(x[6], 7);
  EXPECT_EQ(x[7], 8);
}

TEST(RopeTest, PositionZeroIsIdentity) {
  std::vector<float> x = {0.5f, -1.25f, 3, 7};
  const std::vector<float> before = x;
  const std::vector<int32_t> pos = {0};
  ApplyRope(x.data(), 1, 1, 4, 4, pos.data(), 1e6f);
  EXPECT_EQ(x, before);
}

TEST(RopeTest, EveryHeadGetsTheSameRotation) {
  // 2 tokens x 3 heads x head_dim 6 (rotary 4): heads with equal inputs
  // must come out equal, and dims 4, 5 of every head are untouched.
  const int64_t heads = 3, hd = 6;
  std::vector<float> x(2 * heads * hd);
  for (int t = 0; t < 2; ++t) {
    for (int h = 0; h < heads; ++h) {
      for (int d = 0; d < hd; ++d) x[(t * heads + h) * hd + d] = 0.25f * d - t;
    }
  }
  const std::vector<float> before = x;
  const std::vector<int32_t> pos = {5, 9};
  ApplyRope(x.data(), 2, heads, hd, 4, pos.data(), 1e7f);
  for (int t = 0; t < 2; ++t) {
    for (int h = 1; h < heads; ++h) {
      for (int d = 0; d < hd; ++d) {
        EXPECT_EQ(x[(t * heads + h) * hd + d], x[t * heads * hd + d]) << t << " " << h << " " << d;
      }
    }
    for (int h = 0; h < heads; ++h) {
      EXPECT_EQ(x[(t * heads + h) * hd + 4], before[(t * heads + h) * hd + 4]);
      EXPECT_EQ(x[(t * heads + h) * hd + 5], before[(t * heads + h) * hd + 5]);
    }
  }
}

TEST(RopeTest, FullRotaryMatchesDoubleReferenceAndKeepsPairNorms) {
  // Qwen3 style: rotary_dim == head_dim = 16, θ = 1e6, positions up to 4000
  // where fp32 angle rounding matters most. The reference takes the same
  // fp32 angle (as transformers does) and rotates in double; the rest of
  // the error is fp32 cos/sin and two products: 1e-5 absolute on O(1) data.
  const int64_t hd = 16, tokens = 4;
  const std::vector<int32_t> pos = {0, 1, 37, 4000};
  std::vector<float> x(tokens * hd);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(1.3 * i);
  const std::vector<float> in = x;
  ApplyRope(x.data(), tokens, 1, hd, hd, pos.data(), 1e6f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < hd / 2; ++j) {
      const float inv_freq = 1.0f / std::pow(1e6f, static_cast<float>(2 * j) / hd);
      const double angle = static_cast<float>(pos[t]) * inv_freq;
      const double a = in[t * hd + j], b = in[t * hd + j + hd / 2];
      EXPECT_NEAR(x[t * hd + j], a * std::cos(angle) - b * std::sin(angle), 1e-5);
      EXPECT_NEAR(x[t * hd + j + hd / 2], b * std::cos(angle) + a * std::sin(angle), 1e-5);
      const double norm_in = a * a + b * b;
      const double norm_out = double(x[t * hd + j]) * x[t * hd + j] +
                              double(x[t * hd + j + hd / 2]) * x[t * hd + j + hd / 2];
      EXPECT_NEAR(norm_out, norm_in, 1e-5);
    }
  }
}

TEST(RopeTest, PackedPositionsRestartPerSequence) {
  // Sequences of 3 and 2 tokens with the same per-position inputs: the second
  // sequence's tokens must come out exactly like the first sequence's first
  // two (the same positions 0, 1), not like positions 3, 4.
  const int64_t hd = 8;
  const std::vector<int32_t> cu = {0, 3, 5};
  std::vector<int32_t> pos(5);
  SequencePositions(cu.data(), 2, pos.data());
  std::vector<float> x(5 * hd);
  for (int t = 0; t < 5; ++t) {
    const int p = t < 3 ? t : t - 3;
    for (int d = 0; d < hd; ++d) x[t * hd + d] = 1.0f + 0.5f * d + 0.25f * p;
  }
  ApplyRope(x.data(), 5, 1, hd, 4, pos.data(), 1e4f);
  for (int d = 0; d < hd; ++d) {
    EXPECT_EQ(x[3 * hd + d], x[0 * hd + d]) << d;
    EXPECT_EQ(x[4 * hd + d], x[1 * hd + d]) << d;
  }
  EXPECT_NE(x[1 * hd], 1.25f);  // position 1 did rotate
}

}  // namespace
}  // namespace draftfeed::cpu
