#include <cmath>
#include <cstring>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/model.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Model> Make(const std::string& spec) {
  absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(spec);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

TEST(RandomModelTest, TinyRandomIsTheSpecifiedHybrid) {
  std::unique_ptr<Model> m = Make("tiny-random");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->id, "tiny-random:0");
  const ModelConfig& c = m->config;
  EXPECT_EQ(c.arch, Arch::kQwen35Hybrid);
  EXPECT_EQ(c.vocab_size, 4096);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 256);
  EXPECT_EQ(c.num_layers, 4);
  EXPECT_EQ(c.layer_types,
            (std::vector<LayerKind>{LayerKind::kLinearAttention, LayerKind::kLinearAttention,
                                    LayerKind::kLinearAttention, LayerKind::kFullAttention}));
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rotary_dim(), 16);
  EXPECT_EQ(c.rope_theta, 1e7);
  EXPECT_EQ(c.linear_num_key_heads, 2);
  EXPECT_EQ(c.linear_num_value_heads, 4);
  EXPECT_EQ(c.linear_key_head_dim, 32);
  EXPECT_EQ(c.linear_value_head_dim, 32);
  EXPECT_EQ(c.linear_conv_kernel, 4);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_TRUE(c.Validate().ok());
  // Every decoder tensor is present, bf16 and of the canonical shape; the
  // untied head is a tensor of its own.
  for (const WeightSpec& s : DecoderWeightSpecs(c)) {
    const Tensor& t = WeightSlot(m->weights, s);
    ASSERT_TRUE(t.valid()) << s.name;
    EXPECT_EQ(t.dtype, DType::kBF16) << s.name;
    EXPECT_EQ(t.shape, s.shape) << s.name;
  }
  ASSERT_TRUE(m->weights.lm_head.valid());
  EXPECT_EQ(m->weights.lm_head.shape, (std::vector<int64_t>{4096, 128}));
  EXPECT_NE(m->weights.lm_head.data, m->weights.embed_tokens.data);
  EXPECT_EQ(m->fingerprint, ComputeFingerprint(*m));
  EXPECT_FALSE(m->fingerprint.empty());
}

TEST(RandomModelTest, TinyRandomQwen3IsTheSpecifiedDenseModel) {
  std::unique_ptr<Model> m = Make("tiny-random-qwen3:5");
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->id, "tiny-random-qwen3:5");
  const ModelConfig& c = m->config;
  EXPECT_EQ(c.arch, Arch::kQwen3Dense);
  EXPECT_EQ(c.vocab_size, 4096);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.intermediate_size, 256);
  EXPECT_EQ(c.num_layers, 3);
  EXPECT_EQ(c.layer_types, std::vector<LayerKind>(3, LayerKind::kFullAttention));
  EXPECT_EQ(c.num_heads, 4);
  EXPECT_EQ(c.num_kv_heads, 2);
  EXPECT_EQ(c.head_dim, 32);
  EXPECT_EQ(c.rotary_dim(), 32);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(m->weights.lm_head.data, m->weights.embed_tokens.data);
  EXPECT_EQ(m->weights.layers[0].q_proj.shape, (std::vector<int64_t>{128, 128}));  // no gate rows
  EXPECT_FALSE(m->weights.layers[0].in_proj_qkv.valid());
}

TEST(RandomModelTest, DeterministicPerSeedAndDifferentAcrossSeeds) {
  std::unique_ptr<Model> a = Make("tiny-random:7"), b = Make("tiny-random:7");
  std::unique_ptr<Model> c = Make("tiny-random:8");
  std::unique_ptr<Model> zero = Make("tiny-random"), zero_explicit = Make("tiny-random:0");
  ASSERT_TRUE(a && b && c && zero && zero_explicit);
  EXPECT_EQ(a->fingerprint, b->fingerprint);
  EXPECT_NE(a->fingerprint, c->fingerprint);
  EXPECT_EQ(zero->fingerprint, zero_explicit->fingerprint);
  EXPECT_NE(zero->fingerprint, a->fingerprint);
  for (const WeightSpec& s : DecoderWeightSpecs(a->config)) {
    EXPECT_TRUE(SameBytes(WeightSlot(a->weights, s), WeightSlot(b->weights, s))) << s.name;
    EXPECT_FALSE(SameBytes(WeightSlot(a->weights, s), WeightSlot(c->weights, s))) << s.name;
  }
  EXPECT_TRUE(SameBytes(a->weights.lm_head, b->weights.lm_head));
  // The two architectures draw different tensors from the same seed.
  std::unique_ptr<Model> dense = Make("tiny-random-qwen3:7");
  ASSERT_TRUE(dense);
  EXPECT_NE(dense->fingerprint, a->fingerprint);
}

struct Stats {
  double mean = 0, stddev = 0, min = INFINITY, max = -INFINITY;
};
Stats StatsOf(const Tensor& t) {
  const std::vector<float> v = ToFloat(t);
  Stats s;
  for (float x : v) {
    s.mean += x;
    s.min = std::min<double>(s.min, x);
    s.max = std::max<double>(s.max, x);
  }
  s.mean /= static_cast<double>(v.size());
  for (float x : v) s.stddev += (x - s.mean) * (x - s.mean);
  s.stddev = std::sqrt(s.stddev / static_cast<double>(v.size()));
  return s;
}

TEST(RandomModelTest, InitialisationScalesFollowEachNormConvention) {
  // Sample statistics of a few hundred draws: bounds are several standard
  // errors wide, yet far apart for the two conventions (mean 0 vs 1).
  std::unique_ptr<Model> m = Make("tiny-random:3");
  ASSERT_NE(m, nullptr);
  const LayerWeights& gdn = m->weights.layers[0];
  const LayerWeights& attn = m->weights.layers[3];
  const Stats in_norm = StatsOf(gdn.input_layernorm);  // zero-centred: ~N(0, 0.1)
  EXPECT_NEAR(in_norm.mean, 0.0, 0.05);
  EXPECT_NEAR(in_norm.stddev, 0.1, 0.03);
  EXPECT_NEAR(StatsOf(attn.q_norm).mean, 0.0, 0.05);
  EXPECT_NEAR(StatsOf(m->weights.norm).mean, 0.0, 0.05);
  const Stats gated = StatsOf(gdn.norm);  // multiplicative: ~1 + N(0, 0.1)
  EXPECT_NEAR(gated.mean, 1.0, 0.06);
  const Stats a_log = StatsOf(gdn.A_log);  // log U(1, 16)
  EXPECT_GE(a_log.min, 0.0);
  EXPECT_LE(a_log.max, std::log(16.0) + 0.02);
  const Stats proj = StatsOf(gdn.in_proj_qkv);  // N(0, 1/sqrt(128))
  EXPECT_NEAR(proj.stddev, 1.0 / std::sqrt(128.0), 0.005);
  const Stats down = StatsOf(gdn.down_proj);  // fan-in 256
  EXPECT_NEAR(down.stddev, 1.0 / 16.0, 0.003);

  std::unique_ptr<Model> dense = Make("tiny-random-qwen3:3");
  ASSERT_NE(dense, nullptr);
  EXPECT_NEAR(StatsOf(dense->weights.layers[0].input_layernorm).mean, 1.0, 0.05);
  EXPECT_NEAR(StatsOf(dense->weights.layers[0].k_norm).mean, 1.0, 0.06);
  EXPECT_NEAR(StatsOf(dense->weights.norm).mean, 1.0, 0.05);
}

TEST(RandomModelTest, UnknownSpecListsTheValidOnes) {
  for (const std::string spec : {"tiny", "tiny-random-llama", "", "tiny-random-qwen3x:1"}) {
    absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(spec);
    ASSERT_FALSE(m.ok()) << spec;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(m.status().message()),
                HasSubstr("built-in specs are tiny-random[:SEED], tiny-random-qwen3[:SEED]"));
    EXPECT_THAT(std::string(m.status().message()),
                HasSubstr("unknown built-in model '" + spec + "'"));
  }
}

TEST(RandomModelTest, BadSeedIsRejected) {
  for (const std::string spec : {"tiny-random:", "tiny-random:x1", "tiny-random:-1",
                                 "tiny-random:99999999999999999999999"}) {
    absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(spec);
    ASSERT_FALSE(m.ok()) << spec;
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("is not a non-negative integer"))
        << spec;
  }
}

}  // namespace
}  // namespace draftfeed

namespace draftfeed {
namespace {

// Real-size shapes carry no host weights; their fingerprint stands for the
// seed and shape, so two seeds (or shapes) never share one.
TEST(RandomModelTest, DeviceRandomModelsFingerprintBySeedAndShape) {
  auto a = MakeRandomModel("random:qwen3.6-27b");
  auto b = MakeRandomModel("random:qwen3.6-27b:1");
  auto c = MakeRandomModel("random:qwen3-8b");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_TRUE((*a)->weights_on_device_random);
  EXPECT_EQ((*a)->id, "random:qwen3.6-27b:0");
  EXPECT_EQ((*a)->config.num_layers, 64);
  EXPECT_EQ((*a)->weights.layers[3].q_proj.shape, (std::vector<int64_t>{12288, 5120}));
  EXPECT_EQ((*a)->weights.layers[3].q_proj.data, nullptr);
  EXPECT_EQ((*a)->fingerprint, (*MakeRandomModel("random:qwen3.6-27b:0"))->fingerprint);
  EXPECT_NE((*a)->fingerprint, (*b)->fingerprint);
  EXPECT_NE((*a)->fingerprint, (*c)->fingerprint);
  EXPECT_EQ((*a)->fingerprint.size(), (*MakeRandomModel("tiny-random"))->fingerprint.size());
}

}  // namespace
}  // namespace draftfeed
