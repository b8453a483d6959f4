// MoE configs (qwen3_5_moe in both dialects, qwen3_moe), their layout, the
// built-in MoE random models and their router's load spread, the CPU
// engine's MoE block checked against dense models it must reduce to, and the
// routing against transformers' (tests/data goldens).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/moe.h"
#include "server/model/cpu_engine.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"
#include "server/model/weight_layout.h"

#include "tests/test_data_dir.h"

namespace draftfeed {
namespace {

using ::testing::HasSubstr;

constexpr char kQwen35MoeMultimodal[] = R"({
  "architectures": ["Qwen3_5MoeForConditionalGeneration"],
  "model_type": "qwen3_5_moe",
  "tie_word_embeddings": false,
  "text_config": {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 8,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001,
    "norm_topk_prob": false, "mlp_only_layers": [1], "decoder_sparse_step": 2,
    "full_attention_interval": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25}
  }
})";

constexpr char kQwen3Moe[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
  "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 4,
  "head_dim": 128, "rope_theta": 1000000.0, "tie_word_embeddings": false,
  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
  "norm_topk_prob": true, "decoder_sparse_step": 2, "mlp_only_layers": [3]
})";

absl::StatusOr<ModelConfig> Parse(const std::string& json) {
  return ModelConfig::FromJson(json, "/ckpt/config.json");
}

std::string ErrorOf(const std::string& json) {
  absl::StatusOr<ModelConfig> c = Parse(json);
  EXPECT_FALSE(c.ok());
  return c.ok() ? "" : std::string(c.status().message());
}

std::string Edit(std::string s, const std::string& from, const std::string& to) {
  EXPECT_NE(s.find(from), std::string::npos) << from;
  absl::StrReplaceAll({{from, to}}, &s);
  return s;
}

TEST(MoeConfigTest, Qwen35MoeIgnoresTheKeysItsClassDropped) {
  absl::StatusOr<ModelConfig> c = Parse(kQwen35MoeMultimodal);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Arch::kQwen35Moe);
  EXPECT_TRUE(c->multimodal);
  EXPECT_EQ(c->features.mlp, MlpKind::kMoeSharedExpert);
  EXPECT_TRUE(c->features.linear_attention && c->features.gated_attention);
  EXPECT_EQ(c->num_experts, 256);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_EQ(c->moe_intermediate_size, 512);
  EXPECT_EQ(c->shared_expert_intermediate_size, 512);
  // Qwen3_5MoeTextConfig has no norm_topk_prob / mlp_only_layers /
  // decoder_sparse_step: every layer is MoE and renormalised.
  EXPECT_TRUE(c->norm_topk_prob);
  for (int64_t i = 0; i < c->num_layers; ++i) {
    EXPECT_EQ(c->MlpOfLayer(i), MlpKind::kMoeSharedExpert) << i;
    EXPECT_EQ(BlocksOfLayer(*c, i).mlp, BlockKind::kMoeMlp);
  }
  EXPECT_EQ(c->layer_types[3], LayerKind::kFullAttention);
  EXPECT_EQ(c->layer_types[2], LayerKind::kLinearAttention);

  // The CausalLM dialect, and transformers' defaults for absent MoE keys.
  std::string text = R"({"architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text", "vocab_size": 1000, "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4})";
  absl::StatusOr<ModelConfig> d = Parse(text);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->multimodal);
  EXPECT_EQ(d->num_experts, 256);
  EXPECT_EQ(d->num_experts_per_tok, 8);
  EXPECT_EQ(d->moe_intermediate_size, 512);
  EXPECT_EQ(d->shared_expert_intermediate_size, 512);
  EXPECT_EQ(d->intermediate_size, 0);  // no dense MLP anywhere
  EXPECT_EQ(d->rope_theta, 1e7);
  EXPECT_EQ(d->partial_rotary_factor, 0.25);
}

TEST(MoeConfigTest, Qwen3MoeLayerRuleAndDefaults) {
  absl::StatusOr<ModelConfig> c = Parse(kQwen3Moe);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Arch::kQwen3Moe);
  EXPECT_EQ(c->features.mlp, MlpKind::kMoe);
  EXPECT_FALSE(c->features.linear_attention);
  EXPECT_TRUE(c->norm_topk_prob);
  // MoE iff not in mlp_only_layers and (i + 1) % 2 == 0: layers 1 and 5.
  const std::vector<MlpKind> want = {MlpKind::kDenseSwiGlu, MlpKind::kMoe,
                                     MlpKind::kDenseSwiGlu, MlpKind::kDenseSwiGlu,
                                     MlpKind::kDenseSwiGlu, MlpKind::kMoe};
  for (int64_t i = 0; i < 6; ++i) EXPECT_EQ(c->MlpOfLayer(i), want[i]) << i;
  EXPECT_EQ(BlocksOfLayer(*c, 3).mlp, BlockKind::kDenseMlp);
  EXPECT_EQ(BlocksOfLayer(*c, 5).mlp, BlockKind::kMoeMlp);

  // Qwen3MoeConfig's defaults: norm_topk_prob false, step 1, no dense layers;
  // num_local_experts is the key its attribute_map saves num_experts under.
  const std::string bare = R"({"model_type": "qwen3_moe", "vocab_size": 100,
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_local_experts": 16})";
  absl::StatusOr<ModelConfig> d = Parse(bare);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->num_experts, 16);
  EXPECT_EQ(d->num_experts_per_tok, 8);
  EXPECT_EQ(d->moe_intermediate_size, 768);
  EXPECT_EQ(d->intermediate_size, 6144);
  EXPECT_FALSE(d->norm_topk_prob);
  EXPECT_EQ(d->MlpOfLayer(0), MlpKind::kMoe);
  EXPECT_EQ(d->head_dim, 16);  // hidden / heads, as Qwen3MoeAttention falls back
  // num_experts = 0 makes every layer dense.
  absl::StatusOr<ModelConfig> dense =
      Parse(Edit(bare, "\"num_local_experts\": 16", "\"num_experts\": 0"));
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ(dense->MlpOfLayer(1), MlpKind::kDenseSwiGlu);
}

TEST(MoeConfigTest, ErrorsNameTheField) {
  EXPECT_EQ(ErrorOf(Edit(kQwen3Moe, "\"num_experts_per_tok\": 8", "\"num_experts_per_tok\": 129")),
            "/ckpt/config.json: num_experts_per_tok=129 must be in [1, num_experts=128]");
  EXPECT_EQ(
      ErrorOf(Edit(kQwen3Moe, "\"moe_intermediate_size\": 768", "\"moe_intermediate_size\": 0")),
      "/ckpt/config.json: moe_intermediate_size must be positive, got 0");
  EXPECT_EQ(ErrorOf(Edit(kQwen3Moe, "\"decoder_sparse_step\": 2", "\"decoder_sparse_step\": 0")),
            "/ckpt/config.json: decoder_sparse_step must be positive, got 0");
  EXPECT_EQ(ErrorOf(Edit(kQwen3Moe, "[3]", "[3, \"x\"]")),
            "/ckpt/config.json: field mlp_only_layers[1] must be an integer, got string");
  EXPECT_EQ(ErrorOf(Edit(kQwen3Moe, "[3]", "[1.5]")),
            "/ckpt/config.json: field mlp_only_layers[0] must be an integer, got 1.5");
  EXPECT_EQ(ErrorOf(Edit(kQwen3Moe, "\"norm_topk_prob\": true", "\"norm_topk_prob\": 1")),
            "/ckpt/config.json: field norm_topk_prob must be a boolean, got number");
  EXPECT_EQ(ErrorOf(Edit(kQwen35MoeMultimodal, "\"num_experts\": 256", "\"num_experts\": 0")),
            "/ckpt/config.json: num_experts must be positive, got 0");
  EXPECT_EQ(ErrorOf(Edit(kQwen35MoeMultimodal, "\"shared_expert_intermediate_size\": 512",
                         "\"shared_expert_intermediate_size\": -1")),
            "/ckpt/config.json: shared_expert_intermediate_size must be positive, got -1");
  EXPECT_EQ(ErrorOf(Edit(kQwen35MoeMultimodal, "\"model_type\": \"qwen3_5_moe_text\"",
                         "\"model_type\": \"qwen3_5_text\"")),
            "/ckpt/config.json: text_config.model_type \"qwen3_5_text\" should be "
            "qwen3_5_moe_text");
  // A dense layer needs intermediate_size.
  EXPECT_EQ(ErrorOf(Edit(kQwen3Moe, "\"intermediate_size\": 6144", "\"intermediate_size\": 0")),
            "/ckpt/config.json: intermediate_size must be positive, got 0");
}

TEST(MoeConfigTest, ToJsonReadsBackTheSameConfig) {
  for (const std::string& json :
       {std::string(kQwen35MoeMultimodal), std::string(kQwen3Moe),
        Edit(kQwen3Moe, "\"norm_topk_prob\": true", "\"norm_topk_prob\": false")}) {
    absl::StatusOr<ModelConfig> a = Parse(json);
    ASSERT_TRUE(a.ok()) << a.status();
    const std::string written = a->ToJson();
    absl::StatusOr<ModelConfig> b = Parse(written);
    ASSERT_TRUE(b.ok()) << b.status() << "\n" << written;
    EXPECT_EQ(b->arch, a->arch);
    EXPECT_EQ(b->multimodal, a->multimodal);
    EXPECT_EQ(b->num_experts, a->num_experts);
    EXPECT_EQ(b->num_experts_per_tok, a->num_experts_per_tok);
    EXPECT_EQ(b->moe_intermediate_size, a->moe_intermediate_size);
    EXPECT_EQ(b->shared_expert_intermediate_size, a->shared_expert_intermediate_size);
    EXPECT_EQ(b->norm_topk_prob, a->norm_topk_prob);
    EXPECT_EQ(b->decoder_sparse_step, a->decoder_sparse_step);
    EXPECT_EQ(b->mlp_only_layers, a->mlp_only_layers);
    EXPECT_EQ(b->intermediate_size, a->intermediate_size);
    EXPECT_EQ(b->layer_types, a->layer_types);
    if (a->arch == Arch::kQwen35Moe) {
      EXPECT_THAT(written, HasSubstr(R"("architectures": ["Qwen3_5MoeForConditionalGeneration"])"));
      EXPECT_THAT(written, HasSubstr(R"("model_type": "qwen3_5_moe_text")"));
      EXPECT_THAT(written, ::testing::Not(HasSubstr("intermediate_size\": 0")));
      EXPECT_THAT(written, ::testing::Not(HasSubstr("norm_topk_prob")));
    } else {
      EXPECT_THAT(written, HasSubstr(R"("architectures": ["Qwen3MoeForCausalLM"])"));
      EXPECT_THAT(written, HasSubstr(R"("mlp_only_layers": [3])"));
    }
  }
}

TEST(MoeLayoutTest, BlockSpecsAndDeviceBuffers) {
  absl::StatusOr<ModelConfig> c = Parse(kQwen35MoeMultimodal);
  ASSERT_TRUE(c.ok());
  const std::vector<WeightSpec> specs = BlockSpecs(*c, BlockKind::kMoeMlp, 2);
  std::vector<std::string> names;
  for (const WeightSpec& s : specs) names.push_back(s.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{
                "layers.2.mlp.gate.weight", "layers.2.mlp.experts.gate_up_proj",
                "layers.2.mlp.experts.down_proj", "layers.2.mlp.shared_expert.gate_proj.weight",
                "layers.2.mlp.shared_expert.up_proj.weight",
                "layers.2.mlp.shared_expert.down_proj.weight",
                "layers.2.mlp.shared_expert_gate.weight"}));
  EXPECT_EQ(specs[0].shape, (std::vector<int64_t>{256, 2048}));
  EXPECT_EQ(specs[1].shape, (std::vector<int64_t>{256, 1024, 2048}));
  EXPECT_EQ(specs[1].expert_parts, (std::vector<std::string>{"gate_proj", "up_proj"}));
  EXPECT_EQ(specs[2].shape, (std::vector<int64_t>{256, 2048, 512}));
  EXPECT_EQ(specs[2].expert_parts, (std::vector<std::string>{"down_proj"}));
  EXPECT_EQ(specs[6].shape, (std::vector<int64_t>{1, 2048}));
  EXPECT_GT(specs[0].init.row_log_sigma, 0.0);
  EXPECT_EQ(specs[1].init.row_log_sigma, 0.0);

  const std::vector<DeviceBuffer>& buffers = BlockDeviceBuffers(BlockKind::kMoeMlp);
  ASSERT_EQ(buffers.size(), 6u);
  EXPECT_EQ(buffers[kMoeRouter], DeviceBuffer{&LayerWeights::router});
  EXPECT_EQ(buffers[kMoeExpertsGateUp], DeviceBuffer{&LayerWeights::experts_gate_up});
  EXPECT_EQ(buffers[kMoeExpertsDown], DeviceBuffer{&LayerWeights::experts_down});
  EXPECT_EQ(buffers[kMoeSharedGateUp],
            (DeviceBuffer{&LayerWeights::shared_gate_proj, &LayerWeights::shared_up_proj}));
  EXPECT_EQ(buffers[kMoeSharedDown], DeviceBuffer{&LayerWeights::shared_down_proj});
  EXPECT_EQ(buffers[kMoeSharedGate], DeviceBuffer{&LayerWeights::shared_expert_gate});

  absl::StatusOr<ModelConfig> q = Parse(kQwen3Moe);
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(BlockSpecs(*q, BlockKind::kMoeMlp, 1).size(), 3u);  // no shared expert
}

std::unique_ptr<Model> Make(const std::string& spec) {
  absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(spec);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

int64_t Params(const ModelConfig& c) {
  int64_t n = LmHeadSpec(c).numel();
  for (const WeightSpec& s : DecoderWeightSpecs(c)) n += s.numel();
  return n;
}

TEST(MoeRandomModelTest, BuiltInShapes) {
  auto tiny = Make("tiny-random-moe");
  ASSERT_NE(tiny, nullptr);
  EXPECT_EQ(tiny->config.arch, Arch::kQwen35Moe);
  EXPECT_EQ(tiny->config.num_experts, 8);
  EXPECT_EQ(tiny->config.num_experts_per_tok, 2);
  EXPECT_EQ(tiny->id, "tiny-random-moe:0");
  EXPECT_EQ(Make("tiny-random-moe:0")->fingerprint, tiny->fingerprint);
  EXPECT_NE(Make("tiny-random-moe:1")->fingerprint, tiny->fingerprint);

  auto qwen3 = Make("tiny-random-qwen3-moe:2");
  ASSERT_NE(qwen3, nullptr);
  EXPECT_EQ(qwen3->config.arch, Arch::kQwen3Moe);
  EXPECT_EQ(BlocksOfLayer(qwen3->config, 0).mlp, BlockKind::kMoeMlp);
  EXPECT_EQ(BlocksOfLayer(qwen3->config, 1).mlp, BlockKind::kDenseMlp);  // both paths run
  EXPECT_EQ(BlocksOfLayer(qwen3->config, 2).mlp, BlockKind::kMoeMlp);

  // Real shapes: weights made on the GPU, total parameters as the names say.
  auto a3b = Make("random:qwen3.6-35b-a3b");
  ASSERT_NE(a3b, nullptr);
  EXPECT_TRUE(a3b->weights_on_device_random);
  const ModelConfig& c = a3b->config;
  EXPECT_EQ(c.num_layers, 40);
  EXPECT_EQ(std::count(c.layer_types.begin(), c.layer_types.end(), LayerKind::kFullAttention), 10);
  EXPECT_EQ(c.num_experts, 256);
  EXPECT_EQ(c.shared_expert_intermediate_size, 512);
  EXPECT_NEAR(static_cast<double>(Params(c)) / 1e9, 35.0, 1.0);
  auto q30 = Make("random:qwen3-30b-a3b");
  ASSERT_NE(q30, nullptr);
  EXPECT_EQ(q30->config.num_experts, 128);
  EXPECT_EQ(q30->config.features.mlp, MlpKind::kMoe);
  EXPECT_TRUE(q30->config.norm_topk_prob);
  EXPECT_NEAR(static_cast<double>(Params(q30->config)) / 1e9, 30.5, 1.0);
  auto big = Make("random:qwen3.5-122b-a10b");
  ASSERT_NE(big, nullptr);
  EXPECT_NEAR(static_cast<double>(Params(big->config)) / 1e9, 122.0, 3.0);
}

// Routes 4096 random normed tokens through a random router of `experts` rows
// (drawn as the random models draw them) and returns each expert's load
// relative to the mean, sorted ascending. `equal_norms` rescales every row to
// the same norm: the iid router the row spread replaces.
std::vector<double> RouterLoads(int64_t experts, int64_t k, bool equal_norms) {
  ModelConfig c;
  c.SetArch(Arch::kQwen35Moe);
  c.vocab_size = 16;
  c.hidden_size = 256;
  c.num_layers = 1;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 16;
  c.linear_key_head_dim = c.linear_value_head_dim = 8;
  c.linear_num_key_heads = 1;
  c.linear_num_value_heads = 1;
  c.layer_types = {LayerKind::kFullAttention};
  c.num_experts = experts;
  c.num_experts_per_tok = k;
  c.moe_intermediate_size = 4;
  c.shared_expert_intermediate_size = 4;
  absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(c, 3);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return {};
  std::vector<float> w = ToFloat((*m)->weights.layers[0].router);
  const int64_t d = c.hidden_size, tokens = 4096;
  if (equal_norms) {
    for (int64_t e = 0; e < experts; ++e) {
      double sq = 0;
      for (int64_t j = 0; j < d; ++j) sq += double(w[e * d + j]) * w[e * d + j];
      for (int64_t j = 0; j < d; ++j) w[e * d + j] /= static_cast<float>(std::sqrt(sq));
    }
  }
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(tokens * d));
  for (float& v : x) v = normal(rng);
  std::vector<float> logits(static_cast<size_t>(tokens * experts));
  cpu::Gemm(x.data(), w.data(), logits.data(), tokens, experts, d, 1);
  std::vector<int32_t> ids(static_cast<size_t>(tokens * k));
  std::vector<float> weights(ids.size());
  cpu::MoeRoute(logits.data(), tokens, experts, k, true, ids.data(), weights.data());
  std::vector<double> load(static_cast<size_t>(experts), 0.0);
  for (int32_t id : ids) load[static_cast<size_t>(id)] += 1.0;
  for (double& l : load) l /= static_cast<double>(tokens * k) / static_cast<double>(experts);
  std::sort(load.begin(), load.end());
  return load;
}

TEST(MoeRandomModelTest, RouterSpreadsLoadLikeATrainedRouter) {
  // Trained Qwen/Mixtral-style routers without load balancing: the hottest
  // expert takes a few times the mean load and a few experts get almost
  // none. The ranges are those of 20 seeds of the same construction at
  // these sizes (weight_layout.cc's kRouterRowLogSigma), with a margin.
  const std::vector<double> e256 = RouterLoads(256, 8, false);
  ASSERT_EQ(e256.size(), 256u);
  EXPECT_GE(e256.back(), 2.5);
  EXPECT_LE(e256.back(), 7.0);
  const double cold = static_cast<double>(std::count_if(e256.begin(), e256.end(),
                                                        [](double l) { return l < 0.25; })) /
                      256.0;
  EXPECT_GE(cold, 0.05);
  EXPECT_LE(cold, 0.35);
  const std::vector<double> e128 = RouterLoads(128, 8, false);
  EXPECT_GE(e128.back(), 1.8);
  EXPECT_LE(e128.back(), 5.0);
  // The same rows at equal norms route almost uniformly: the spread comes
  // from the row norms, not from chance.
  const std::vector<double> flat = RouterLoads(256, 8, true);
  EXPECT_LE(flat.back(), 1.4);
  EXPECT_GE(flat.front(), 0.6);
}

// A host fp32 copy of a model whose tensors the test may edit.
struct EditableModel {
  Model model;
  std::vector<std::vector<float>> buffers;
  std::vector<float>& Own(Tensor& t) {
    std::vector<float>& b = buffers.emplace_back(ToFloat(t));
    t.dtype = DType::kF32;
    t.data = reinterpret_cast<const std::byte*>(b.data());
    return b;
  }
};

std::unique_ptr<EditableModel> Editable(const Model& src) {
  auto out = std::make_unique<EditableModel>();
  out->buffers.reserve(1024);
  out->model.id = src.id;
  out->model.config = src.config;
  out->model.weights = src.weights;
  std::vector<WeightSpec> specs = DecoderWeightSpecs(src.config);
  if (!src.config.tie_word_embeddings) specs.push_back(LmHeadSpec(src.config));
  for (const WeightSpec& s : specs) out->Own(WeightSlot(out->model.weights, s));
  if (src.config.tie_word_embeddings) out->model.weights.lm_head = out->model.weights.embed_tokens;
  return out;
}

std::vector<float> Forward(const Model& m, const std::vector<int32_t>& tokens,
                           const std::vector<int32_t>& lens, const std::vector<int32_t>& layers) {
  absl::StatusOr<std::unique_ptr<CpuEngine>> e = CpuEngine::Create(&m, 2);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return {};
  std::vector<float> out(tokens.size() * layers.size() * static_cast<size_t>(m.config.hidden_size));
  const absl::Status st = (*e)->ForwardFloat({tokens, lens, layers}, out);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// The MoE model of `moe_spec` with every expert a copy of expert 0 (and, with a shared
// expert, the shared expert a copy of it too and its gate zero), beside the
// dense model of the same architecture whose MLP is expert 0 with down_proj
// scaled by `down_scale`: 1 for renormalised routing alone (the weights sum
// to one), 1.5 with the shared expert (sigmoid(0) = 0.5).
void CheckReducesToDense(const std::string& moe_spec, Arch dense_arch) {
  // The built-in's config with its dense layers (if any) as wide as an
  // expert, so that one dense model holds every layer's MLP.
  ModelConfig config = Make(moe_spec)->config;
  if (config.features.mlp == MlpKind::kMoe) config.intermediate_size = config.moe_intermediate_size;
  absl::StatusOr<std::unique_ptr<Model>> made = MakeRandomModel(config, 4);
  ASSERT_TRUE(made.ok()) << made.status();
  const std::unique_ptr<Model>& src = *made;
  auto moe = Editable(*src);
  const ModelConfig& mc = moe->model.config;
  const bool shared = mc.features.mlp == MlpKind::kMoeSharedExpert;
  const int64_t e_count = mc.num_experts, i = mc.moe_intermediate_size, d = mc.hidden_size;
  ASSERT_TRUE(mc.norm_topk_prob);

  ModelConfig dc = mc;
  dc.SetArch(dense_arch);
  dc.intermediate_size = i;
  dc.num_experts = 0;
  auto dense_src = MakeRandomModel(dc, 1);
  ASSERT_TRUE(dense_src.ok()) << dense_src.status();
  auto dense = Editable(**dense_src);

  for (int64_t l = 0; l < mc.num_layers; ++l) {
    LayerWeights& mw = moe->model.weights.layers[static_cast<size_t>(l)];
    LayerWeights& dw = dense->model.weights.layers[static_cast<size_t>(l)];
    // Everything but the MLP is the MoE model's.
    for (Tensor LayerWeights::*m :
         {&LayerWeights::input_layernorm, &LayerWeights::post_attention_layernorm,
          &LayerWeights::q_proj, &LayerWeights::k_proj, &LayerWeights::v_proj,
          &LayerWeights::o_proj, &LayerWeights::q_norm, &LayerWeights::k_norm,
          &LayerWeights::in_proj_qkv, &LayerWeights::in_proj_z, &LayerWeights::in_proj_b,
          &LayerWeights::in_proj_a, &LayerWeights::conv1d, &LayerWeights::A_log,
          &LayerWeights::dt_bias, &LayerWeights::norm, &LayerWeights::out_proj}) {
      dw.*m = mw.*m;
    }
    if (mc.MlpOfLayer(l) == MlpKind::kDenseSwiGlu) {
      dw.gate_proj = mw.gate_proj;
      dw.up_proj = mw.up_proj;
      dw.down_proj = mw.down_proj;
      continue;
    }
    float* gate_up = const_cast<float*>(reinterpret_cast<const float*>(mw.experts_gate_up.data));
    float* down = const_cast<float*>(reinterpret_cast<const float*>(mw.experts_down.data));
    for (int64_t e = 1; e < e_count; ++e) {
      std::copy_n(gate_up, 2 * i * d, gate_up + e * 2 * i * d);
      std::copy_n(down, d * i, down + e * d * i);
    }
    std::vector<float>& g = dense->Own(dw.gate_proj);
    std::vector<float>& u = dense->Own(dw.up_proj);
    std::vector<float>& dn = dense->Own(dw.down_proj);
    std::copy_n(gate_up, i * d, g.data());
    std::copy_n(gate_up + i * d, i * d, u.data());
    std::copy_n(down, d * i, dn.data());
    if (shared) {
      ASSERT_EQ(mc.shared_expert_intermediate_size, i);
      auto fill = [&](Tensor& t, const float* from) {
        std::copy_n(from, t.numel(), const_cast<float*>(reinterpret_cast<const float*>(t.data)));
      };
      fill(mw.shared_gate_proj, gate_up);
      fill(mw.shared_up_proj, gate_up + i * d);
      fill(mw.shared_down_proj, down);
      std::vector<float> zeros(static_cast<size_t>(d), 0.0f);
      fill(mw.shared_expert_gate, zeros.data());
      for (float& v : dn) v *= 1.5f;
    }
  }
  dense->model.weights.embed_tokens = moe->model.weights.embed_tokens;
  dense->model.weights.norm = moe->model.weights.norm;
  dense->model.weights.lm_head = moe->model.weights.lm_head;

  const std::vector<int32_t> tokens = {5, 900, 17, 4000, 3, 3, 77, 1024, 2048, 9};
  const std::vector<int32_t> lens = {4, 6};
  const std::vector<int32_t> layers = {0, static_cast<int32_t>(mc.num_layers - 1), -1};
  const std::vector<float> a = Forward(moe->model, tokens, lens, layers);
  const std::vector<float> b = Forward(dense->model, tokens, lens, layers);
  ASSERT_EQ(a.size(), b.size());
  // Identical maths but for the k routing weights, which sum to 1 within a
  // few fp32 ulps, and the order of the final adds: 1e-4 of the state's scale
  // (states are O(1..10)); a wrong gate/up order, weight or shared-expert
  // gate is off by O(1).
  double scale = 0;
  for (float v : b) scale = std::max(scale, std::fabs(double(v)));
  for (size_t n = 0; n < a.size(); ++n) ASSERT_NEAR(a[n], b[n], 1e-4 * scale) << n;
}

TEST(MoeCpuEngineTest, IdenticalExpertsReduceToTheDenseModel) {
  CheckReducesToDense("tiny-random-qwen3-moe:4", Arch::kQwen3Dense);
  CheckReducesToDense("tiny-random-moe:4", Arch::kQwen35Hybrid);
}

TEST(MoeCpuEngineTest, PackedEqualsAloneAndThreadCountsAgree) {
  for (const char* spec : {"tiny-random-moe:2", "tiny-random-qwen3-moe:2"}) {
    auto m = Make(spec);
    ASSERT_NE(m, nullptr);
    std::mt19937_64 rng(3);
    std::vector<int32_t> tokens(40);
    for (int32_t& t : tokens) t = static_cast<int32_t>(rng() % 4096);
    const std::vector<int32_t> lens = {13, 20, 7};
    const std::vector<int32_t> layers = {1, -1};
    const std::vector<float> packed = Forward(*m, tokens, lens, layers);
    const int64_t h = m->config.hidden_size;
    int64_t begin = 0;
    for (int32_t len : lens) {
      const std::vector<int32_t> one(tokens.begin() + begin, tokens.begin() + begin + len);
      const std::vector<float> alone = Forward(*m, one, {len}, layers);
      ASSERT_EQ(
          std::memcmp(alone.data(), packed.data() + begin * 2 * h, alone.size() * sizeof(float)), 0)
          << spec << " sequence at " << begin;
      begin += len;
    }
    for (float v : packed) ASSERT_TRUE(std::isfinite(v));
  }
}

}  // namespace
}  // namespace draftfeed

namespace draftfeed {
namespace {

std::string GoldensPath(const std::string& model) {
  return (testing::TestDataDir() / absl::StrCat("goldens_", model, ".safetensors")).string();
}

template <typename T>
std::vector<T> Copy(const SafetensorsTensor& t) {
  std::vector<T> out(t.nbytes / sizeof(T));
  std::memcpy(out.data(), t.data, t.nbytes);
  return out;
}

// MoeRoute on transformers' own fp32 router logits (the goldens record them
// per token and layer) picks transformers' experts in its order with its
// weights: fp32 softmax, top-k and renormalisation as transformers 5.17 runs
// them on the CPU. Weights to 1e-6 (a few fp32 ulps of values <= 1).
TEST(MoeRouteGoldensTest, MatchesTransformersRouting) {
  for (const std::string model : {"qwen35_moe", "qwen3_moe"}) {
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(GoldensPath(model));
    ASSERT_TRUE(f.ok()) << f.status();
    const std::map<std::string, std::string>& md = f->metadata();
    const int64_t experts = std::stoll(md.at("num_experts"));
    const int64_t k = std::stoll(md.at("num_experts_per_tok"));
    const bool renormalize = md.at("renormalise_topk") == "True";
    const int64_t layers = std::stoll(md.at("num_layers"));
    const std::vector<std::string> mlp = absl::StrSplit(md.at("mlp_types"), ',');
    int64_t routed = 0;
    for (int s = 0; s < std::stoi(md.at("num_seqs")); ++s) {
      const std::string p = absl::StrCat("seq", s, ".fp32.");
      const SafetensorsTensor* logits_t = f->Find(p + "router_logits");
      ASSERT_NE(logits_t, nullptr);
      const std::vector<float> logits = Copy<float>(*logits_t);
      const std::vector<int32_t> want_ids = Copy<int32_t>(*f->Find(p + "topk_ids"));
      const std::vector<float> want_w = Copy<float>(*f->Find(p + "topk_weights"));
      const int64_t tokens = logits_t->shape[0];
      for (int64_t l = 0; l < layers; ++l) {
        if (mlp[static_cast<size_t>(l)] != "moe") continue;
        for (int64_t t = 0; t < tokens; ++t) {
          std::vector<int32_t> ids(static_cast<size_t>(k));
          std::vector<float> w(static_cast<size_t>(k));
          cpu::MoeRoute(logits.data() + (t * layers + l) * experts, 1, experts, k, renormalize,
                        ids.data(), w.data());
          for (int64_t j = 0; j < k; ++j) {
            const size_t at = static_cast<size_t>((t * layers + l) * k + j);
            ASSERT_EQ(ids[j], want_ids[at]) << model << " seq" << s << " layer " << l << " t" << t;
            ASSERT_NEAR(w[j], want_w[at], 1e-6) << model << " seq" << s << " layer " << l;
          }
          ++routed;
        }
      }
    }
    EXPECT_GT(routed, 300) << model;
  }
}

}  // namespace
}  // namespace draftfeed
