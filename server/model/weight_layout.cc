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

// Tensor-parallel cuts (TensorParallelCut), named for what they cut.
TensorParallelCut Replicated() { return {.kind = TpCut::kReplicated}; }
TensorParallelCut ColumnParallel(std::string note = "") {
  return {.kind = TpCut::kColumn, .note = std::move(note)};
}
// Rows of `heads` heads that ranks beyond their count share.
TensorParallelCut SharedHeadColumns(int64_t rows, int64_t heads, std::string head) {
  return {.kind = TpCut::kColumn, .segments = {{rows, heads}}, .shared_head = std::move(head)};
}
TensorParallelCut RowParallel() { return {.kind = TpCut::kRow}; }

// Appends the tensors of one block; `add` names them under "layers.<i>.".
class BlockBuilder {
 public:
  BlockBuilder(BlockKind kind, int layer, std::vector<WeightSpec>& out)
      : kind_(kind), layer_(layer), out_(out) {}
  WeightSpec& Add(absl::string_view suffix, std::vector<int64_t> shape, std::string origin,
                  Tensor LayerWeights::*member, RandomInit init, TensorParallelCut cut) {
    WeightSpec s;
    s.name = absl::StrCat("layers.", layer_, ".", suffix);
    s.shape = std::move(shape);
    s.origin = std::move(origin);
    s.layer = layer_;
    s.member = member;
    s.block = kind_;
    s.init = init;
    s.tp_cut = std::move(cut);
    out_.push_back(std::move(s));
    return out_.back();
  }
  // A projection [out, in], initialised for its fan-in.
  WeightSpec& Projection(absl::string_view suffix, int64_t rows, int64_t cols, std::string origin,
                         Tensor LayerWeights::*member, TensorParallelCut cut) {
    return Add(suffix, {rows, cols}, std::move(origin), member, ProjectionInit(cols),
               std::move(cut));
  }

 private:
  BlockKind kind_;
  int layer_;
  std::vector<WeightSpec>& out_;
};

void NormsSpecs(const ModelConfig& c, BlockBuilder& b) {
  const std::string hid = Field("hidden_size", c.hidden_size);
  // Every rank normalises the whole replicated residual stream.
  b.Add("input_layernorm.weight", {c.hidden_size}, hid, &LayerWeights::input_layernorm,
        NormInit(c), Replicated());
  b.Add("post_attention_layernorm.weight", {c.hidden_size}, hid,
        &LayerWeights::post_attention_layernorm, NormInit(c), Replicated());
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
  // The output gate interleaves per head ([q_h; gate_h] blocks of 2*head_dim
  // rows), so a head range is still one row range.
  b.Projection("self_attn.q_proj.weight", q_rows, d,
               absl::StrCat(hq, ", ", hd, gated ? " x2 for the output gate" : "", ", ", hid),
               &LayerWeights::q_proj, ColumnParallel(gated ? "per-head [q; gate] blocks" : ""))
      .fp8_eligible = true;
  // Query head h reads KV head h / (Hq/Hkv): with more ranks than KV heads, a
  // rank's query heads all read one KV head, which those ranks share.
  b.Projection("self_attn.k_proj.weight", kv_rows, d, absl::StrCat(kv, ", ", hid),
               &LayerWeights::k_proj, SharedHeadColumns(kv_rows, c.num_kv_heads, "KV head"))
      .fp8_eligible = true;
  b.Projection("self_attn.v_proj.weight", kv_rows, d, absl::StrCat(kv, ", ", hid),
               &LayerWeights::v_proj, SharedHeadColumns(kv_rows, c.num_kv_heads, "KV head"))
      .fp8_eligible = true;
  b.Projection("self_attn.o_proj.weight", d, c.num_heads * c.head_dim,
               absl::StrCat(hid, ", ", hq, ", ", hd), &LayerWeights::o_proj, RowParallel())
      .fp8_eligible = true;
  if (c.features.qk_norm) {  // per head, the same for every head: read whole
    b.Add("self_attn.q_norm.weight", {c.head_dim}, hd, &LayerWeights::q_norm, NormInit(c),
          Replicated());
    b.Add("self_attn.k_norm.weight", {c.head_dim}, hd, &LayerWeights::k_norm, NormInit(c),
          Replicated());
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
  // The fused q | k | v channels (in_proj_qkv rows, conv1d channels): each
  // part cut by heads, so a rank's conv channels are its heads' own (value
  // head j reads key head j / (Nv/Nk), shared as KV heads are).
  const TensorParallelCut qkv_cut = {.kind = TpCut::kSegmented,
                                     .segments = {{nk * dk, nk}, {nk * dk, nk}, {nv * dv, 0}},
                                     .note = "q | k | v by heads",
                                     .shared_head = "key head"};
  b.Projection("linear_attn.in_proj_qkv.weight", conv_dim, d, absl::StrCat(qkv, ", ", hid),
               &LayerWeights::in_proj_qkv, qkv_cut)
      .fp8_eligible = true;
  // z, the gates and their parameters: one row per value head (channel).
  b.Projection("linear_attn.in_proj_z.weight", nv * dv, d, absl::StrCat(value, ", ", hid),
               &LayerWeights::in_proj_z, ColumnParallel())
      .fp8_eligible = true;
  b.Projection("linear_attn.in_proj_b.weight", nv, d, absl::StrCat(nvf, ", ", hid),
               &LayerWeights::in_proj_b, ColumnParallel());
  b.Projection("linear_attn.in_proj_a.weight", nv, d, absl::StrCat(nvf, ", ", hid),
               &LayerWeights::in_proj_a, ColumnParallel());
  b.Add("linear_attn.conv1d.weight", {conv_dim, 1, c.linear_conv_kernel},
        absl::StrCat(qkv, ", ", Field("linear_conv_kernel_dim", c.linear_conv_kernel)),
        &LayerWeights::conv1d, {.scale = 0.3}, qkv_cut);
  b.Add("linear_attn.A_log", {nv}, nvf, &LayerWeights::A_log,
        {.dist = RandomInit::Dist::kLogUniform, .lo = 1.0, .hi = 16.0}, ColumnParallel())
      .device_f32 = true;
  b.Add("linear_attn.dt_bias", {nv}, nvf, &LayerWeights::dt_bias, {.scale = 0.1},
        ColumnParallel())
      .device_f32 = true;
  // The gated norm is multiplicative whatever the residual norms' convention;
  // per value head, the same for every head: read whole.
  b.Add("linear_attn.norm.weight", {dv}, Field("linear_value_head_dim", dv), &LayerWeights::norm,
        {.offset = 1.0, .scale = 0.1}, Replicated());
  b.Projection("linear_attn.out_proj.weight", d, nv * dv,
               absl::StrCat(Field("hidden_size", d), ", ", value), &LayerWeights::out_proj,
               RowParallel())
      .fp8_eligible = true;
}

void DenseMlpSpecs(const ModelConfig& c, BlockBuilder& b) {
  const int64_t d = c.hidden_size, f = c.intermediate_size;
  const std::string hid = Field("hidden_size", d);
  const std::string inter = Field("intermediate_size", f);
  b.Projection("mlp.gate_proj.weight", f, d, absl::StrCat(inter, ", ", hid),
               &LayerWeights::gate_proj, ColumnParallel())
      .fp8_eligible = true;
  b.Projection("mlp.up_proj.weight", f, d, absl::StrCat(inter, ", ", hid), &LayerWeights::up_proj,
               ColumnParallel())
      .fp8_eligible = true;
  b.Projection("mlp.down_proj.weight", d, f, absl::StrCat(hid, ", ", inter),
               &LayerWeights::down_proj, RowParallel())
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
  // Every rank scores all experts (and, with the shared expert's gate, reads
  // the small router whole).
  b.Add("mlp.gate.weight", {e, d}, absl::StrCat(experts, ", ", hid), &LayerWeights::router, router,
        Replicated());
  // Split: per expert [gate; up] rows, each cut alone; down's columns to match.
  WeightSpec& gate_up = b.Add("mlp.experts.gate_up_proj", {e, 2 * i, d},
                              absl::StrCat(experts, ", ", inter, " x2 (gate, up), ", hid),
                              &LayerWeights::experts_gate_up, ProjectionInit(d),
                              {.kind = TpCut::kExpert,
                               .per_expert = TpCut::kSegmented,
                               .segments = {{i, 0}, {i, 0}},
                               .note = "gate | up"});
  gate_up.expert_parts = {"gate_proj", "up_proj"};
  gate_up.fp8_eligible = true;
  WeightSpec& down = b.Add(
      "mlp.experts.down_proj", {e, d, i}, absl::StrCat(experts, ", ", hid, ", ", inter),
      &LayerWeights::experts_down, ProjectionInit(i),
      {.kind = TpCut::kExpert, .per_expert = TpCut::kRow});
  down.expert_parts = {"down_proj"};
  down.fp8_eligible = true;
  if (c.features.mlp != MlpKind::kMoeSharedExpert) return;
  const int64_t s = c.shared_expert_intermediate_size;
  const std::string shared = Field("shared_expert_intermediate_size", s);
  b.Projection("mlp.shared_expert.gate_proj.weight", s, d, absl::StrCat(shared, ", ", hid),
               &LayerWeights::shared_gate_proj, ColumnParallel())
      .fp8_eligible = true;
  b.Projection("mlp.shared_expert.up_proj.weight", s, d, absl::StrCat(shared, ", ", hid),
               &LayerWeights::shared_up_proj, ColumnParallel())
      .fp8_eligible = true;
  b.Projection("mlp.shared_expert.down_proj.weight", d, s, absl::StrCat(hid, ", ", shared),
               &LayerWeights::shared_down_proj, RowParallel())
      .fp8_eligible = true;
  // One row: every rank gates its partial shared output by the whole logit.
  b.Projection("mlp.shared_expert_gate.weight", 1, d, hid, &LayerWeights::shared_expert_gate,
               Replicated());
}

}  // namespace

const char* TpCutName(TpCut cut) {
  switch (cut) {
    case TpCut::kUndeclared:
      return "undeclared";
    case TpCut::kReplicated:
      return "replicated";
    case TpCut::kColumn:
      return "column";
    case TpCut::kRow:
      return "row";
    case TpCut::kSegmented:
      return "segmented";
    case TpCut::kExpert:
      return "expert";
  }
  return "unknown";
}

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
    // The embedding and the final norm act on the replicated residual stream.
    s.tp_cut = Replicated();
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
  // Only the capture rank reads it, whole: the vocabulary is not cut yet.
  s.tp_cut = Replicated();
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
