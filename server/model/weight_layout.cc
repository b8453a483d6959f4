#include "server/model/weight_layout.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace draftfeed {
namespace {

std::string Field(absl::string_view name, int64_t value) { return absl::StrCat(name, "=", value); }

}  // namespace

std::vector<WeightSpec> DecoderWeightSpecs(const ModelConfig& c) {
  const bool hybrid = c.arch == Arch::kQwen35Hybrid;
  const int64_t d = c.hidden_size;
  const std::string hid = Field("hidden_size", d);
  const std::string inter = Field("intermediate_size", c.intermediate_size);
  const std::string hd = Field("head_dim", c.head_dim);

  std::vector<WeightSpec> specs;
  auto global = [&](std::string name, std::vector<int64_t> shape, std::string origin,
                    Tensor ModelWeights::*slot) {
    WeightSpec s;
    s.name = std::move(name);
    s.shape = std::move(shape);
    s.origin = std::move(origin);
    s.global = slot;
    specs.push_back(std::move(s));
  };

  global("embed_tokens.weight", {c.vocab_size, d},
         absl::StrCat(Field("vocab_size", c.vocab_size), ", ", hid), &ModelWeights::embed_tokens);

  for (int64_t i = 0; i < c.num_layers; ++i) {
    const int layer = static_cast<int>(i);
    auto add = [&](absl::string_view suffix, std::vector<int64_t> shape, std::string origin,
                   Tensor LayerWeights::*slot) {
      WeightSpec s;
      s.name = absl::StrCat("layers.", i, ".", suffix);
      s.shape = std::move(shape);
      s.origin = std::move(origin);
      s.layer = layer;
      s.member = slot;
      specs.push_back(std::move(s));
    };
    add("input_layernorm.weight", {d}, hid, &LayerWeights::input_layernorm);
    add("post_attention_layernorm.weight", {d}, hid, &LayerWeights::post_attention_layernorm);
    if (c.layer_types[static_cast<size_t>(i)] == LayerKind::kFullAttention) {
      const int64_t q_rows = c.num_heads * c.head_dim * (hybrid ? 2 : 1);
      const int64_t kv_rows = c.num_kv_heads * c.head_dim;
      const std::string hq = Field("num_attention_heads", c.num_heads);
      const std::string kv = absl::StrCat(Field("num_key_value_heads", c.num_kv_heads), ", ", hd);
      add("self_attn.q_proj.weight", {q_rows, d},
          absl::StrCat(hq, ", ", hd, hybrid ? " x2 for the output gate" : "", ", ", hid),
          &LayerWeights::q_proj);
      add("self_attn.k_proj.weight", {kv_rows, d}, absl::StrCat(kv, ", ", hid),
          &LayerWeights::k_proj);
      add("self_attn.v_proj.weight", {kv_rows, d}, absl::StrCat(kv, ", ", hid),
          &LayerWeights::v_proj);
      add("self_attn.o_proj.weight", {d, c.num_heads * c.head_dim},
          absl::StrCat(hid, ", ", hq, ", ", hd), &LayerWeights::o_proj);
      add("self_attn.q_norm.weight", {c.head_dim}, hd, &LayerWeights::q_norm);
      add("self_attn.k_norm.weight", {c.head_dim}, hd, &LayerWeights::k_norm);
    } else {
      const int64_t nk = c.linear_num_key_heads, dk = c.linear_key_head_dim;
      const int64_t nv = c.linear_num_value_heads, dv = c.linear_value_head_dim;
      const int64_t conv_dim = 2 * nk * dk + nv * dv;
      const std::string value = absl::StrCat(Field("linear_num_value_heads", nv), ", ",
                                             Field("linear_value_head_dim", dv));
      const std::string qkv = absl::StrCat(Field("linear_num_key_heads", nk), ", ",
                                           Field("linear_key_head_dim", dk), ", ", value);
      const std::string nvf = Field("linear_num_value_heads", nv);
      add("linear_attn.in_proj_qkv.weight", {conv_dim, d}, absl::StrCat(qkv, ", ", hid),
          &LayerWeights::in_proj_qkv);
      add("linear_attn.in_proj_z.weight", {nv * dv, d}, absl::StrCat(value, ", ", hid),
          &LayerWeights::in_proj_z);
      add("linear_attn.in_proj_b.weight", {nv, d}, absl::StrCat(nvf, ", ", hid),
          &LayerWeights::in_proj_b);
      add("linear_attn.in_proj_a.weight", {nv, d}, absl::StrCat(nvf, ", ", hid),
          &LayerWeights::in_proj_a);
      add("linear_attn.conv1d.weight", {conv_dim, 1, c.linear_conv_kernel},
          absl::StrCat(qkv, ", ", Field("linear_conv_kernel_dim", c.linear_conv_kernel)),
          &LayerWeights::conv1d);
      add("linear_attn.A_log", {nv}, nvf, &LayerWeights::A_log);
      add("linear_attn.dt_bias", {nv}, nvf, &LayerWeights::dt_bias);
      add("linear_attn.norm.weight", {dv}, Field("linear_value_head_dim", dv), &LayerWeights::norm);
      add("linear_attn.out_proj.weight", {d, nv * dv}, absl::StrCat(hid, ", ", value),
          &LayerWeights::out_proj);
    }
    add("mlp.gate_proj.weight", {c.intermediate_size, d}, absl::StrCat(inter, ", ", hid),
        &LayerWeights::gate_proj);
    add("mlp.up_proj.weight", {c.intermediate_size, d}, absl::StrCat(inter, ", ", hid),
        &LayerWeights::up_proj);
    add("mlp.down_proj.weight", {d, c.intermediate_size}, absl::StrCat(hid, ", ", inter),
        &LayerWeights::down_proj);
  }

  global("norm.weight", {d}, hid, &ModelWeights::norm);
  return specs;
}

WeightSpec LmHeadSpec(const ModelConfig& c) {
  WeightSpec s;
  s.name = "lm_head.weight";
  s.shape = {c.vocab_size, c.hidden_size};
  s.origin =
      absl::StrCat(Field("vocab_size", c.vocab_size), ", ", Field("hidden_size", c.hidden_size));
  s.global = &ModelWeights::lm_head;
  return s;
}

Tensor& WeightSlot(ModelWeights& weights, const WeightSpec& spec) {
  if (spec.layer < 0) return weights.*(spec.global);
  return weights.layers[static_cast<size_t>(spec.layer)].*(spec.member);
}

const Tensor& WeightSlot(const ModelWeights& weights, const WeightSpec& spec) {
  if (spec.layer < 0) return weights.*(spec.global);
  return weights.layers[static_cast<size_t>(spec.layer)].*(spec.member);
}

}  // namespace draftfeed
