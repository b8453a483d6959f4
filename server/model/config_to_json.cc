// ModelConfig::ToJson: the HF config.json that transformers reads back into the
// same model (the checkpoint writer's config), members in the order a person
// reads HF configs.
#include "server/model/config.h"

#include <charconv>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace draftfeed {
namespace {

std::string Quote(absl::string_view s) { return absl::StrCat("\"", s, "\""); }

// Shortest text that reads back to the same double; integral values keep a
// ".0" so Python sees a float where transformers declares one.
std::string FormatDouble(double v) {
  if (std::trunc(v) == v && std::fabs(v) < 1e15) {
    return absl::StrCat(static_cast<int64_t>(v), ".0");
  }
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, res.ptr);
}

// An object whose members keep their insertion order, as a person reads HF configs.
class JsonWriter {
 public:
  JsonWriter& Raw(absl::string_view key, std::string value) {
    members_.emplace_back(std::string(key), std::move(value));
    return *this;
  }
  JsonWriter& Str(absl::string_view key, absl::string_view v) { return Raw(key, Quote(v)); }
  JsonWriter& Int(absl::string_view key, int64_t v) { return Raw(key, absl::StrCat(v)); }
  JsonWriter& Double(absl::string_view key, double v) { return Raw(key, FormatDouble(v)); }
  JsonWriter& Bool(absl::string_view key, bool v) { return Raw(key, v ? "true" : "false"); }
  JsonWriter& Object(absl::string_view key, const JsonWriter& w, int indent) {
    return Raw(key, w.Render(indent));
  }

  std::string Render(int indent = 0) const {
    const std::string pad(static_cast<size_t>(indent) + 2, ' ');
    std::string out = "{\n";
    for (size_t i = 0; i < members_.size(); ++i) {
      absl::StrAppend(&out, pad, Quote(members_[i].first), ": ", members_[i].second,
                      i + 1 < members_.size() ? ",\n" : "\n");
    }
    absl::StrAppend(&out, std::string(static_cast<size_t>(indent), ' '), "}");
    return out;
  }

 private:
  std::vector<std::pair<std::string, std::string>> members_;
};

std::string JsonArray(const std::vector<std::string>& items) {
  return absl::StrCat("[", absl::StrJoin(items, ", "), "]");
}

}  // namespace

std::string ModelConfig::ToJson() const {
  // The Qwen3.5 family (dense or MoE): hybrid layers, text_config when multimodal.
  const bool hybrid = features.linear_attention;
  const bool moe = features.mlp != MlpKind::kDenseSwiGlu;
  // Nested one level under text_config when multimodal.
  const int dec_indent = hybrid && multimodal ? 2 : 0;
  // Class-name stems: "Qwen3_5Moe" + "ForCausalLM", "qwen3_5_moe" + "_text".
  const std::string class_stem = absl::StrCat(hybrid ? "Qwen3_5" : "Qwen3", moe ? "Moe" : "");
  const std::string type_stem(ArchName(arch));

  JsonWriter dec;
  if (!hybrid) {
    dec.Raw("architectures", JsonArray({Quote(class_stem + "ForCausalLM")}))
        .Str("model_type", type_stem);
  } else if (!multimodal) {
    dec.Raw("architectures", JsonArray({Quote(class_stem + "ForCausalLM")}))
        .Str("model_type", type_stem + "_text");
  } else {
    dec.Str("model_type", type_stem + "_text");
  }
  dec.Int("vocab_size", vocab_size).Int("hidden_size", hidden_size);
  // Qwen3_5MoeTextConfig has no intermediate_size (no dense MLP).
  if (!(moe && hybrid)) dec.Int("intermediate_size", intermediate_size);
  dec.Int("num_hidden_layers", num_layers)
      .Int("num_attention_heads", num_heads)
      .Int("num_key_value_heads", num_kv_heads)
      .Int("head_dim", head_dim)
      .Str("hidden_act", "silu")
      .Int("max_position_embeddings", 32768)
      .Double("rms_norm_eps", rms_norm_eps)
      .Bool("tie_word_embeddings", tie_word_embeddings)
      .Bool("attention_bias", false);

  JsonWriter rope;
  rope.Str("rope_type", "default").Double("rope_theta", rope_theta);
  if (hybrid) {
    rope.Double("partial_rotary_factor", partial_rotary_factor)
        .Raw("mrope_section", "[11, 11, 10]")
        .Bool("mrope_interleaved", true);
    std::vector<std::string> types;
    types.reserve(layer_types.size());
    for (LayerKind k : layer_types) {
      types.push_back(
          Quote(k == LayerKind::kFullAttention ? "full_attention" : "linear_attention"));
    }
    dec.Bool("attn_output_gate", true)
        .Int("linear_conv_kernel_dim", linear_conv_kernel)
        .Int("linear_key_head_dim", linear_key_head_dim)
        .Int("linear_value_head_dim", linear_value_head_dim)
        .Int("linear_num_key_heads", linear_num_key_heads)
        .Int("linear_num_value_heads", linear_num_value_heads)
        .Raw("layer_types", JsonArray(types));
  } else {
    // transformers' default rope init already rotates the whole head; only a
    // partial factor needs spelling out.
    if (partial_rotary_factor != 1.0) {
      rope.Double("partial_rotary_factor", partial_rotary_factor);
    }
    dec.Bool("use_sliding_window", false);
  }
  if (moe) {
    dec.Int("num_experts", num_experts)
        .Int("num_experts_per_tok", num_experts_per_tok)
        .Int("moe_intermediate_size", moe_intermediate_size);
    if (hybrid) {
      dec.Int("shared_expert_intermediate_size", shared_expert_intermediate_size);
    } else {
      std::vector<std::string> dense;
      for (int64_t l : mlp_only_layers) dense.push_back(absl::StrCat(l));
      dec.Bool("norm_topk_prob", norm_topk_prob)
          .Int("decoder_sparse_step", decoder_sparse_step)
          .Raw("mlp_only_layers", JsonArray(dense));
    }
  }
  dec.Object("rope_parameters", rope, dec_indent + 2);
  dec.Str("dtype", "bfloat16").Str("torch_dtype", "bfloat16");

  // FineGrainedFP8Config as transformers saves it, at the top level.
  JsonWriter quant;
  if (quantization.enabled) {
    std::vector<std::string> skip;
    for (const std::string& m : quantization.modules_to_not_convert) skip.push_back(Quote(m));
    quant.Str("quant_method", "fp8")
        .Str("fmt", "e4m3")
        .Str("activation_scheme", "dynamic")
        .Raw("weight_block_size", JsonArray({absl::StrCat(quantization.block_rows),
                                             absl::StrCat(quantization.block_cols)}))
        .Raw("modules_to_not_convert", JsonArray(skip));
  }

  if (!(hybrid && multimodal)) {
    if (quantization.enabled) dec.Object("quantization_config", quant, 2);
    return dec.Render() + "\n";
  }

  // No vision_config: transformers builds its default vision tower, whose
  // weights this checkpoint does not have (they load as freshly initialised).
  JsonWriter outer;
  outer.Raw("architectures", JsonArray({Quote(class_stem + "ForConditionalGeneration")}))
      .Str("model_type", type_stem)
      .Object("text_config", dec, 2)
      .Bool("tie_word_embeddings", tie_word_embeddings)
      .Str("dtype", "bfloat16")
      .Str("torch_dtype", "bfloat16");
  if (quantization.enabled) outer.Object("quantization_config", quant, 2);
  return outer.Render() + "\n";
}

}  // namespace draftfeed
