// Built-in random-weight models, so the whole system runs without a
// checkpoint. Shapes come from a table that can grow (tiny today, real-size
// shapes later); weights are drawn from a seeded mt19937_64 in the canonical
// tensor order of weight_layout.h, each by its RandomInit there (scaled so
// activations stay O(1) through every layer). Every shape also comes as
// NAME-fp8: host models are the bf16 model quantized by QuantizeModelFp8
// (fp8_quantize.h); device-random ones carry F8_E4M3 dtypes and F32 scale
// shapes and the GPU engine fills them.
#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "server/model/fp8_quantize.h"
#include "server/model/model.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

struct RandomShape {
  std::string_view name;
  Arch arch;
  int64_t vocab, hidden, intermediate, layers;
  int64_t heads, kv_heads, head_dim;
  double rope_theta, partial_rotary_factor;
  bool tie_word_embeddings;
  // Hybrid only: every full_attention_interval-th layer is full attention (as
  // transformers derives layer_types), the others Gated DeltaNet.
  int64_t full_attention_interval = 1;
  int64_t conv_kernel = 0, key_head_dim = 0, value_head_dim = 0;
  int64_t num_key_heads = 0, num_value_heads = 0;
  // MoE only (arch kQwen35Moe / kQwen3Moe).
  int64_t experts = 0, experts_per_tok = 0, moe_intermediate = 0, shared_intermediate = 0;
  int64_t mlp_only_layer = -1;  // qwen3_moe: one dense layer, so both MLP paths run
  // The -fp8 variant's expert width when moe_intermediate is not a multiple
  // of 128: stacked [gate; up] experts need whole 128-row scale blocks each.
  int64_t fp8_moe_intermediate = 0;
  // Real sizes: weights are made on the GPU (Model::weights_on_device_random).
  bool device_weights = false;
};

constexpr RandomShape kShapes[] = {
    {.name = "tiny-random",
     .arch = Arch::kQwen35Hybrid,
     .vocab = 4096,
     .hidden = 128,
     .intermediate = 256,
     .layers = 4,
     .heads = 4,
     .kv_heads = 2,
     .head_dim = 64,
     .rope_theta = 1e7,
     .partial_rotary_factor = 0.25,
     .tie_word_embeddings = false,
     .full_attention_interval = 4,
     .conv_kernel = 4,
     .key_head_dim = 32,
     .value_head_dim = 32,
     .num_key_heads = 2,
     .num_value_heads = 4},
    {.name = "tiny-random-qwen3",
     .arch = Arch::kQwen3Dense,
     .vocab = 4096,
     .hidden = 128,
     .intermediate = 256,
     .layers = 3,
     .heads = 4,
     .kv_heads = 2,
     .head_dim = 32,
     .rope_theta = 1e6,
     .partial_rotary_factor = 1.0,
     .tie_word_embeddings = true},
    // tiny-random's layers twice over (2 x (3 GDN + 1 attention)): the
    // fewest layers that layers.eagle3() picks distinct ones from (it needs 7).
    {.name = "tiny-random-8l",
     .arch = Arch::kQwen35Hybrid,
     .vocab = 4096,
     .hidden = 128,
     .intermediate = 256,
     .layers = 8,
     .heads = 4,
     .kv_heads = 2,
     .head_dim = 64,
     .rope_theta = 1e7,
     .partial_rotary_factor = 0.25,
     .tie_word_embeddings = false,
     .full_attention_interval = 4,
     .conv_kernel = 4,
     .key_head_dim = 32,
     .value_head_dim = 32,
     .num_key_heads = 2,
     .num_value_heads = 4},
    // Small shapes with the real head sizes (attention head_dim 256 / 128,
    // GDN heads 128 wide, GVA ratio 3): what the CUDA kernels are specialised
    // for, small enough for the CPU reference to check them.
    {.name = "small-random",
     .arch = Arch::kQwen35Hybrid,
     .vocab = 4096,
     .hidden = 512,
     .intermediate = 1024,
     .layers = 4,
     .heads = 4,
     .kv_heads = 2,
     .head_dim = 256,
     .rope_theta = 1e4,
     .partial_rotary_factor = 0.25,
     .tie_word_embeddings = false,
     .full_attention_interval = 2,
     .conv_kernel = 4,
     .key_head_dim = 128,
     .value_head_dim = 128,
     .num_key_heads = 1,
     .num_value_heads = 3},
    {.name = "small-random-qwen3",
     .arch = Arch::kQwen3Dense,
     .vocab = 4096,
     .hidden = 512,
     .intermediate = 1024,
     .layers = 3,
     .heads = 8,
     .kv_heads = 2,
     .head_dim = 128,
     .rope_theta = 1e4,
     .partial_rotary_factor = 1.0,
     .tie_word_embeddings = true},
    // Qwen3.6-27B as its model card gives it: 16 × (3 GDN + 1 gated attention).
    {.name = "random:qwen3.6-27b",
     .arch = Arch::kQwen35Hybrid,
     .vocab = 248320,
     .hidden = 5120,
     .intermediate = 17408,
     .layers = 64,
     .heads = 24,
     .kv_heads = 4,
     .head_dim = 256,
     .rope_theta = 1e7,
     .partial_rotary_factor = 0.25,
     .tie_word_embeddings = false,
     .full_attention_interval = 4,
     .conv_kernel = 4,
     .key_head_dim = 128,
     .value_head_dim = 128,
     .num_key_heads = 16,
     .num_value_heads = 48,
     .device_weights = true},
    // MoE variants of tiny-random and tiny-random-qwen3: 8 experts, top 2.
    {.name = "tiny-random-moe",
     .arch = Arch::kQwen35Moe,
     .vocab = 4096,
     .hidden = 128,
     .intermediate = 0,
     .layers = 4,
     .heads = 4,
     .kv_heads = 2,
     .head_dim = 64,
     .rope_theta = 1e7,
     .partial_rotary_factor = 0.25,
     .tie_word_embeddings = false,
     .full_attention_interval = 4,
     .conv_kernel = 4,
     .key_head_dim = 32,
     .value_head_dim = 32,
     .num_key_heads = 2,
     .num_value_heads = 4,
     .experts = 8,
     .experts_per_tok = 2,
     .moe_intermediate = 64,
     .shared_intermediate = 64,
     .fp8_moe_intermediate = 128},
    {.name = "tiny-random-qwen3-moe",
     .arch = Arch::kQwen3Moe,
     .vocab = 4096,
     .hidden = 128,
     .intermediate = 256,
     .layers = 3,
     .heads = 4,
     .kv_heads = 2,
     .head_dim = 32,
     .rope_theta = 1e6,
     .partial_rotary_factor = 1.0,
     .tie_word_embeddings = true,
     .experts = 8,
     .experts_per_tok = 2,
     .moe_intermediate = 64,
     .mlp_only_layer = 1,
     .fp8_moe_intermediate = 128},
    // MoE at the real head sizes and top-k widths the CUDA kernels tile for
    // (expert width 128), small enough for the CPU reference.
    {.name = "small-random-moe",
     .arch = Arch::kQwen35Moe,
     .vocab = 4096,
     .hidden = 512,
     .intermediate = 0,
     .layers = 4,
     .heads = 4,
     .kv_heads = 2,
     .head_dim = 256,
     .rope_theta = 1e4,
     .partial_rotary_factor = 0.25,
     .tie_word_embeddings = false,
     .full_attention_interval = 2,
     .conv_kernel = 4,
     .key_head_dim = 128,
     .value_head_dim = 128,
     .num_key_heads = 1,
     .num_value_heads = 3,
     .experts = 32,
     .experts_per_tok = 4,
     .moe_intermediate = 128,
     .shared_intermediate = 128},
    {.name = "small-random-qwen3-moe",
     .arch = Arch::kQwen3Moe,
     .vocab = 4096,
     .hidden = 512,
     .intermediate = 1024,
     .layers = 3,
     .heads = 8,
     .kv_heads = 2,
     .head_dim = 128,
     .rope_theta = 1e4,
     .partial_rotary_factor = 1.0,
     .tie_word_embeddings = true,
     .experts = 32,
     .experts_per_tok = 4,
     .moe_intermediate = 128,
     .mlp_only_layer = 0},
    // Qwen3.6-35B-A3B: 10 × (3 GDN + 1 gated attention), every MLP 256
    // experts top-8 plus a shared expert.
    {.name = "random:qwen3.6-35b-a3b",
     .arch = Arch::kQwen35Moe,
     .vocab = 248320,
     .hidden = 2048,
     .intermediate = 0,
     .layers = 40,
     .heads = 16,
     .kv_heads = 2,
     .head_dim = 256,
     .rope_theta = 1e7,
     .partial_rotary_factor = 0.25,
     .tie_word_embeddings = false,
     .full_attention_interval = 4,
     .conv_kernel = 4,
     .key_head_dim = 128,
     .value_head_dim = 128,
     .num_key_heads = 16,
     .num_value_heads = 32,
     .experts = 256,
     .experts_per_tok = 8,
     .moe_intermediate = 512,
     .shared_intermediate = 512,
     .device_weights = true},
    // Qwen3.5-122B-A10B, for memory planning: about 244 GB of bf16 weights,
    // two H200s (or FP8 on one); a single GPU refuses it at the weight
    // allocation.
    {.name = "random:qwen3.5-122b-a10b",
     .arch = Arch::kQwen35Moe,
     .vocab = 248320,
     .hidden = 3072,
     .intermediate = 0,
     .layers = 48,
     .heads = 32,
     .kv_heads = 2,
     .head_dim = 256,
     .rope_theta = 1e7,
     .partial_rotary_factor = 0.25,
     .tie_word_embeddings = false,
     .full_attention_interval = 4,
     .conv_kernel = 4,
     .key_head_dim = 128,
     .value_head_dim = 128,
     .num_key_heads = 16,
     .num_value_heads = 64,
     .experts = 256,
     .experts_per_tok = 8,
     .moe_intermediate = 1024,
     .shared_intermediate = 1024,
     .device_weights = true},
    // Qwen3-30B-A3B: 48 layers, every MLP 128 experts top-8, no shared expert.
    {.name = "random:qwen3-30b-a3b",
     .arch = Arch::kQwen3Moe,
     .vocab = 151936,
     .hidden = 2048,
     .intermediate = 6144,
     .layers = 48,
     .heads = 32,
     .kv_heads = 4,
     .head_dim = 128,
     .rope_theta = 1e6,
     .partial_rotary_factor = 1.0,
     .tie_word_embeddings = false,
     .experts = 128,
     .experts_per_tok = 8,
     .moe_intermediate = 768,
     .device_weights = true},
    // Qwen3-8B shape.
    {.name = "random:qwen3-8b",
     .arch = Arch::kQwen3Dense,
     .vocab = 151936,
     .hidden = 4096,
     .intermediate = 12288,
     .layers = 36,
     .heads = 32,
     .kv_heads = 8,
     .head_dim = 128,
     .rope_theta = 1e6,
     .partial_rotary_factor = 1.0,
     .tie_word_embeddings = false,
     .device_weights = true},
};

std::string ValidSpecs() {
  std::string out;
  for (const RandomShape& s : kShapes) {
    absl::StrAppend(&out, out.empty() ? "" : ", ", std::string(s.name), "[:SEED]");
  }
  absl::StrAppend(&out, " (each also as NAME-fp8[:SEED]: FP8 weights, 128x128 block scales)");
  return out;
}

ModelConfig ConfigFor(const RandomShape& s) {
  ModelConfig c;
  c.SetArch(s.arch);
  c.vocab_size = s.vocab;
  c.hidden_size = s.hidden;
  c.intermediate_size = s.intermediate;
  c.num_layers = s.layers;
  c.num_heads = s.heads;
  c.num_kv_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = s.rope_theta;
  c.partial_rotary_factor = s.partial_rotary_factor;
  c.tie_word_embeddings = s.tie_word_embeddings;
  if (c.features.linear_attention) {
    c.linear_conv_kernel = s.conv_kernel;
    c.linear_key_head_dim = s.key_head_dim;
    c.linear_value_head_dim = s.value_head_dim;
    c.linear_num_key_heads = s.num_key_heads;
    c.linear_num_value_heads = s.num_value_heads;
  }
  for (int64_t i = 0; i < s.layers; ++i) {
    const bool full = (i + 1) % s.full_attention_interval == 0;
    c.layer_types.push_back(full ? LayerKind::kFullAttention : LayerKind::kLinearAttention);
  }
  if (c.features.mlp != MlpKind::kDenseSwiGlu) {
    c.num_experts = s.experts;
    c.num_experts_per_tok = s.experts_per_tok;
    c.moe_intermediate_size = s.moe_intermediate;
    c.shared_expert_intermediate_size = s.shared_intermediate;
    c.norm_topk_prob = true;  // the released Qwen3-MoE configs set it
    if (s.mlp_only_layer >= 0) c.mlp_only_layers = {s.mlp_only_layer};
  }
  return c;
}

// Gaussian and uniform draws built on the raw mt19937_64 stream, which the
// standard fixes bit for bit; std::normal_distribution is
// implementation-defined, and the same seed must give the same model (and
// fingerprint) with every standard library.
class Sampler {
 public:
  explicit Sampler(uint64_t seed) : rng_(seed) {}
  double Uniform() { return (static_cast<double>(rng_() >> 11) + 0.5) * 0x1p-53; }  // (0, 1)
  double Normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    const double r = std::sqrt(-2.0 * std::log(Uniform()));
    const double phi = 2.0 * std::numbers::pi * Uniform();
    spare_ = r * std::sin(phi);
    has_spare_ = true;
    return r * std::cos(phi);
  }

 private:
  std::mt19937_64 rng_;
  double spare_ = 0.0;
  bool has_spare_ = false;
};

// A model of `config` (validated) with random weights: on the host from
// `seed`, or (on_device) shapes only, the GPU engine filling them (F8_E4M3
// with F32 scales for the fp8_eligible tensors when config is quantized).
std::unique_ptr<Model> MakeRandomWeights(const ModelConfig& config, uint64_t seed, std::string id,
                                         bool on_device);

constexpr absl::string_view kFp8Suffix = "-fp8";

}  // namespace

std::vector<BuiltinModel> BuiltinModels() {
  std::vector<BuiltinModel> out;
  for (const RandomShape& s : kShapes) {
    std::string what = absl::StrCat(std::string(ArchName(s.arch)), ", ", s.layers,
                                    " layers, hidden ", s.hidden, ", vocab ", s.vocab);
    if (s.experts > 0) {
      absl::StrAppend(&what, ", ", s.experts, " experts (top ", s.experts_per_tok, ")");
    }
    if (s.device_weights) absl::StrAppend(&what, ", weights made on the GPU");
    out.push_back({absl::StrCat(std::string(s.name), "[:SEED]"), std::move(what)});
  }
  out.push_back({"NAME-fp8[:SEED]",
                 "any model above with FP8 weights (e4m3, one fp32 scale per 128x128 block): "
                 "host models quantized as --quantize fp8 does (tiny MoE experts 128 wide), "
                 "random:* ones made on the GPU"});
  return out;
}

absl::StatusOr<std::unique_ptr<Model>> MakeRandomModel(const std::string& spec) {
  // Debian's Abseil has its own string_view, so strings cross into absl here.
  std::string name = spec;
  uint64_t seed = 0;
  // "random:SHAPE[:SEED]": the colon after "random" belongs to the name.
  const size_t search_from = name.rfind("random:", 0) == 0 ? 7 : 0;
  if (const size_t colon = name.find(':', search_from); colon != std::string::npos) {
    const std::string seed_text = name.substr(colon + 1);
    name = name.substr(0, colon);
    if (seed_text.empty() || seed_text[0] == '-' || seed_text[0] == '+' ||
        !absl::SimpleAtoi(seed_text, &seed)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model spec '", spec, "': seed '", seed_text,
                       "' is not a non-negative integer; built-in specs are ", ValidSpecs()));
    }
  }
  const bool fp8 = absl::EndsWith(name, kFp8Suffix);
  const std::string base_name = fp8 ? name.substr(0, name.size() - kFp8Suffix.size()) : name;
  const RandomShape* shape = nullptr;
  for (const RandomShape& s : kShapes) {
    if (s.name == base_name) shape = &s;
  }
  if (shape == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown built-in model '", spec, "'; built-in specs are ", ValidSpecs()));
  }

  ModelConfig config = ConfigFor(*shape);
  if (fp8 && shape->fp8_moe_intermediate > 0) {
    config.moe_intermediate_size = shape->fp8_moe_intermediate;
  }
  if (absl::Status st = config.Validate(); !st.ok()) {
    return absl::InternalError(
        absl::StrCat("built-in shape ", std::string(shape->name), ": ", st.message()));
  }
  const std::string id = absl::StrCat(name, ":", seed);
  if (fp8 && shape->device_weights) config.quantization = Fp8Quantization{.enabled = true};
  std::unique_ptr<Model> model = MakeRandomWeights(config, seed, id, shape->device_weights);
  if (fp8 && !shape->device_weights) {
    if (absl::Status st = QuantizeModelFp8(*model); !st.ok()) {
      return absl::InternalError(absl::StrCat("built-in model ", id, ": ", st.message()));
    }
  }
  return model;
}

absl::StatusOr<std::unique_ptr<Model>> MakeRandomModel(const ModelConfig& config, uint64_t seed) {
  if (absl::Status st = config.Validate(); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("random model config: ", st.message()));
  }
  return MakeRandomWeights(config, seed,
                           absl::StrCat("random-", std::string(ArchName(config.arch)), ":", seed),
                           /*on_device=*/false);
}

namespace {

std::unique_ptr<Model> MakeRandomWeights(const ModelConfig& config, uint64_t seed, std::string id,
                                         bool on_device) {
  auto model = std::make_unique<Model>();
  model->id = std::move(id);
  model->config = config;

  std::vector<WeightSpec> specs = DecoderWeightSpecs(config);
  if (!config.tie_word_embeddings) specs.push_back(LmHeadSpec(config));
  model->weights.layers.resize(static_cast<size_t>(config.num_layers));
  for (size_t i = 0; i < model->weights.layers.size(); ++i) {
    model->weights.layers[i].kind = config.layer_types[i];
  }
  if (on_device) {
    for (const WeightSpec& s : specs) {
      Tensor& t = WeightSlot(model->weights, s);
      t.dtype = DType::kBF16;
      t.shape = s.shape;
      if (config.quantization.enabled && s.fp8_eligible) {
        t.dtype = DType::kF8E4M3;
        t.scale_inv.dtype = DType::kF32;
        t.scale_inv.shape = Fp8ScaleShape(s.shape);
      }
    }
    model->weights_on_device_random = true;
    model->device_random_seed = seed;
    model->fingerprint = ComputeFingerprint(*model);
    return model;
  }
  int64_t total = 0;
  for (const WeightSpec& s : specs) total += s.numel();
  auto buffer = std::make_shared<std::vector<uint16_t>>(static_cast<size_t>(total));
  Sampler sampler(seed);
  int64_t offset = 0;
  for (const WeightSpec& s : specs) {
    const RandomInit& init = s.init;
    const int64_t n = s.numel();
    uint16_t* dst = buffer->data() + offset;
    const int64_t cols = s.shape.back();
    double scale = init.scale;
    for (int64_t i = 0; i < n; ++i) {
      // A row's own scale factor is drawn just before its first element.
      if (init.row_log_sigma > 0 && i % cols == 0) {
        scale = init.scale * std::exp(init.row_log_sigma * sampler.Normal());
      }
      const double v = init.dist == RandomInit::Dist::kLogUniform
                           ? std::log(init.lo + (init.hi - init.lo) * sampler.Uniform())
                           : init.offset + scale * sampler.Normal();
      dst[i] = FloatToBf16(static_cast<float>(v));
    }
    Tensor& t = WeightSlot(model->weights, s);
    t.dtype = DType::kBF16;
    t.shape = s.shape;
    t.data = reinterpret_cast<const std::byte*>(dst);
    offset += n;
  }
  if (config.tie_word_embeddings) model->weights.lm_head = model->weights.embed_tokens;
  model->storage = std::move(buffer);
  model->fingerprint = ComputeFingerprint(*model);
  return model;
}

}  // namespace
}  // namespace draftfeed
