#include "server/model/weight_check.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "server/model/model.h"

namespace draftfeed {
namespace {

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
                             "; the checkpoint is corrupt (--check_weights)");

  words[last] = 0x3f80;
  words[4097] = 0xff80;  // -Inf in the second block
  words[4098] = 0x7fc0;  // a NaN after it: the first one is named
  s = CheckWeightsFinite(m);
  EXPECT_EQ(s.message(), "tiny-random:0: tensor layers.1.mlp.down_proj.weight (BF16 " +
                             down.ShapeString() +
                             ") holds -Inf at element 4097; the checkpoint is corrupt "
                             "(--check_weights)");

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
                ") holds NaN at element 0; the checkpoint is corrupt (--check_weights)");
  ln[0] = 0x7bff;  // the largest finite fp16
  EXPECT_EQ(CheckWeightsFinite(m).message(),
            "tiny-random:0: tensor norm.weight (F32 " + m.weights.norm.ShapeString() +
                ") holds +Inf at element 2; the checkpoint is corrupt (--check_weights)");
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
                ") holds +Inf at element 10; the checkpoint is corrupt (--check_weights)");
}

}  // namespace
}  // namespace draftfeed
