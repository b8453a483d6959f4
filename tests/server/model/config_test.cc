#include "server/model/config.h"

#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace draftfeed {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr LayerKind kLin = LayerKind::kLinearAttention;
constexpr LayerKind kFull = LayerKind::kFullAttention;

// The Qwen3.5-27B / 3.6-27B config.json layout (text_config nested in the
// multimodal config, explicit layer_types), cut to 8 layers.
constexpr char kMultimodal[] = R"json({
  "architectures": ["Qwen3_5ForConditionalGeneration"],
  "model_type": "qwen3_5",
  "image_token_id": 248056,
  "tie_word_embeddings": false,
  "vision_config": {"model_type": "qwen3_5", "depth": 27, "hidden_size": 1152},
  "text_config": {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 8,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 262144,
    "attention_bias": false,
    "attn_output_gate": true,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 1,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention",
                    "linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "partial_rotary_factor": 0.25,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                        "mrope_interleaved": true}
  }
})json";

// A bare Qwen3_5ForCausalLM config with every optional field left out.
constexpr char kTextMinimal[] = R"json({
  "architectures": ["Qwen3_5ForCausalLM"],
  "model_type": "qwen3_5_text",
  "vocab_size": 512,
  "hidden_size": 64,
  "intermediate_size": 96,
  "num_hidden_layers": 6,
  "num_attention_heads": 4,
  "num_key_value_heads": 2
})json";

constexpr char kQwen3[] = R"json({
  "architectures": ["Qwen3ForCausalLM"],
  "model_type": "qwen3",
  "vocab_size": 151936,
  "hidden_size": 1024,
  "intermediate_size": 3072,
  "num_hidden_layers": 3,
  "num_attention_heads": 16,
  "num_key_value_heads": 8,
  "head_dim": 128,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "use_sliding_window": false,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16"
})json";

std::string Edit(std::string json, absl::string_view from, absl::string_view to) {
  const std::string before = json;
  absl::StrReplaceAll({{from, to}}, &json);
  EXPECT_NE(before, json) << "test edit did not apply: " << from;
  return json;
}

std::string ErrorOf(const std::string& json) {
  auto c = ModelConfig::FromJson(json, "/ckpt/config.json");
  EXPECT_FALSE(c.ok());
  return c.ok() ? "" : std::string(c.status().message());
}

void ExpectSameConfig(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.arch, b.arch);
  EXPECT_EQ(a.multimodal, b.multimodal);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_heads, b.num_heads);
  EXPECT_EQ(a.num_kv_heads, b.num_kv_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.partial_rotary_factor, b.partial_rotary_factor);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.layer_types, b.layer_types);
  if (a.features.linear_attention) {
    EXPECT_EQ(a.linear_conv_kernel, b.linear_conv_kernel);
    EXPECT_EQ(a.linear_key_head_dim, b.linear_key_head_dim);
    EXPECT_EQ(a.linear_value_head_dim, b.linear_value_head_dim);
    EXPECT_EQ(a.linear_num_key_heads, b.linear_num_key_heads);
    EXPECT_EQ(a.linear_num_value_heads, b.linear_num_value_heads);
  }
}

TEST(ConfigTest, MultimodalReadsTextConfig) {
  auto c = ModelConfig::FromJson(kMultimodal, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Arch::kQwen35Hybrid);
  EXPECT_TRUE(c->multimodal);
  EXPECT_EQ(c->vocab_size, 248320);
  EXPECT_EQ(c->hidden_size, 5120);
  EXPECT_EQ(c->intermediate_size, 17408);
  EXPECT_EQ(c->num_layers, 8);
  EXPECT_EQ(c->num_heads, 24);
  EXPECT_EQ(c->num_kv_heads, 4);
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_EQ(c->rope_theta, 1e7);
  // Given in rope_parameters and on the decoder, with one value.
  EXPECT_EQ(c->partial_rotary_factor, 0.25);
  EXPECT_EQ(c->rotary_dim(), 64);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->linear_conv_kernel, 4);
  EXPECT_EQ(c->linear_key_head_dim, 128);
  EXPECT_EQ(c->linear_value_head_dim, 128);
  EXPECT_EQ(c->linear_num_key_heads, 16);
  EXPECT_EQ(c->linear_num_value_heads, 48);
  EXPECT_THAT(c->layer_types, ElementsAre(kLin, kLin, kLin, kFull, kLin, kLin, kLin, kFull));
  EXPECT_EQ(ArchName(c->arch), "qwen3_5");
}

TEST(ConfigTest, OuterTieWordEmbeddingsWinsForMultimodal) {
  auto c = ModelConfig::FromJson(
      Edit(kMultimodal, "\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true"), "x");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(c->tie_word_embeddings);
}

TEST(ConfigTest, TextConfigDefaults) {
  auto c = ModelConfig::FromJson(kTextMinimal, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->multimodal);
  EXPECT_EQ(c->head_dim, 256);  // Qwen3_5TextConfig default, not hidden/heads
  EXPECT_EQ(c->rope_theta, 1e7);
  EXPECT_EQ(c->partial_rotary_factor, 0.25);  // never 1.0 for Qwen3.5
  EXPECT_EQ(c->rotary_dim(), 64);
  EXPECT_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->linear_num_value_heads, 32);
  EXPECT_EQ(c->linear_num_key_heads, 16);
  // Derived with the default interval 4: layer i is full when (i+1) % 4 == 0.
  EXPECT_THAT(c->layer_types, ElementsAre(kLin, kLin, kLin, kFull, kLin, kLin));
}

TEST(ConfigTest, DerivedLayerTypesFollowInterval) {
  auto c = ModelConfig::FromJson(Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                                      "\"num_hidden_layers\": 6, \"full_attention_interval\": 3"),
                                 "x");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->layer_types, ElementsAre(kLin, kLin, kFull, kLin, kLin, kFull));
}

TEST(ConfigTest, ExplicitLayerTypesAcceptLegacyNames) {
  auto c = ModelConfig::FromJson(Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                                      R"("num_hidden_layers": 4, "full_attention_interval": 2,
              "layer_types": ["mamba", "attention", "full_attention", "linear_attention"])"),
                                 "x");
  ASSERT_TRUE(c.ok()) << c.status();
  // The explicit list wins over full_attention_interval.
  EXPECT_THAT(c->layer_types, ElementsAre(kLin, kFull, kFull, kLin));
}

TEST(ConfigTest, RopeFallsBackToRopeScalingThenTopLevel) {
  auto scaling = ModelConfig::FromJson(Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                                            R"("num_hidden_layers": 6,
              "rope_scaling": {"type": "mrope", "rope_theta": 5000000,
                               "partial_rotary_factor": 0.5})"),
                                       "x");
  ASSERT_TRUE(scaling.ok()) << scaling.status();
  EXPECT_EQ(scaling->rope_theta, 5e6);
  EXPECT_EQ(scaling->partial_rotary_factor, 0.5);

  auto top = ModelConfig::FromJson(
      Edit(kTextMinimal, "\"num_hidden_layers\": 6",
           R"("num_hidden_layers": 6, "rope_theta": 250000, "partial_rotary_factor": 0.125,
              "rope_parameters": {"rope_type": "default"})"),
      "x");
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ(top->rope_theta, 250000);
  EXPECT_EQ(top->partial_rotary_factor, 0.125);
  EXPECT_EQ(top->rotary_dim(), 32);

  auto params_first = ModelConfig::FromJson(Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                                                 R"("num_hidden_layers": 6, "rope_theta": 7e6,
              "rope_scaling": {"partial_rotary_factor": 1.0},
              "rope_parameters": {"rope_theta": 7000000})"),
                                            "x");
  ASSERT_TRUE(params_first.ok()) << params_first.status();
  EXPECT_EQ(params_first->rope_theta, 7e6);             // two places, one value
  EXPECT_EQ(params_first->partial_rotary_factor, 1.0);  // from rope_scaling
}

// A RoPE key given in two places with two values is refused naming both,
// rather than resolved by a precedence another reader of the file may not share.
TEST(ConfigTest, RopeKeysThatDisagreeAreRefused) {
  EXPECT_EQ(ErrorOf(Edit(kMultimodal, "\"partial_rotary_factor\": 0.25,\n    \"rope_parameters\"",
                         "\"partial_rotary_factor\": 0.5,\n    \"rope_parameters\"")),
            "/ckpt/config.json: text_config.rope_parameters.partial_rotary_factor = 0.25 and "
            "text_config.partial_rotary_factor = 0.5 disagree; give one value");
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                         R"("num_hidden_layers": 6, "rope_theta": 1e6,
              "rope_scaling": {"rope_theta": 5e6})")),
            "/ckpt/config.json: rope_scaling.rope_theta = 5e+06 and rope_theta = 1e+06 "
            "disagree; give one value");
}

// Numbers that load but would serve NaN or nonsense: a base of 1e-300 overflows
// RoPE's inverse frequencies; eps <= 0 divides by zero on a zero row.
TEST(ConfigTest, NonsensicalNumbersAreRefused) {
  auto with = [](absl::string_view field) {
    return Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                absl::StrCat("\"num_hidden_layers\": 6, ", field));
  };
  EXPECT_EQ(ErrorOf(with(R"("rope_theta": 1e-300)")),
            "/ckpt/config.json: rope_theta must be in [10, 1e+12], got 1e-300");
  EXPECT_EQ(ErrorOf(with(R"("rope_theta": 1)")),
            "/ckpt/config.json: rope_theta must be in [10, 1e+12], got 1");
  EXPECT_EQ(ErrorOf(with(R"("rope_theta": -10000)")),
            "/ckpt/config.json: rope_theta must be in [10, 1e+12], got -10000");
  EXPECT_EQ(ErrorOf(with(R"("rope_theta": 1e13)")),
            "/ckpt/config.json: rope_theta must be in [10, 1e+12], got 1e+13");
  EXPECT_EQ(ErrorOf(with(R"("rms_norm_eps": 0)")),
            "/ckpt/config.json: rms_norm_eps must be in (0, 1), got 0");
  EXPECT_EQ(ErrorOf(with(R"("rms_norm_eps": -1e-6)")),
            "/ckpt/config.json: rms_norm_eps must be in (0, 1), got -1e-06");
  EXPECT_EQ(ErrorOf(with(R"("rms_norm_eps": 1)")),
            "/ckpt/config.json: rms_norm_eps must be in (0, 1), got 1");
  // The real values load: Qwen3's 1e6, Qwen3-2507's 5e6, Qwen3.5's 1e7, Llama's 1e4.
  for (const char* theta : {"1e6", "5e6", "1e7", "1e4"}) {
    auto c = ModelConfig::FromJson(with(absl::StrCat(R"("rope_theta": )", theta)), "x");
    EXPECT_TRUE(c.ok()) << theta << ": " << c.status();
  }
  // Sizes past any real model: refused by name, not allocated (a layer count
  // of 4e12 made the parser derive 4e12 layer types; found by fuzz_config).
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                         "\"num_hidden_layers\": 4000000000000")),
            "/ckpt/config.json: num_hidden_layers must be at most 1024, got 4000000000000");
  EXPECT_EQ(ErrorOf(Edit(kQwen3, "\"hidden_size\": 1024", "\"hidden_size\": 4000000000")),
            "/ckpt/config.json: hidden_size must be at most 262144, got 4000000000");
  EXPECT_EQ(ErrorOf(Edit(kQwen3, "\"vocab_size\": 151936", "\"vocab_size\": 900000000000")),
            "/ckpt/config.json: vocab_size must be at most 2147483647, got 900000000000");
  ModelConfig nan_eps = *ModelConfig::FromJson(kTextMinimal, "x");
  nan_eps.rms_norm_eps = std::nan("");
  EXPECT_EQ(nan_eps.Validate().message(), "rms_norm_eps must be in (0, 1), got nan");
  ModelConfig inf_theta = *ModelConfig::FromJson(kTextMinimal, "x");
  inf_theta.rope_theta = std::numeric_limits<double>::infinity();
  EXPECT_EQ(inf_theta.Validate().message(), "rope_theta must be in [10, 1e+12], got inf");
}

TEST(ConfigTest, Qwen3Dense) {
  auto c = ModelConfig::FromJson(kQwen3, "config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Arch::kQwen3Dense);
  EXPECT_EQ(ArchName(c->arch), "qwen3");
  EXPECT_FALSE(c->multimodal);
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_EQ(c->num_heads, 16);
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->partial_rotary_factor, 1.0);
  EXPECT_EQ(c->rotary_dim(), 128);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_THAT(c->layer_types, ElementsAre(kFull, kFull, kFull));
}

TEST(ConfigTest, Qwen3Defaults) {
  auto c = ModelConfig::FromJson(R"json({
    "model_type": "qwen3", "vocab_size": 100, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 8})json",
                                 "x");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 32);     // hidden / heads
  EXPECT_EQ(c->num_kv_heads, 8);  // plain MHA
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->partial_rotary_factor, 1.0);
  EXPECT_FALSE(c->tie_word_embeddings);
}

TEST(ConfigTest, ArchitectureAloneGivesModelType) {
  auto c = ModelConfig::FromJson(Edit(kQwen3, "\"model_type\": \"qwen3\",", ""), "x");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->arch, Arch::kQwen3Dense);
}

TEST(ConfigTest, RoundTripsThroughToJson) {
  for (const char* json : {kMultimodal, kTextMinimal, kQwen3}) {
    auto c = ModelConfig::FromJson(json, "in");
    ASSERT_TRUE(c.ok()) << c.status();
    const std::string out = c->ToJson();
    auto back = ModelConfig::FromJson(out, "out");
    ASSERT_TRUE(back.ok()) << back.status() << "\n" << out;
    ExpectSameConfig(*c, *back);
  }
}

TEST(ConfigTest, ToJsonShapes) {
  auto mm = ModelConfig::FromJson(kMultimodal, "in");
  ASSERT_TRUE(mm.ok());
  const std::string m = mm->ToJson();
  EXPECT_THAT(m, HasSubstr(R"("architectures": ["Qwen3_5ForConditionalGeneration"])"));
  EXPECT_THAT(m, HasSubstr(R"("model_type": "qwen3_5",)"));
  EXPECT_THAT(m, HasSubstr("\"text_config\": {\n    \"model_type\": \"qwen3_5_text\""));
  EXPECT_THAT(m, HasSubstr(R"("rope_theta": 10000000.0)"));
  EXPECT_THAT(m, HasSubstr(R"("partial_rotary_factor": 0.25)"));
  EXPECT_THAT(m, HasSubstr(R"("mrope_section": [11, 11, 10])"));
  EXPECT_THAT(m, HasSubstr(R"("mrope_interleaved": true)"));
  EXPECT_THAT(m, HasSubstr(R"("attn_output_gate": true)"));
  EXPECT_THAT(m, HasSubstr(R"("rms_norm_eps": 1e-06)"));
  EXPECT_THAT(m, HasSubstr(R"("layer_types": ["linear_attention", "linear_attention", )"
                           R"("linear_attention", "full_attention", "linear_attention")"));
  EXPECT_THAT(m, HasSubstr(R"("dtype": "bfloat16")"));
  EXPECT_THAT(m, HasSubstr(R"("torch_dtype": "bfloat16")"));

  ModelConfig text = *mm;
  text.multimodal = false;
  const std::string t = text.ToJson();
  EXPECT_THAT(t, HasSubstr(R"("architectures": ["Qwen3_5ForCausalLM"])"));
  EXPECT_THAT(t, HasSubstr(R"("model_type": "qwen3_5_text")"));
  EXPECT_THAT(t, Not(HasSubstr("text_config")));
  auto text_back = ModelConfig::FromJson(t, "out");
  ASSERT_TRUE(text_back.ok());
  EXPECT_FALSE(text_back->multimodal);

  auto dense = ModelConfig::FromJson(kQwen3, "in");
  ASSERT_TRUE(dense.ok());
  const std::string d = dense->ToJson();
  EXPECT_THAT(d, HasSubstr(R"("architectures": ["Qwen3ForCausalLM"])"));
  EXPECT_THAT(d, HasSubstr(R"("model_type": "qwen3")"));
  EXPECT_THAT(d, HasSubstr(R"("rope_parameters": {)"));
  EXPECT_THAT(d, Not(HasSubstr("linear_")));
  EXPECT_THAT(d, Not(HasSubstr("partial_rotary_factor")));
}

TEST(ConfigTest, UnknownModelTypeListsSupported) {
  EXPECT_EQ(ErrorOf(R"({"model_type": "llama", "hidden_size": 8})"),
            "/ckpt/config.json: unsupported model_type \"llama\"; supported: qwen3_5, "
            "qwen3_5_text, qwen3, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe");
  EXPECT_EQ(ErrorOf(Edit(kQwen3, "Qwen3ForCausalLM", "MixtralForCausalLM")),
            "/ckpt/config.json: unsupported architecture \"MixtralForCausalLM\"; supported: "
            "Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM, Qwen3ForCausalLM, "
            "Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM");
  EXPECT_EQ(ErrorOf(Edit(kQwen3, "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")),
            "/ckpt/config.json: architecture \"Qwen3MoeForCausalLM\" does not match model_type "
            "\"qwen3\"");
  EXPECT_EQ(ErrorOf(Edit(kQwen3, "\"model_type\": \"qwen3\"", "\"model_type\": \"qwen3_5_text\"")),
            "/ckpt/config.json: architecture \"Qwen3ForCausalLM\" does not match model_type "
            "\"qwen3_5_text\"");
  EXPECT_EQ(ErrorOf(R"({"hidden_size": 8})"),
            "/ckpt/config.json: missing required field model_type");
}

TEST(ConfigTest, MissingFieldsNameFieldAndFile) {
  EXPECT_EQ(ErrorOf(Edit(kMultimodal, "\"hidden_size\": 5120,", "")),
            "/ckpt/config.json: missing required field text_config.hidden_size");
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"num_key_value_heads\": 2", "\"x\": 0")),
            "/ckpt/config.json: missing required field num_key_value_heads");
  EXPECT_EQ(ErrorOf(Edit(kQwen3, "\"vocab_size\": 151936,", "")),
            "/ckpt/config.json: missing required field vocab_size");
  EXPECT_EQ(ErrorOf(R"({"model_type": "qwen3_5"})"),
            "/ckpt/config.json: missing required field text_config");
}

TEST(ConfigTest, WrongJsonTypes) {
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"hidden_size\": 64", "\"hidden_size\": \"64\"")),
            "/ckpt/config.json: field hidden_size must be an integer, got string");
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"hidden_size\": 64", "\"hidden_size\": 64.5")),
            "/ckpt/config.json: field hidden_size must be an integer, got 64.5");
  EXPECT_EQ(ErrorOf(Edit(kMultimodal, "\"rms_norm_eps\": 1e-06", "\"rms_norm_eps\": [1]")),
            "/ckpt/config.json: field text_config.rms_norm_eps must be a number, got array");
  EXPECT_EQ(ErrorOf(Edit(kQwen3, "\"tie_word_embeddings\": true", "\"tie_word_embeddings\": 1")),
            "/ckpt/config.json: field tie_word_embeddings must be a boolean, got number");
  EXPECT_EQ(ErrorOf(Edit(kMultimodal, "\"text_config\": {", "\"text_config\": 3, \"t\": {")),
            "/ckpt/config.json: field text_config must be an object, got number");
  EXPECT_EQ(
      ErrorOf(Edit(kMultimodal, "\"layer_types\": [\"linear_attention\"", "\"layer_types\": [7")),
      "/ckpt/config.json: field text_config.layer_types[0] must be a string, got number");
  EXPECT_EQ(ErrorOf(Edit(kMultimodal, "\"rope_theta\": 10000000", "\"rope_theta\": \"1e7\"")),
            "/ckpt/config.json: field text_config.rope_parameters.rope_theta must be a number, "
            "got string");
}

TEST(ConfigTest, NotJson) {
  EXPECT_THAT(ErrorOf("{\"model_type\": "), HasSubstr("/ckpt/config.json: not a JSON object: "));
  EXPECT_THAT(ErrorOf("[1, 2]"), HasSubstr("/ckpt/config.json: not a JSON object: "));
}

TEST(ConfigTest, UnknownLayerType) {
  EXPECT_EQ(ErrorOf(Edit(kMultimodal, "\"full_attention\"]", "\"sliding_attention\"]")),
            "/ckpt/config.json: text_config.layer_types[7] has unsupported layer type "
            "\"sliding_attention\" for qwen3_5; accepted: full_attention, linear_attention (or "
            "legacy attention, mamba)");
  EXPECT_EQ(
      ErrorOf(
          Edit(kQwen3, "\"num_hidden_layers\": 3",
               R"("num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"])")),
      "/ckpt/config.json: layer_types[1] has unsupported layer type \"linear_attention\" for "
      "qwen3; accepted: full_attention (or legacy attention)");
}

TEST(ConfigTest, UnsupportedVariants) {
  EXPECT_EQ(ErrorOf(Edit(kMultimodal, "\"rope_type\": \"default\"", "\"rope_type\": \"yarn\"")),
            "/ckpt/config.json: text_config.rope_parameters.rope_type \"yarn\" is not supported; "
            "only \"default\" RoPE is implemented");
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                         "\"num_hidden_layers\": 6, \"hidden_act\": \"gelu\"")),
            "/ckpt/config.json: hidden_act \"gelu\" is not supported (only silu)");
  EXPECT_EQ(ErrorOf(Edit(kQwen3, "\"use_sliding_window\": false", "\"use_sliding_window\": true")),
            "/ckpt/config.json: use_sliding_window is true; sliding-window attention is not "
            "supported");
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                         "\"num_hidden_layers\": 6, \"attention_bias\": true")),
            "/ckpt/config.json: attention_bias is true; attention biases are not supported");
}

TEST(ConfigTest, ValidationErrors) {
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3")),
            "/ckpt/config.json: num_attention_heads=4 is not a multiple of num_key_value_heads=3");
  EXPECT_EQ(ErrorOf(Edit(kMultimodal, "\"linear_num_value_heads\": 48",
                         "\"linear_num_value_heads\": 40")),
            "/ckpt/config.json: linear_num_value_heads=40 is not a multiple of "
            "linear_num_key_heads=16");
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"num_key_value_heads\": 2",
                         "\"num_key_value_heads\": 2, \"head_dim\": 12")),
            "/ckpt/config.json: rotary dim 3 (head_dim=12 x partial_rotary_factor=0.25) must be "
            "even, positive and at most head_dim");
  EXPECT_EQ(ErrorOf(Edit(kMultimodal, "\"num_hidden_layers\": 8", "\"num_hidden_layers\": 9")),
            "/ckpt/config.json: layer_types has 8 entries, num_hidden_layers=9");
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"hidden_size\": 64", "\"hidden_size\": 0")),
            "/ckpt/config.json: hidden_size must be positive, got 0");
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                         "\"num_hidden_layers\": 6, \"full_attention_interval\": 0")),
            "/ckpt/config.json: full_attention_interval must be positive, got 0");
  EXPECT_EQ(ErrorOf(Edit(kTextMinimal, "\"num_hidden_layers\": 6",
                         "\"num_hidden_layers\": 6, \"partial_rotary_factor\": 1.5")),
            "/ckpt/config.json: partial_rotary_factor must be in (0, 1], got 1.5");
}

TEST(ConfigTest, ValidateOnStruct) {
  ModelConfig c;
  c.vocab_size = 10;
  c.hidden_size = 8;
  c.intermediate_size = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 8;
  c.layer_types = {kLin, kFull};
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
  c.SetArch(Arch::kQwen3Dense);
  EXPECT_EQ(c.Validate().message(), "layer 0 is linear_attention, which qwen3 does not have");
  c.SetArch(Arch::kQwen35Hybrid);
  c.linear_num_key_heads = 0;
  EXPECT_EQ(c.Validate().message(), "linear_num_key_heads must be positive, got 0");
}

}  // namespace
}  // namespace draftfeed
