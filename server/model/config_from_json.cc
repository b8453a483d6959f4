// ModelConfig::FromJson: an HF config.json (either dialect: the multimodal
// Qwen3_5ForConditionalGeneration with the decoder under text_config, or a
// CausalLM with it at the top) read into a ModelConfig, with the defaults
// transformers applies to absent keys, then validated.
#include "server/model/config.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace draftfeed {
namespace {

using google::protobuf::ListValue;
using google::protobuf::Struct;
using google::protobuf::Value;

constexpr absl::string_view kSupportedModelTypes =
    "qwen3_5, qwen3_5_text, qwen3, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe";
constexpr absl::string_view kSupportedArchitectures =
    "Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM, Qwen3ForCausalLM, "
    "Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM";

// Largest integer a JSON number (an IEEE double here) holds exactly.
constexpr double kMaxExactInt = 9007199254740992.0;

absl::string_view KindName(Value::KindCase kind) {
  switch (kind) {
    case Value::kNullValue:
      return "null";
    case Value::kNumberValue:
      return "number";
    case Value::kStringValue:
      return "string";
    case Value::kBoolValue:
      return "boolean";
    case Value::kStructValue:
      return "object";
    case Value::kListValue:
      return "array";
    case Value::KIND_NOT_SET:
      break;
  }
  return "nothing";
}

// Typed, optional access to the keys of one JSON object. A key whose value is
// null counts as absent, as transformers treats it. Errors name the file and
// the dotted path of the key.
class JsonObject {
 public:
  JsonObject(const Struct& obj, absl::string_view source, std::string path_prefix)
      : obj_(obj), source_(source), prefix_(std::move(path_prefix)) {}

  std::string Path(absl::string_view key) const { return absl::StrCat(prefix_, key); }

  const Value* Find(absl::string_view key) const {
    auto it = obj_.fields().find(std::string(key));
    if (it == obj_.fields().end() || it->second.kind_case() == Value::kNullValue) return nullptr;
    return &it->second;
  }

  absl::Status WrongType(absl::string_view key, absl::string_view want, const Value& v) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": field ", Path(key), " must be ",
                                                   want, ", got ", KindName(v.kind_case())));
  }
  absl::Status Missing(absl::string_view key) const {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, ": missing required field ", Path(key)));
  }

  absl::StatusOr<std::optional<double>> Number(absl::string_view key) const {
    const Value* v = Find(key);
    if (v == nullptr) return std::nullopt;
    if (v->kind_case() != Value::kNumberValue) return WrongType(key, "a number", *v);
    return v->number_value();
  }

  absl::StatusOr<std::optional<int64_t>> Int(absl::string_view key) const {
    const Value* v = Find(key);
    if (v == nullptr) return std::nullopt;
    if (v->kind_case() != Value::kNumberValue) return WrongType(key, "an integer", *v);
    const double d = v->number_value();
    if (!std::isfinite(d) || std::trunc(d) != d || std::fabs(d) > kMaxExactInt) {
      return absl::InvalidArgumentError(
          absl::StrCat(source_, ": field ", Path(key), " must be an integer, got ", d));
    }
    return static_cast<int64_t>(d);
  }

  absl::StatusOr<int64_t> RequiredInt(absl::string_view key) const {
    DF_ASSIGN_OR_RETURN(std::optional<int64_t> v, Int(key));
    if (!v.has_value()) return Missing(key);
    return *v;
  }

  absl::StatusOr<std::optional<bool>> Bool(absl::string_view key) const {
    const Value* v = Find(key);
    if (v == nullptr) return std::nullopt;
    if (v->kind_case() != Value::kBoolValue) return WrongType(key, "a boolean", *v);
    return v->bool_value();
  }

  absl::StatusOr<std::optional<std::string>> String(absl::string_view key) const {
    const Value* v = Find(key);
    if (v == nullptr) return std::nullopt;
    if (v->kind_case() != Value::kStringValue) return WrongType(key, "a string", *v);
    return v->string_value();
  }

  // nullptr when absent.
  absl::StatusOr<const Struct*> Object(absl::string_view key) const {
    const Value* v = Find(key);
    if (v == nullptr) return nullptr;
    if (v->kind_case() != Value::kStructValue) return WrongType(key, "an object", *v);
    return &v->struct_value();
  }

  // nullptr when absent.
  absl::StatusOr<const ListValue*> List(absl::string_view key) const {
    const Value* v = Find(key);
    if (v == nullptr) return nullptr;
    if (v->kind_case() != Value::kListValue) return WrongType(key, "an array", *v);
    return &v->list_value();
  }

  // Strings of an array of strings; nullopt when absent.
  absl::StatusOr<std::optional<std::vector<std::string>>> StringList(absl::string_view key) const {
    DF_ASSIGN_OR_RETURN(const ListValue* list, List(key));
    if (list == nullptr) return std::nullopt;
    std::vector<std::string> out;
    for (int i = 0; i < list->values_size(); ++i) {
      const Value& e = list->values(i);
      if (e.kind_case() != Value::kStringValue) {
        return WrongType(absl::StrCat(key, "[", i, "]"), "a string", e);
      }
      out.push_back(e.string_value());
    }
    return out;
  }

  const std::string& prefix() const { return prefix_; }

 private:
  const Struct& obj_;
  absl::string_view source_;
  std::string prefix_;
};

struct ArchInfo {
  absl::string_view architecture;
  absl::string_view model_type;
  Arch arch;
};
constexpr ArchInfo kArchitectures[] = {
    {"Qwen3_5ForConditionalGeneration", "qwen3_5", Arch::kQwen35Hybrid},
    {"Qwen3_5ForCausalLM", "qwen3_5_text", Arch::kQwen35Hybrid},
    {"Qwen3ForCausalLM", "qwen3", Arch::kQwen3Dense},
    {"Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", Arch::kQwen35Moe},
    {"Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", Arch::kQwen35Moe},
    {"Qwen3MoeForCausalLM", "qwen3_moe", Arch::kQwen3Moe},
};

// The Qwen3.5 family (dense or MoE) shares its config dialect and defaults.
bool IsQwen35(Arch arch) { return FeaturesOf(arch).linear_attention; }

std::optional<Arch> ArchOfModelType(absl::string_view model_type) {
  for (const ArchInfo& a : kArchitectures) {
    if (a.model_type == model_type) return a.arch;
  }
  return std::nullopt;
}

const ArchInfo* FindArchitecture(absl::string_view architecture) {
  for (const ArchInfo& a : kArchitectures) {
    if (a.architecture == architecture) return &a;
  }
  return nullptr;
}

absl::StatusOr<LayerKind> ParseLayerType(const std::string& name, Arch arch,
                                         absl::string_view source, absl::string_view path) {
  // "attention" and "mamba" are transformers' legacy spellings.
  if (name == "full_attention" || name == "attention") return LayerKind::kFullAttention;
  if (FeaturesOf(arch).linear_attention && (name == "linear_attention" || name == "mamba")) {
    return LayerKind::kLinearAttention;
  }
  const absl::string_view accepted = FeaturesOf(arch).linear_attention
                                         ? "full_attention, linear_attention (or legacy "
                                           "attention, mamba)"
                                         : "full_attention (or legacy attention)";
  return absl::InvalidArgumentError(
      absl::StrCat(source, ": ", path, " has unsupported layer type \"", name, "\" for ",
                   std::string(ArchName(arch)), "; accepted: ", accepted));
}

// RoPE: theta and the rotated fraction, looked up in rope_parameters, then the
// legacy rope_scaling, then the decoder object itself; the default applies only
// when all three lack the key.
absl::Status ParseRope(const JsonObject& dec, Arch arch, absl::string_view source,
                       ModelConfig& cfg) {
  DF_ASSIGN_OR_RETURN(const Struct* params, dec.Object("rope_parameters"));
  DF_ASSIGN_OR_RETURN(const Struct* scaling, dec.Object("rope_scaling"));
  std::vector<JsonObject> sources;
  if (params != nullptr) sources.emplace_back(*params, source, dec.Path("rope_parameters."));
  if (scaling != nullptr) sources.emplace_back(*scaling, source, dec.Path("rope_scaling."));

  if (!sources.empty()) {
    // Only plain RoPE is implemented; "mrope" is the Qwen2-VL spelling of the
    // same thing for text-only positions.
    const JsonObject& first = sources.front();
    DF_ASSIGN_OR_RETURN(std::optional<std::string> type, first.String("rope_type"));
    if (!type.has_value()) {
      DF_ASSIGN_OR_RETURN(type, first.String("type"));
    }
    if (type.has_value() && *type != "default" && *type != "mrope") {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": ", first.Path("rope_type"), " \"", *type,
                       "\" is not supported; only \"default\" RoPE is implemented"));
    }
  }
  sources.push_back(dec);

  // A key given in more than one place must agree: transformers' config classes
  // and serving stacks resolve such conflicts differently, so picking one would
  // serve states of a model other than the one some tool reads.
  auto lookup = [&](absl::string_view key) -> absl::StatusOr<std::optional<double>> {
    std::optional<double> found;
    const JsonObject* found_in = nullptr;
    for (const JsonObject& obj : sources) {
      DF_ASSIGN_OR_RETURN(std::optional<double> v, obj.Number(key));
      if (!v.has_value()) continue;
      if (!found.has_value()) {
        found = v;
        found_in = &obj;
      } else if (*v != *found) {
        return absl::InvalidArgumentError(absl::StrCat(source, ": ", found_in->Path(key), " = ",
                                                       *found, " and ", obj.Path(key), " = ", *v,
                                                       " disagree; give one value"));
      }
    }
    return found;
  };
  DF_ASSIGN_OR_RETURN(std::optional<double> theta, lookup("rope_theta"));
  DF_ASSIGN_OR_RETURN(std::optional<double> factor, lookup("partial_rotary_factor"));
  const bool hybrid = IsQwen35(arch);
  cfg.rope_theta = theta.value_or(hybrid ? 1e7 : 1e6);
  cfg.partial_rotary_factor = factor.value_or(hybrid ? 0.25 : 1.0);
  return absl::OkStatus();
}

// The MoE fields, with transformers' defaults: Qwen3_5MoeTextConfig's (256
// experts, top 8, widths 512; every layer MoE and renormalised, so it has no
// norm_topk_prob, decoder_sparse_step or mlp_only_layers and such keys are
// ignored) or Qwen3MoeConfig's (128, top 8, width 768, norm_topk_prob false).
absl::Status ParseMoe(const JsonObject& dec, Arch arch, absl::string_view source,
                      ModelConfig& cfg) {
  const bool qwen35 = IsQwen35(arch);
  DF_ASSIGN_OR_RETURN(std::optional<int64_t> experts, dec.Int("num_experts"));
  if (!experts.has_value() && !qwen35) {
    // Qwen3MoeConfig maps num_experts to num_local_experts, the key it saves.
    DF_ASSIGN_OR_RETURN(experts, dec.Int("num_local_experts"));
  }
  cfg.num_experts = experts.value_or(qwen35 ? 256 : 128);
  DF_ASSIGN_OR_RETURN(std::optional<int64_t> k, dec.Int("num_experts_per_tok"));
  cfg.num_experts_per_tok = k.value_or(8);
  DF_ASSIGN_OR_RETURN(std::optional<int64_t> inter, dec.Int("moe_intermediate_size"));
  cfg.moe_intermediate_size = inter.value_or(qwen35 ? 512 : 768);
  if (qwen35) {
    DF_ASSIGN_OR_RETURN(std::optional<int64_t> shared, dec.Int("shared_expert_intermediate_size"));
    cfg.shared_expert_intermediate_size = shared.value_or(512);
    cfg.norm_topk_prob = true;
    cfg.decoder_sparse_step = 1;
    cfg.mlp_only_layers.clear();
    return absl::OkStatus();
  }
  DF_ASSIGN_OR_RETURN(std::optional<bool> norm, dec.Bool("norm_topk_prob"));
  cfg.norm_topk_prob = norm.value_or(false);
  DF_ASSIGN_OR_RETURN(std::optional<int64_t> step, dec.Int("decoder_sparse_step"));
  cfg.decoder_sparse_step = step.value_or(1);
  DF_ASSIGN_OR_RETURN(const ListValue* dense, dec.List("mlp_only_layers"));
  cfg.mlp_only_layers.clear();
  if (dense != nullptr) {
    for (int i = 0; i < dense->values_size(); ++i) {
      const Value& v = dense->values(i);
      const std::string path = absl::StrCat("mlp_only_layers[", i, "]");
      if (v.kind_case() != Value::kNumberValue) return dec.WrongType(path, "an integer", v);
      const double d = v.number_value();
      if (!std::isfinite(d) || std::trunc(d) != d || std::fabs(d) > kMaxExactInt) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": field ", dec.Path(path), " must be an integer, got ", d));
      }
      cfg.mlp_only_layers.push_back(static_cast<int64_t>(d));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseDecoder(const JsonObject& dec, Arch arch, absl::string_view source,
                          ModelConfig& cfg) {
  const bool hybrid = IsQwen35(arch);
  DF_ASSIGN_OR_RETURN(cfg.vocab_size, dec.RequiredInt("vocab_size"));
  DF_ASSIGN_OR_RETURN(cfg.hidden_size, dec.RequiredInt("hidden_size"));
  if (arch == Arch::kQwen3Moe) {
    // The dense width of mlp_only_layers; Qwen3MoeConfig's default.
    DF_ASSIGN_OR_RETURN(std::optional<int64_t> inter, dec.Int("intermediate_size"));
    cfg.intermediate_size = inter.value_or(6144);
  } else if (FeaturesOf(arch).mlp == MlpKind::kDenseSwiGlu) {
    DF_ASSIGN_OR_RETURN(cfg.intermediate_size, dec.RequiredInt("intermediate_size"));
  }  // qwen3_5_moe has no dense MLP: the key means nothing there
  DF_ASSIGN_OR_RETURN(cfg.num_layers, dec.RequiredInt("num_hidden_layers"));
  // Checked here, not only in Validate: the layer types are derived from it
  // below, and a corrupted count would be allocated first.
  if (cfg.num_layers > kMaxConfigLayers) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", dec.Path("num_hidden_layers"),
                                                   " must be at most ", kMaxConfigLayers, ", got ",
                                                   cfg.num_layers));
  }
  DF_ASSIGN_OR_RETURN(cfg.num_heads, dec.RequiredInt("num_attention_heads"));
  if (hybrid) {
    DF_ASSIGN_OR_RETURN(cfg.num_kv_heads, dec.RequiredInt("num_key_value_heads"));
  } else if (arch == Arch::kQwen3Moe) {
    DF_ASSIGN_OR_RETURN(std::optional<int64_t> kv, dec.Int("num_key_value_heads"));
    cfg.num_kv_heads = kv.value_or(4);  // Qwen3MoeConfig's default
  } else {
    // Qwen3Config: an absent KV head count means plain multi-head attention.
    DF_ASSIGN_OR_RETURN(std::optional<int64_t> kv, dec.Int("num_key_value_heads"));
    cfg.num_kv_heads = kv.value_or(cfg.num_heads);
  }
  DF_ASSIGN_OR_RETURN(std::optional<int64_t> head_dim, dec.Int("head_dim"));
  if (head_dim.has_value()) {
    cfg.head_dim = *head_dim;
  } else if (hybrid) {
    cfg.head_dim = 256;
  } else {
    cfg.head_dim = cfg.num_heads > 0 ? cfg.hidden_size / cfg.num_heads : 0;
  }
  DF_ASSIGN_OR_RETURN(std::optional<double> eps, dec.Number("rms_norm_eps"));
  cfg.rms_norm_eps = eps.value_or(1e-6);
  DF_ASSIGN_OR_RETURN(std::optional<bool> tie, dec.Bool("tie_word_embeddings"));
  cfg.tie_word_embeddings = tie.value_or(false);

  DF_ASSIGN_OR_RETURN(std::optional<std::string> act, dec.String("hidden_act"));
  if (act.has_value() && *act != "silu") {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", dec.Path("hidden_act"), " \"",
                                                   *act, "\" is not supported (only silu)"));
  }
  DF_ASSIGN_OR_RETURN(std::optional<bool> bias, dec.Bool("attention_bias"));
  if (bias.value_or(false)) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", dec.Path("attention_bias"),
                                                   " is true; attention biases are not supported"));
  }
  if (!hybrid) {
    DF_ASSIGN_OR_RETURN(std::optional<bool> sliding, dec.Bool("use_sliding_window"));
    if (sliding.value_or(false)) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": ", dec.Path("use_sliding_window"),
                       " is true; sliding-window attention is not supported"));
    }
  }

  if (FeaturesOf(arch).linear_attention) {
    struct {
      absl::string_view key;
      int64_t* dst;
    } linear_fields[] = {
        {"linear_conv_kernel_dim", &cfg.linear_conv_kernel},
        {"linear_key_head_dim", &cfg.linear_key_head_dim},
        {"linear_value_head_dim", &cfg.linear_value_head_dim},
        {"linear_num_key_heads", &cfg.linear_num_key_heads},
        {"linear_num_value_heads", &cfg.linear_num_value_heads},
    };
    for (const auto& f : linear_fields) {
      DF_ASSIGN_OR_RETURN(std::optional<int64_t> v, dec.Int(f.key));
      if (v.has_value()) *f.dst = *v;
    }
  }

  DF_ASSIGN_OR_RETURN(std::optional<std::vector<std::string>> types, dec.StringList("layer_types"));
  cfg.layer_types.clear();
  if (types.has_value()) {
    for (size_t i = 0; i < types->size(); ++i) {
      DF_ASSIGN_OR_RETURN(LayerKind kind,
                          ParseLayerType((*types)[i], arch, source,
                                         dec.Path(absl::StrCat("layer_types[", i, "]"))));
      cfg.layer_types.push_back(kind);
    }
  } else if (hybrid) {
    DF_ASSIGN_OR_RETURN(std::optional<int64_t> interval, dec.Int("full_attention_interval"));
    const int64_t every = interval.value_or(4);
    if (every <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": ", dec.Path("full_attention_interval"), " must be positive, got ", every));
    }
    for (int64_t i = 0; i < cfg.num_layers; ++i) {
      cfg.layer_types.push_back((i + 1) % every == 0 ? LayerKind::kFullAttention
                                                     : LayerKind::kLinearAttention);
    }
  } else {
    cfg.layer_types.assign(static_cast<size_t>(std::max<int64_t>(cfg.num_layers, 0)),
                           LayerKind::kFullAttention);
  }
  if (FeaturesOf(arch).mlp != MlpKind::kDenseSwiGlu)
    DF_RETURN_IF_ERROR(ParseMoe(dec, arch, source, cfg));
  return ParseRope(dec, arch, source, cfg);
}

// quantization_config: only fine-grained FP8 (quant_method "fp8") as Qwen's
// FP8 releases and transformers' FineGrainedFP8Config write it; any other
// method, format, activation scheme or block size would be read as
// something it is not, so it is refused naming the field and its value.
absl::Status ParseQuantization(const JsonObject& top, absl::string_view source, ModelConfig& cfg) {
  DF_ASSIGN_OR_RETURN(const Struct* q, top.Object("quantization_config"));
  if (q == nullptr) return absl::OkStatus();
  const JsonObject obj(*q, source, "quantization_config.");
  auto refuse = [&](absl::string_view key, absl::string_view value, absl::string_view accepted) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", obj.Path(key), " \"", value,
                                                   "\" is not supported; only ", accepted));
  };
  DF_ASSIGN_OR_RETURN(std::optional<std::string> method, obj.String("quant_method"));
  if (!method.has_value()) return obj.Missing("quant_method");
  if (*method != "fp8") {
    return refuse("quant_method", *method,
                  "\"fp8\" (fine-grained FP8: e4m3 weights, 128x128 block scales, dynamic "
                  "activations)");
  }
  DF_ASSIGN_OR_RETURN(std::optional<std::string> fmt, obj.String("fmt"));
  if (fmt.has_value() && *fmt != "e4m3") return refuse("fmt", *fmt, "\"e4m3\"");
  DF_ASSIGN_OR_RETURN(std::optional<std::string> scheme, obj.String("activation_scheme"));
  if (scheme.has_value() && *scheme != "dynamic") {
    return refuse("activation_scheme", *scheme, "\"dynamic\" (per-token activation scales)");
  }
  Fp8Quantization& quant = cfg.quantization;
  quant.enabled = true;
  DF_ASSIGN_OR_RETURN(const ListValue* block, obj.List("weight_block_size"));
  if (block != nullptr) {
    if (block->values_size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(source, ": ", obj.Path("weight_block_size"), " has ", block->values_size(),
                       " entries; it must be [rows, cols] ([128, 128])"));
    }
    int64_t dims[2];
    for (int i = 0; i < 2; ++i) {
      const Value& v = block->values(i);
      const std::string path = absl::StrCat("weight_block_size[", i, "]");
      if (v.kind_case() != Value::kNumberValue) return obj.WrongType(path, "an integer", v);
      const double d = v.number_value();
      if (!std::isfinite(d) || std::trunc(d) != d || std::fabs(d) > kMaxExactInt) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": field ", obj.Path(path), " must be an integer, got ", d));
      }
      dims[i] = static_cast<int64_t>(d);
    }
    quant.block_rows = dims[0];
    quant.block_cols = dims[1];
  }
  DF_ASSIGN_OR_RETURN(std::optional<std::vector<std::string>> skip,
                      obj.StringList("modules_to_not_convert"));
  quant.modules_to_not_convert = skip.value_or(std::vector<std::string>{});
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::FromJson(std::string_view json,
                                                  std::string_view source_name) {
  const absl::string_view source(source_name.data(), source_name.size());
  Struct root;
  google::protobuf::util::JsonParseOptions opts;
  const auto parsed = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &root, opts);
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": not a JSON object: ",
                     absl::string_view(parsed.message().data(), parsed.message().size())));
  }
  const JsonObject top(root, source, "");

  DF_ASSIGN_OR_RETURN(std::optional<std::string> model_type, top.String("model_type"));
  DF_ASSIGN_OR_RETURN(std::optional<std::vector<std::string>> architectures,
                      top.StringList("architectures"));
  const ArchInfo* declared = nullptr;
  if (architectures.has_value()) {
    for (const std::string& a : *architectures) {
      declared = FindArchitecture(a);
      if (declared == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(source, ": unsupported architecture \"", a,
                                                       "\"; supported: ", kSupportedArchitectures));
      }
    }
  }
  if (!model_type.has_value()) {
    if (declared == nullptr) return top.Missing("model_type");
    model_type = std::string(declared->model_type);
  }
  const std::optional<Arch> arch = ArchOfModelType(*model_type);
  if (!arch.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": unsupported model_type \"",
                                                   *model_type,
                                                   "\"; supported: ", kSupportedModelTypes));
  }
  if (declared != nullptr && declared->arch != *arch) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": architecture \"", declared->architecture,
                     "\" does not match model_type \"", *model_type, "\""));
  }

  ModelConfig cfg;
  cfg.SetArch(*arch);
  if (*model_type == "qwen3_5" || *model_type == "qwen3_5_moe") {
    cfg.multimodal = true;
    DF_ASSIGN_OR_RETURN(const Struct* text, top.Object("text_config"));
    if (text == nullptr) return top.Missing("text_config");
    const JsonObject dec(*text, source, "text_config.");
    DF_ASSIGN_OR_RETURN(std::optional<std::string> text_type, dec.String("model_type"));
    const std::string want_text_type = absl::StrCat(*model_type, "_text");
    if (text_type.has_value() && *text_type != want_text_type) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": text_config.model_type \"",
                                                     *text_type, "\" should be ", want_text_type));
    }
    DF_RETURN_IF_ERROR(ParseDecoder(dec, cfg.arch, source, cfg));
    // The ConditionalGeneration head ties (or not) according to the outer config.
    DF_ASSIGN_OR_RETURN(std::optional<bool> tie, top.Bool("tie_word_embeddings"));
    if (tie.has_value()) cfg.tie_word_embeddings = *tie;
  } else {
    DF_RETURN_IF_ERROR(ParseDecoder(top, cfg.arch, source, cfg));
  }
  DF_RETURN_IF_ERROR(ParseQuantization(top, source, cfg));

  if (absl::Status st = cfg.Validate(); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", st.message()));
  }
  return cfg;
}

}  // namespace draftfeed
