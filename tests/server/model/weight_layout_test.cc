// The structure description: features per architecture, the canonical tensor
// order, the random-init rules, and a CUDA packing that covers every tensor of
// every block exactly once (the CUDA engine's upload relies on it, and only a
// GPU would otherwise notice).
#include "server/model/weight_layout.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/model/model.h"

namespace draftfeed {
namespace {

TEST(WeightLayoutTest, FeaturesComeFromTheArchitecture) {
  const ArchFeatures hybrid = FeaturesOf(Arch::kQwen35Hybrid);
  EXPECT_EQ(hybrid.norm, NormConvention::kOffsetOne);
  EXPECT_TRUE(hybrid.gated_attention);
  EXPECT_TRUE(hybrid.linear_attention);
  const ArchFeatures dense = FeaturesOf(Arch::kQwen3Dense);
  EXPECT_EQ(dense.norm, NormConvention::kPlain);
  EXPECT_FALSE(dense.gated_attention);
  EXPECT_FALSE(dense.linear_attention);
  EXPECT_TRUE(dense.qk_norm);
  EXPECT_EQ(dense.mlp, MlpKind::kDenseSwiGlu);
}

TEST(WeightLayoutTest, LayerBlocksInCanonicalOrder) {
  absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel("tiny-random");
  ASSERT_TRUE(m.ok()) << m.status();
  const ModelConfig& c = (*m)->config;
  EXPECT_EQ(BlocksOfLayer(c, 0).mixer, BlockKind::kGatedDeltaNet);
  EXPECT_EQ(BlocksOfLayer(c, 3).mixer, BlockKind::kAttention);
  EXPECT_EQ(BlocksOfLayer(c, 3).mlp, BlockKind::kDenseMlp);
  std::vector<std::string> layer3;
  for (const WeightSpec& s : DecoderWeightSpecs(c)) {
    if (s.layer == 3) layer3.push_back(s.name);
  }
  EXPECT_EQ(layer3, (std::vector<std::string>{
                        "layers.3.input_layernorm.weight",
                        "layers.3.post_attention_layernorm.weight",
                        "layers.3.self_attn.q_proj.weight",
                        "layers.3.self_attn.k_proj.weight",
                        "layers.3.self_attn.v_proj.weight",
                        "layers.3.self_attn.o_proj.weight",
                        "layers.3.self_attn.q_norm.weight",
                        "layers.3.self_attn.k_norm.weight",
                        "layers.3.mlp.gate_proj.weight",
                        "layers.3.mlp.up_proj.weight",
                        "layers.3.mlp.down_proj.weight",
                    }));
}

TEST(WeightLayoutTest, RandomInitRules) {
  ModelConfig dense;
  dense.SetArch(Arch::kQwen3Dense);
  dense.hidden_size = 64;
  dense.intermediate_size = 100;
  dense.num_heads = 2;
  dense.num_kv_heads = 1;
  dense.head_dim = 32;
  const std::vector<WeightSpec> norms = BlockSpecs(dense, BlockKind::kNorms, 0);
  ASSERT_EQ(norms.size(), 2u);
  EXPECT_EQ(norms[0].init.offset, 1.0);  // w near 1 for the plain convention
  const std::vector<WeightSpec> mlp = BlockSpecs(dense, BlockKind::kDenseMlp, 0);
  ASSERT_EQ(mlp.size(), 3u);
  EXPECT_EQ(mlp[2].init.scale, 0.1);  // down_proj: 1/sqrt(intermediate_size = 100)

  ModelConfig hybrid = dense;
  hybrid.SetArch(Arch::kQwen35Hybrid);
  EXPECT_EQ(BlockSpecs(hybrid, BlockKind::kNorms, 0)[0].init.offset, 0.0);
  for (const WeightSpec& s : BlockSpecs(hybrid, BlockKind::kGatedDeltaNet, 0)) {
    const bool a_log = s.member == &LayerWeights::A_log;
    EXPECT_EQ(s.init.dist == RandomInit::Dist::kLogUniform, a_log) << s.name;
    EXPECT_EQ(s.device_f32, a_log || s.member == &LayerWeights::dt_bias) << s.name;
  }
}

TEST(WeightLayoutTest, DevicePackingCoversEveryTensorOnce) {
  ModelConfig c;
  c.SetArch(Arch::kQwen35Hybrid);
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 32;
  for (BlockKind kind : {BlockKind::kNorms, BlockKind::kAttention, BlockKind::kGatedDeltaNet,
                         BlockKind::kDenseMlp}) {
    const std::vector<WeightSpec> specs = BlockSpecs(c, kind, 0);
    std::vector<int> seen(specs.size(), 0);
    for (const DeviceBuffer& buffer : BlockDeviceBuffers(kind)) {
      ASSERT_FALSE(buffer.empty());
      std::vector<bool> f32;  // one buffer holds one element type
      for (Tensor LayerWeights::*m : buffer) {
        int found = 0;
        for (size_t i = 0; i < specs.size(); ++i) {
          if (specs[i].member == m) {
            ++seen[i];
            ++found;
            f32.push_back(specs[i].device_f32);
          }
        }
        EXPECT_EQ(found, 1) << "block " << static_cast<int>(kind);
      }
      for (bool f : f32) EXPECT_EQ(f, f32.front());
    }
    for (size_t i = 0; i < specs.size(); ++i) EXPECT_EQ(seen[i], 1) << specs[i].name;
  }
}

}  // namespace
}  // namespace draftfeed
