#include "kernels/cpu/embedding.h"

#include <vector>

#include "gtest/gtest.h"

namespace draftfeed::cpu {
namespace {

// Widening bf16/fp16 to fp32 is exact, so every check here is equality.

TEST(EmbeddingTest, Bf16RowsAreGatheredAndWidened) {
  // 3 x 2 table; 0x3F80 = 1, 0xC000 = −2, 0x4049 = 3.140625, 0x0000 = 0,
  // 0xBF00 = −0.5, 0x4110 = 9.
  const std::vector<uint16_t> table = {0x3F80, 0xC000, 0x4049, 0x0000, 0xBF00, 0x4110};
  const std::vector<int32_t> ids = {2, 0, 2, 1};
  std::vector<float> out(ids.size() * 2);
  EmbeddingBf16(table.data(), 3, 2, ids.data(), 4, out.data());
  EXPECT_EQ(out, (std::vector<float>{-0.5f, 9, 1, -2, -0.5f, 9, 3.140625f, 0}));
}

TEST(EmbeddingTest, Fp16RowsIncludingSubnormalAndMax) {
  // 0x3C00 = 1, 0xC000 = −2, 0x0001 = 2^−24 (subnormal), 0x7BFF = 65504.
  const std::vector<uint16_t> table = {0x3C00, 0xC000, 0x0001, 0x7BFF};
  const std::vector<int32_t> ids = {1, 0};
  std::vector<float> out(4);
  EmbeddingFp16(table.data(), 2, 2, ids.data(), 2, out.data());
  EXPECT_EQ(out, (std::vector<float>{0x1p-24f, 65504.0f, 1, -2}));
}

TEST(EmbeddingTest, F32RowsAreCopied) {
  const std::vector<float> table = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<int32_t> ids = {2, 2, 1};
  std::vector<float> out(9);
  EmbeddingF32(table.data(), 3, 3, ids.data(), 3, out.data());
  EXPECT_EQ(out, (std::vector<float>{7, 8, 9, 7, 8, 9, 4, 5, 6}));
}

TEST(EmbeddingDeathTest, OutOfRangeIdAborts) {
  const std::vector<float> table = {1, 2};
  const std::vector<int32_t> ids = {2};
  std::vector<float> out(1);
  EXPECT_DEATH(EmbeddingF32(table.data(), 2, 1, ids.data(), 1, out.data()),
               "ids\\[0\\] = 2 outside \\[0, 2\\)");
}

}  // namespace
}  // namespace draftfeed::cpu
