#include "server/model/weight_layout.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace draftfeed {
namespace {

std::string Field(absl::string_view name, int64_t value) { return absl::StrCat(name, "=", value); }

// Norm weights as the convention stores them: near 0 for (1 + w), near 1 for w.
RandomInit NormInit(const ModelConfig& c) {
  return {.offset = c.features.norm == NormConvention::kOffsetOne ? 0.0 : 1.0, .scale = 0.1};
}

// Projections [out, in]: std 1/sqrt(in) keeps each output O(1).
RandomInit ProjectionInit(int64_t in) {
  return {.scale = 1.0 / std::sqrt(static_cast<double>(in))};
}

// Appends the tensors of one block; `add` names them under "layers.<i>.".
class BlockBuilder {
 public:
  BlockBuilder(BlockKind kind, int layer, std::vector<WeightSpec>& out)
      : kind_(kind), layer_(layer), out_(out) {}
  WeightSpec& Add(absl::string_view suffix, std::vector<int64_t> shape, std::string origin,
                  Tensor LayerWeights::*member, RandomInit init) {
    WeightSpec s;
    s.name = absl::StrCat("layers.", layer_, ".", suffix);
    s.shape = std::move(shape);
    s.origin = std::move(origin);
    s.layer = layer_;
    s.member = member;
    s.block = kind_;
    s.init = init;
    out_.push_back(std::move(s));
    return out_.back();
  }
  // A projection [out, in], initialised for its fan-in.
  WeightSpec& Projection(absl::string_view suffix, int64_t rows, int64_t cols, std::string origin,
                         Tensor LayerWeights::*member) {
    return Add(suffix, {rows, cols}, std::move(origin), member, ProjectionInit(cols));
  }

 private:
  BlockKind kind_;
  int layer_;
  std::vector<WeightSpec>& out_;
};

void NormsSpecs(const ModelConfig& c, BlockBuilder& b) {
  const std::string hid = Field("hidden_size", c.hidden_size);
  b.Add("input_layernorm.weight", {c.hidden_size}, hid, &LayerWeights::input_layernorm,
        NormInit(c));
  b.Add("post_attention_layernorm.weight", {c.hidden_size}, hid,
        &LayerWeights::post_attention_layernorm, NormInit(c));
}

void AttentionSpecs(const ModelConfig& c, BlockBuilder& b) {
  const int64_t d = c.hidden_size;
  const bool gated = c.features.gated_attention;
  const int64_t q_rows = c.num_heads * c.head_dim * (gated ? 2 : 1);
  const int64_t kv_rows = c.num_kv_heads * c.head_dim;
  const std::string hid = Field("hidden_size", d);
  const std::string hd = Field("head_dim", c.head_dim);
  const std::string hq = Field("num_attention_heads", c.num_heads);
  const std::string kv = absl::StrCat(Field("num_key_value_heads", c.num_kv_heads), ", ", hd);
  b.Projection("self_attn.q_proj.weight", q_rows, d,
               absl::StrCat(hq, ", ", hd, gated ? " x2 for the output gate" : "", ", ", hid),
               &LayerWeights::q_proj)
      .fp8_eligible = true;
  b.Projection("self_attn.k_proj.weight", kv_rows, d, absl::StrCat(kv, ", ", hid),
               &LayerWeights::k_proj)
      .fp8_eligible = true;
  b.Projection("self_attn.v_proj.weight", kv_rows, d, absl::StrCat(kv, ", ", hid),
               &LayerWeights::v_proj)
      .fp8_eligible = true;
  b.Projection("self_attn.o_proj.weight", d, c.num_heads * c.head_dim,
               absl::StrCat(hid, ", ", hq, ", ", hd), &LayerWeights::o_proj)
      .fp8_eligible = true;
  if (c.features.qk_norm) {
    b.Add("self_attn.q_norm.weight", {c.head_dim}, hd, &LayerWeights::q_norm, NormInit(c));
    b.Add("self_attn.k_norm.weight", {c.head_dim}, hd, &LayerWeights::k_norm, NormInit(c));
  }
}

void GatedDeltaNetSpecs(const ModelConfig& c, BlockBuilder& b) {
  const int64_t d = c.hidden_size;
  const int64_t nk = c.linear_num_key_heads, dk = c.linear_key_head_dim;
  const int64_t nv = c.linear_num_value_heads, dv = c.linear_value_head_dim;
  const int64_t conv_dim = 2 * nk * dk + nv * dv;
  const std::string hid = Field("hidden_size", d);
  const std::string value =
      absl::StrCat(Field("linear_num_value_heads", nv), ", ", Field("linear_value_head_dim", dv));
  const std::string qkv = absl::StrCat(Field("linear_num_key_heads", nk), ", ",
                                       Field("linear_key_head_dim", dk), ", ", value);
  const std::string nvf = Field("linear_num_value_heads", nv);
  b.Projection("linear_attn.in_proj_qkv.weight", conv_dim, d, absl::StrCat(qkv, ", ", hid),
               &LayerWeights::in_proj_qkv)
      .fp8_eligible = true;
  b.Projection("linear_attn.in_proj_z.weight", nv * dv, d, absl::StrCat(value, ", ", hid),
               &LayerWeights::in_proj_z)
      .fp8_eligible = true;
  b.Projection("linear_attn.in_proj_b.weight", nv, d, absl::StrCat(nvf, ", ", hid),
               &LayerWeights::in_proj_b);
  b.Projection("linear_attn.in_proj_a.weight", nv, d, absl::StrCat(nvf, ", ", hid),
               &LayerWeights::in_proj_a);
  b.Add("linear_attn.conv1d.weight", {conv_dim, 1, c.linear_conv_kernel},
        absl::StrCat(qkv, ", ", Field("linear_conv_kernel_dim", c.linear_conv_kernel)),
        &LayerWeights::conv1d, {.scale = 0.3});
  b.Add("linear_attn.A_log", {nv}, nvf, &LayerWeights::A_log,
        {.dist = RandomInit::Dist::kLogUniform, .lo = 1.0, .hi = 16.0})
      .device_f32 = true;
  b.Add("linear_attn.dt_bias", {nv}, nvf, &LayerWeights::dt_bias, {.scale = 0.1}).device_f32 = true;
  // The gated norm is multiplicative whatever the residual norms' convention.
  b.Add("linear_attn.norm.weight", {dv}, Field("linear_value_head_dim", dv), &LayerWeights::norm,
        {.offset = 1.0, .scale = 0.1});
  b.Projection("linear_attn.out_proj.weight", d, nv * dv,
               absl::StrCat(Field("hidden_size", d), ", ", value), &LayerWeights::out_proj)
      .fp8_eligible = true;
}

void DenseMlpSpecs(const ModelConfig& c, BlockBuilder& b) {
  const int64_t d = c.hidden_size, f = c.intermediate_size;
  const std::string hid = Field("hidden_size", d);
  const std::string inter = Field("intermediate_size", f);
  b.Projection("mlp.gate_proj.weight", f, d, absl::StrCat(inter, ", ", hid),
               &LayerWeights::gate_proj)
      .fp8_eligible = true;
  b.Projection("mlp.up_proj.weight", f, d, absl::StrCat(inter, ", ", hid), &LayerWeights::up_proj)
      .fp8_eligible = true;
  b.Projection("mlp.down_proj.weight", d, f, absl::StrCat(hid, ", ", inter),
               &LayerWeights::down_proj)
      .fp8_eligible = true;
}

// Experts' norm spread of the random router: trained routers without load
// balancing send a few times the mean load to their hottest expert and almost
// none to a few (Qwen/Mixtral-style routing statistics). Random iid router rows
// against near-isotropic normed states route uniformly; rows whose norms vary
// by exp(0.2 N(0,1)) give experts logits of unequal spread, so large-norm
// experts win top-k more often. At 256 experts top-8 that is a hottest expert
// at 3.4-5.1x the mean and a few under 0.1x; at 128 top-8, 2.4-3.5x
// (random_model_test checks the spread).
constexpr double kRouterRowLogSigma = 0.2;

void MoeMlpSpecs(const ModelConfig& c, BlockBuilder& b) {
  const int64_t d = c.hidden_size, e = c.num_experts, i = c.moe_intermediate_size;
  const std::string hid = Field("hidden_size", d);
  const std::string experts = Field("num_experts", e);
  const std::string inter = Field("moe_intermediate_size", i);
  RandomInit router = ProjectionInit(d);
  router.row_log_sigma = kRouterRowLogSigma;
  b.Add("mlp.gate.weight", {e, d}, absl::StrCat(experts, ", ", hid), &LayerWeights::router, router);
  WeightSpec& gate_up = b.Add("mlp.experts.gate_up_proj", {e, 2 * i, d},
                              absl::StrCat(experts, ", ", inter, " x2 (gate, up), ", hid),
                              &LayerWeights::experts_gate_up, ProjectionInit(d));
  gate_up.expert_parts = {"gate_proj", "up_proj"};
  gate_up.fp8_eligible = true;
  WeightSpec& down =
      b.Add("mlp.experts.down_proj", {e, d, i}, absl::StrCat(experts, ", ", hid, ", ", inter),
            &LayerWeights::experts_down, ProjectionInit(i));
  down.expert_parts = {"down_proj"};
  down.fp8_eligible = true;
  if (c.features.mlp != MlpKind::kMoeSharedExpert) return;
  const int64_t s = c.shared_expert_intermediate_size;
  const std::string shared = Field("shared_expert_intermediate_size", s);
  b.Projection("mlp.shared_expert.gate_proj.weight", s, d, absl::StrCat(shared, ", ", hid),
               &LayerWeights::shared_gate_proj)
      .fp8_eligible = true;
  b.Projection("mlp.shared_expert.up_proj.weight", s, d, absl::StrCat(shared, ", ", hid),
               &LayerWeights::shared_up_proj)
      .fp8_eligible = true;
  b.Projection("mlp.shared_expert.down_proj.weight", d, s, absl::StrCat(hid, ", ", shared),
               &LayerWeights::shared_down_proj)
      .fp8_eligible = true;
  b.Projection("mlp.shared_expert_gate.weight", 1, d, hid, &LayerWeights::shared_expert_gate);
}

}  // namespace

int64_t WeightSpec::numel() const {
  int64_t n = 1;
  for (int64_t dim : shape) n *= dim;
  return n;
}

LayerBlocks BlocksOfLayer(const ModelConfig& c, int64_t layer) {
  LayerBlocks b;
  b.mixer = c.layer_types[static_cast<size_t>(layer)] == LayerKind::kFullAttention
                ? BlockKind::kAttention
                : BlockKind::kGatedDeltaNet;
  switch (c.MlpOfLayer(layer)) {
    case MlpKind::kDenseSwiGlu:
      b.mlp = BlockKind::kDenseMlp;
      break;
    case MlpKind::kMoe:
    case MlpKind::kMoeSharedExpert:
      b.mlp = BlockKind::kMoeMlp;
      break;
  }
  return b;
}

std::vector<WeightSpec> BlockSpecs(const ModelConfig& c, BlockKind kind, int layer) {
  std::vector<WeightSpec> specs;
  BlockBuilder b(kind, layer, specs);
  switch (kind) {
    case BlockKind::kNorms:
      NormsSpecs(c, b);
      break;
    case BlockKind::kAttention:
      AttentionSpecs(c, b);
      break;
    case BlockKind::kGatedDeltaNet:
      GatedDeltaNetSpecs(c, b);
      break;
    case BlockKind::kDenseMlp:
      DenseMlpSpecs(c, b);
      break;
    case BlockKind::kMoeMlp:
      MoeMlpSpecs(c, b);
      break;
  }
  return specs;
}

const std::vector<DeviceBuffer>& BlockDeviceBuffers(BlockKind kind) {
  using W = LayerWeights;
  // In the order of each block's buffer enum in weight_layout.h.
  static const std::vector<DeviceBuffer> kNorms = {{&W::input_layernorm},
                                                   {&W::post_attention_layernorm}};
  static const std::vector<DeviceBuffer> kAttention = {
      {&W::q_proj, &W::k_proj, &W::v_proj}, {&W::o_proj}, {&W::q_norm}, {&W::k_norm}};
  // [in_proj_qkv; in_proj_b; in_proj_a]: one GEMM gives the conv input and
  // both gate logits.
  static const std::vector<DeviceBuffer> kGdn = {{&W::in_proj_qkv, &W::in_proj_b, &W::in_proj_a},
                                                 {&W::in_proj_z},
                                                 {&W::conv1d},
                                                 {&W::A_log},
                                                 {&W::dt_bias},
                                                 {&W::norm},
                                                 {&W::out_proj}};
  static const std::vector<DeviceBuffer> kDenseMlp = {{&W::gate_proj, &W::up_proj},
                                                      {&W::down_proj}};
  static const std::vector<DeviceBuffer> kMoeMlp = {
      {&W::router},           {&W::experts_gate_up},
      {&W::experts_down},     {&W::shared_gate_proj, &W::shared_up_proj},
      {&W::shared_down_proj}, {&W::shared_expert_gate}};
  switch (kind) {
    case BlockKind::kNorms:
      return kNorms;
    case BlockKind::kAttention:
      return kAttention;
    case BlockKind::kGatedDeltaNet:
      return kGdn;
    case BlockKind::kDenseMlp:
      return kDenseMlp;
    case BlockKind::kMoeMlp:
      return kMoeMlp;
  }
  std::abort();  // every BlockKind has an entry above
}

std::vector<WeightSpec> DecoderWeightSpecs(const ModelConfig& c) {
  const int64_t d = c.hidden_size;
  const std::string hid = Field("hidden_size", d);
  std::vector<WeightSpec> specs;
  auto global = [&](std::string name, std::vector<int64_t> shape, std::string origin,
                    Tensor ModelWeights::*slot, RandomInit init) {
    WeightSpec s;
    s.name = std::move(name);
    s.shape = std::move(shape);
    s.origin = std::move(origin);
    s.global = slot;
    s.init = init;
    specs.push_back(std::move(s));
  };

  global("embed_tokens.weight", {c.vocab_size, d},
         absl::StrCat(Field("vocab_size", c.vocab_size), ", ", hid), &ModelWeights::embed_tokens,
         {.scale = 1.0});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const int layer = static_cast<int>(i);
    const LayerBlocks blocks = BlocksOfLayer(c, i);
    for (BlockKind kind : {BlockKind::kNorms, blocks.mixer, blocks.mlp}) {
      std::vector<WeightSpec> block = BlockSpecs(c, kind, layer);
      specs.insert(specs.end(), std::make_move_iterator(block.begin()),
                   std::make_move_iterator(block.end()));
    }
  }
  global("norm.weight", {d}, hid, &ModelWeights::norm, NormInit(c));
  return specs;
}

WeightSpec LmHeadSpec(const ModelConfig& c) {
  WeightSpec s;
  s.name = "lm_head.weight";
  s.shape = {c.vocab_size, c.hidden_size};
  s.origin =
      absl::StrCat(Field("vocab_size", c.vocab_size), ", ", Field("hidden_size", c.hidden_size));
  s.global = &ModelWeights::lm_head;
  s.init = ProjectionInit(c.hidden_size);
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
