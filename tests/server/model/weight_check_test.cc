#include "server/model/weight_check.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "server/model/model.h"

namespace draftfeed {
namespace {

constexpr char kFix[] =
    "; the checkpoint is corrupt: download or convert it again (--check_weights=false starts "
    "without this check, serving whatever these weights compute)";

// "[r, c]" of flat element i of a [rows, cols] tensor.
std::string Index2(const Tensor& t, int64_t i) {
  return "[" + std::to_string(i / t.shape[1]) + ", " + std::to_string(i % t.shape[1]) + "]";
}

// A copy of `t`'s bytes as 16-bit words, which `t` then points at, so one
// element can be corrupted without touching the model's storage.
std::vector<uint16_t> Redirect16(Tensor& t) {
  std::vector<uint16_t> copy(static_cast<size_t>(t.numel()));
  std::memcpy(copy.data(), t.data, t.nbytes());
  return copy;
}

TEST(WeightCheckTest, FiniteModelsPass) {
  for (const char* spec : {"tiny-random:0", "tiny-random-qwen3:3"}) {
    auto model = OpenModel(spec);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_TRUE(CheckWeightsFinite(**model).ok()) << spec;
  }
}

TEST(WeightCheckTest, Bf16NaNAndInfinityAreNamed) {
  auto model = OpenModel("tiny-random:0");
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  Tensor& down = m.weights.layers[1].down_proj;
  ASSERT_EQ(down.dtype, DType::kBF16);
  std::vector<uint16_t> words = Redirect16(down);
  down.data = reinterpret_cast<const std::byte*>(words.data());
  EXPECT_TRUE(CheckWeightsFinite(m).ok());  // an exact copy is still finite

  const int64_t last = down.numel() - 1;  // the last element of the last block
  words[last] = 0x7fc1;                   // a quiet NaN with payload
  absl::Status s = CheckWeightsFinite(m);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "tiny-random:0: tensor layers.1.mlp.down_proj.weight (BF16 " +
                             down.ShapeString() + ") holds NaN at element " + std::to_string(last) +
                             " (index " + Index2(down, last) + ")" + kFix);

  words[last] = 0x3f80;
  words[4097] = 0xff80;  // -Inf in the second block
  words[4098] = 0x7fc0;  // a NaN after it: the first one is named
  s = CheckWeightsFinite(m);
  EXPECT_EQ(s.message(), "tiny-random:0: tensor layers.1.mlp.down_proj.weight (BF16 " +
                             down.ShapeString() + ") holds -Inf at element 4097 (index " +
                             Index2(down, 4097) + ")" + kFix);

  // The largest finite bf16 (exponent one below all ones) is fine.
  words[4097] = 0x7f7f;
  words[4098] = 0xff7f;
  EXPECT_TRUE(CheckWeightsFinite(m).ok());
}

TEST(WeightCheckTest, TensorsAreScannedInCanonicalOrderWithTheirDtype) {
  auto model = OpenModel("tiny-random:0");
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  // An F32 final norm holding +Inf, and an F16 layer-0 norm holding NaN: the
  // layer comes first in canonical order.
  std::vector<float> norm(static_cast<size_t>(m.weights.norm.numel()), 1.0f);
  norm[2] = std::numeric_limits<float>::infinity();
  m.weights.norm.dtype = DType::kF32;
  m.weights.norm.data = reinterpret_cast<const std::byte*>(norm.data());
  std::vector<uint16_t> ln(static_cast<size_t>(m.weights.layers[0].input_layernorm.numel()),
                           0x3c00);  // fp16 1.0
  ln[0] = 0x7e00;
  m.weights.layers[0].input_layernorm.dtype = DType::kF16;
  m.weights.layers[0].input_layernorm.data = reinterpret_cast<const std::byte*>(ln.data());
  const std::string shape = m.weights.layers[0].input_layernorm.ShapeString();
  EXPECT_EQ(CheckWeightsFinite(m).message(),
            "tiny-random:0: tensor layers.0.input_layernorm.weight (F16 " + shape +
                ") holds NaN at element 0 (index [0])" + kFix);
  ln[0] = 0x7bff;  // the largest finite fp16
  EXPECT_EQ(CheckWeightsFinite(m).message(), "tiny-random:0: tensor norm.weight (F32 " +
                                                 m.weights.norm.ShapeString() +
                                                 ") holds +Inf at element 2 (index [2])" + kFix);
}

TEST(WeightCheckTest, UntiedLmHeadIsScanned) {
  auto model = OpenModel("tiny-random:0");
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  Tensor& head = m.weights.lm_head;
  ASSERT_TRUE(head.valid());
  ASSERT_NE(head.data, m.weights.embed_tokens.data) << "tiny-random should be untied";
  std::vector<uint16_t> words = Redirect16(head);
  words[10] = 0x7f80;
  head.data = reinterpret_cast<const std::byte*>(words.data());
  EXPECT_EQ(CheckWeightsFinite(m).message(),
            "tiny-random:0: tensor lm_head.weight (BF16 " + head.ShapeString() +
                ") holds +Inf at element 10 (index [0, 10])" + kFix);
}

// A tensor of many chunks (8 MiB each) scanned by several threads: the first
// bad element in order is named whatever the thread count, and the stats
// count every tensor and byte.
TEST(WeightCheckTest, ThreadsNameTheFirstBadElement) {
  auto model = OpenModel("tiny-random:0");
  ASSERT_TRUE(model.ok()) << model.status();
  Model& m = **model;
  WeightCheckStats clean;
  ASSERT_TRUE(CheckWeightsFinite(m, &clean, 1).ok());
  Tensor& embed = m.weights.embed_tokens;
  const int64_t old_bytes = static_cast<int64_t>(embed.nbytes());
  std::vector<uint16_t> big(int64_t{5} << 22, 0x3f80);  // 40 MiB of bf16 1.0: five chunks
  embed.shape = {static_cast<int64_t>(big.size()) / 128, 128};
  embed.data = reinterpret_cast<const std::byte*>(big.data());
  for (const int threads : {1, 2, 3, 16}) {
    WeightCheckStats stats;
    EXPECT_TRUE(CheckWeightsFinite(m, &stats, threads).ok());
    EXPECT_EQ(stats.tensors, clean.tensors);
    EXPECT_EQ(stats.bytes, clean.bytes - old_bytes + static_cast<int64_t>(big.size()) * 2);
    EXPECT_EQ(stats.threads, threads);
  }
  big[(int64_t{3} << 22) + 5] = 0x7f80;  // chunk 3
  big[(int64_t{1} << 22) + 7] = 0xffc0;  // chunk 1: named
  m.weights.norm = embed;                // a later tensor, bad too
  const int64_t first = (int64_t{1} << 22) + 7;
  for (const int threads : {1, 2, 3, 16}) {
    EXPECT_EQ(CheckWeightsFinite(m, nullptr, threads).message(),
              "tiny-random:0: tensor embed_tokens.weight (BF16 " + embed.ShapeString() +
                  ") holds NaN at element " + std::to_string(first) + " (index " +
                  Index2(embed, first) + ")" + kFix)
        << threads << " threads";
  }
}

}  // namespace
}  // namespace draftfeed
