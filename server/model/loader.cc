// Loads a Hugging Face checkpoint directory: config.json, then one
// model.safetensors or the shards that model.safetensors.index.json names.
// Every decoder tensor is checked against the shape the config implies, and
// the Tensors point straight into the read-only mappings, copied only when a
// tensor's offset leaves it misaligned for its dtype, and for per-expert
// tensors, stacked into one buffer per layer by parallel reads of the shards.
// Fine-grained FP8 checkpoints: a weight is FP8 iff it is F8_E4M3 and has a
// weight_scale_inv beside it, whose shape is checked against the weight's
// 128x128 block grid.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"
#include "server/model/staged_read.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

namespace fs = std::filesystem;
using google::protobuf::Struct;
using google::protobuf::Value;

constexpr char kConfigFile[] = "config.json";
constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";
// Checked in this order: "model." is a prefix of the first.
constexpr absl::string_view kDecoderPrefixes[] = {"model.language_model.", "language_model.model.",
                                                  "model."};
constexpr absl::string_view kLmHeadNames[] = {"lm_head.weight", "language_model.lm_head.weight"};
// Vision tower and MTP head: part of the released checkpoint, not of the decoder.
constexpr absl::string_view kSkippedPrefixes[] = {"mtp.", "model.visual.", "visual."};

absl::StatusOr<std::string> ReadText(const fs::path& path) {
  // A FIFO or device in place of config.json or the index would block the read forever.
  std::error_code ec;
  if (fs::exists(path, ec)) DF_RETURN_IF_ERROR(CheckRegularFile(path.string(), "text file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path.string()));
  return ss.str();
}

struct Found {
  std::string name;  // full name in the file
  const SafetensorsTensor* tensor;
  std::string file;  // shard file name, for messages
};

// Everything the loaded Model's Tensors point into.
struct Storage {
  std::vector<std::shared_ptr<const void>> mappings;
  std::vector<std::unique_ptr<std::byte[]>> copies;
};

class CheckpointLoader {
 public:
  explicit CheckpointLoader(std::string dir) : dir_(std::move(dir)), root_(dir_) {}

  absl::StatusOr<std::unique_ptr<Model>> Load();

 private:
  template <typename... Parts>
  absl::Status Error(const Parts&... parts) const {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir_, ": ", parts...));
  }

  absl::Status OpenShards();
  absl::Status IndexTensors();
  absl::Status Classify();
  absl::StatusOr<Tensor> Bind(const Found& f, const WeightSpec& spec,
                              std::set<std::string>& expected);
  absl::Status BindScales(const Found& weight, const std::string& suffix, const WeightSpec& spec,
                          const std::vector<int64_t>& weight_shape, std::set<std::string>& expected,
                          Tensor& t);
  absl::StatusOr<Tensor> BindExperts(const WeightSpec& spec, std::set<std::string>& expected);
  const std::byte* Aligned(const std::byte* data, size_t nbytes, size_t alignment);
  std::string ExtraReason(const std::string& suffix) const;

  std::string dir_;
  fs::path root_;
  ModelConfig config_;
  std::vector<std::string> shard_names_;
  std::vector<SafetensorsFile> shards_;
  std::optional<std::map<std::string, std::string>> weight_map_;  // sharded only
  std::map<std::string, Found> all_;                              // full name -> tensor
  std::string prefix_;                                            // decoder prefix in use
  std::map<std::string, Found> decoder_;                          // suffix -> tensor
  std::optional<Found> lm_head_;
  std::shared_ptr<Storage> storage_ = std::make_shared<Storage>();
  std::vector<std::shared_ptr<const MappedFile>> files_;
  // Per-expert parts into their stacked tensors: on MoE checkpoints saved per
  // expert nearly all the bytes, read in parallel from the shards.
  std::vector<StagedCopy> stacking_;
};

absl::Status CheckpointLoader::OpenShards() {
  std::error_code ec;
  // model.safetensors first, as transformers picks it when both exist.
  const fs::path single = root_ / kSingleFile;
  if (fs::exists(single, ec)) {
    DF_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(single.string()));
    shard_names_.emplace_back(kSingleFile);
    shards_.push_back(std::move(f));
    return absl::OkStatus();
  }
  const fs::path index_path = root_ / kIndexFile;
  if (!fs::exists(index_path, ec)) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint ", dir_, ": found neither ", kSingleFile, " nor ", kIndexFile));
  }
  DF_ASSIGN_OR_RETURN(std::string text, ReadText(index_path));
  Struct index;
  const auto parsed = google::protobuf::util::JsonStringToMessage(text, &index);
  if (!parsed.ok()) {
    return Error(kIndexFile, " is not a valid JSON object: ",
                 absl::string_view(parsed.message().data(), parsed.message().size()));
  }
  auto it = index.fields().find("weight_map");
  if (it == index.fields().end() || it->second.kind_case() != Value::kStructValue) {
    return Error(kIndexFile, " has no \"weight_map\" object");
  }
  weight_map_.emplace();
  std::map<std::string, std::string> first_tensor_of;  // shard -> its first tensor by name
  for (const auto& [name, shard] : it->second.struct_value().fields()) {
    if (shard.kind_case() != Value::kStringValue) {
      return Error(kIndexFile, ": weight_map entry ", name, " is not a file name");
    }
    const std::string& file = shard.string_value();
    if (file.empty() || absl::StrContains(file, '/') || file == "." || file == "..") {
      return Error(kIndexFile, ": weight_map entry ", name, " names \"", file,
                   "\", which is not a file in the checkpoint directory");
    }
    (*weight_map_)[name] = file;
    auto [first, inserted] = first_tensor_of.emplace(file, name);
    if (!inserted && name < first->second) first->second = name;
  }
  for (const auto& [file, tensor] : first_tensor_of) {
    const fs::path path = root_ / file;
    if (!fs::exists(path, ec)) {
      return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, ": shard ", file, " (listed in ",
                                              kIndexFile, " for ", tensor, ") does not exist"));
    }
    DF_ASSIGN_OR_RETURN(SafetensorsFile f, SafetensorsFile::Open(path.string()));
    shard_names_.push_back(file);
    shards_.push_back(std::move(f));
  }
  return absl::OkStatus();
}

absl::Status CheckpointLoader::IndexTensors() {
  for (size_t s = 0; s < shards_.size(); ++s) {
    storage_->mappings.push_back(shards_[s].storage());
    files_.push_back(shards_[s].file());
    for (const auto& [name, tensor] : shards_[s].tensors()) {
      auto [it, inserted] = all_.emplace(name, Found{name, &tensor, shard_names_[s]});
      if (!inserted) {
        return Error("tensor ", name, " appears in both ", it->second.file, " and ",
                     shard_names_[s]);
      }
    }
  }
  if (weight_map_.has_value()) {
    for (const auto& [name, file] : *weight_map_) {
      auto it = all_.find(name);
      if (it == all_.end() || it->second.file != file) {
        return Error("missing tensor ", name, " (looked in ", file, ")");
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CheckpointLoader::Classify() {
  for (const auto& [name, found] : all_) {
    bool skipped = false;
    for (absl::string_view p : kSkippedPrefixes) skipped |= absl::StartsWith(name, p);
    if (skipped) continue;
    bool is_head = false;
    for (absl::string_view h : kLmHeadNames) is_head |= name == h;
    if (is_head) {
      if (lm_head_.has_value()) {
        return Error("both ", lm_head_->name, " and ", name, " are present");
      }
      lm_head_ = found;
      continue;
    }
    absl::string_view prefix;
    for (absl::string_view p : kDecoderPrefixes) {
      if (absl::StartsWith(name, p)) {
        prefix = p;
        break;
      }
    }
    if (prefix.empty()) return Error("unexpected tensor ", name, " in ", found.file);
    if (prefix_.empty()) {
      prefix_ = std::string(prefix);
    } else if (prefix != prefix_) {
      return Error("tensor ", name, " uses the prefix ", prefix, " but others use ", prefix_);
    }
    decoder_.emplace(name.substr(prefix.size()), found);
  }
  if (prefix_.empty()) {
    prefix_ = std::string(config_.multimodal ? kDecoderPrefixes[0] : kDecoderPrefixes[2]);
  }
  return absl::OkStatus();
}

// Why a decoder tensor that the config does not call for is there.
std::string CheckpointLoader::ExtraReason(const std::string& suffix) const {
  if (absl::EndsWith(suffix, ".weight_scale") || absl::EndsWith(suffix, ".input_scale")) {
    return " (fine-grained FP8 checkpoints name their block scales weight_scale_inv and have no "
           "input scales; this is another quantization format)";
  }
  if (!absl::StartsWith(suffix, "layers.")) return "";
  const absl::string_view rest = absl::string_view(suffix).substr(7);
  const size_t dot = rest.find('.');
  int64_t layer = 0;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(rest.substr(0, dot), &layer)) return "";
  if (layer < 0 || layer >= config_.num_layers) {
    return absl::StrCat(" (layer ", layer, " >= num_hidden_layers=", config_.num_layers,
                        " from config.json)");
  }
  const bool full = config_.layer_types[static_cast<size_t>(layer)] == LayerKind::kFullAttention;
  const absl::string_view part = rest.substr(dot + 1);
  if (absl::StartsWith(part, full ? "linear_attn." : "self_attn.")) {
    return absl::StrCat(" (layer ", layer, " is ", full ? "full_attention" : "linear_attention",
                        " in config.json)");
  }
  if (!absl::StartsWith(part, "mlp.")) return "";
  const bool moe = config_.MlpOfLayer(layer) != MlpKind::kDenseSwiGlu;
  const bool moe_tensor = absl::StartsWith(part, "mlp.gate.") ||
                          absl::StartsWith(part, "mlp.experts.") ||
                          absl::StartsWith(part, "mlp.shared_expert");
  if (moe_tensor && !moe) {
    return absl::StrCat(" (layer ", layer,
                        " has a dense MLP in config.json: num_experts, mlp_only_layers, "
                        "decoder_sparse_step)");
  }
  if (!moe_tensor && moe) {
    return absl::StrCat(" (layer ", layer, " is a mixture-of-experts layer in config.json)");
  }
  if (absl::StartsWith(part, "mlp.shared_expert") &&
      config_.features.mlp != MlpKind::kMoeSharedExpert) {
    return absl::StrCat(" (", std::string(ArchName(config_.arch)), " has no shared expert)");
  }
  int64_t expert = 0;
  const absl::string_view after = part.substr(std::min(part.size(), sizeof("mlp.experts.") - 1));
  if (absl::StartsWith(part, "mlp.experts.") &&
      absl::SimpleAtoi(after.substr(0, after.find('.')), &expert) &&
      expert >= config_.num_experts) {
    return absl::StrCat(" (expert ", expert, " >= num_experts=", config_.num_experts,
                        " from config.json)");
  }
  return "";
}

// A tensor's bytes, copied when its offset leaves it misaligned for its dtype.
const std::byte* CheckpointLoader::Aligned(const std::byte* data, size_t nbytes, size_t alignment) {
  if (reinterpret_cast<uintptr_t>(data) % alignment == 0) return data;
  auto copy = std::make_unique<std::byte[]>(nbytes);
  std::memcpy(copy.get(), data, nbytes);
  const std::byte* out = copy.get();
  storage_->copies.push_back(std::move(copy));
  return out;
}

// The scale checkpoint name of a weight suffix: "x.weight" -> "x.weight_scale_inv"
// (per-module Linears), "experts.gate_up_proj" -> "experts.gate_up_proj_scale_inv"
// (transformers 5's fused FP8 experts).
std::string ScaleSuffix(const std::string& weight_suffix) {
  return absl::StrCat(weight_suffix, "_scale_inv");
}

absl::StatusOr<Tensor> CheckpointLoader::Bind(const Found& f, const WeightSpec& spec,
                                              std::set<std::string>& expected) {
  const SafetensorsTensor& st = *f.tensor;
  Tensor t;
  t.dtype = DTypeFromSafetensors(st.dtype);
  if (t.dtype == DType::kInvalid) {
    return Error("tensor ", f.name, " in ", f.file, " has dtype ", st.dtype,
                 "; only BF16, F16, F32 and F8_E4M3 are supported");
  }
  if (st.shape != spec.shape) {
    return Error("tensor ", f.name, " has shape [", absl::StrJoin(st.shape, ", "), "], expected [",
                 absl::StrJoin(spec.shape, ", "), "] (from config.json: ", spec.origin, ")");
  }
  t.shape = st.shape;
  t.data = Aligned(st.data, st.nbytes, DTypeSize(t.dtype));
  DF_RETURN_IF_ERROR(BindScales(f, spec.name, spec, spec.shape, expected, t));
  return t;
}

// Pairs an FP8 weight with its weight_scale_inv (into t.scale_inv), and
// refuses every mismatch: an F8 weight without scales or where the engines
// keep bf16, scales beside a non-F8 weight, a scale of the wrong dtype or
// shape, F8 weights in a checkpoint whose config.json does not say FP8.
absl::Status CheckpointLoader::BindScales(const Found& weight, const std::string& suffix,
                                          const WeightSpec& spec,
                                          const std::vector<int64_t>& weight_shape,
                                          std::set<std::string>& expected, Tensor& t) {
  const std::string scale_suffix = ScaleSuffix(suffix);
  const auto it = decoder_.find(scale_suffix);
  const Found* scale = it == decoder_.end() ? nullptr : &it->second;
  if (!t.fp8()) {
    if (scale != nullptr) {
      return Error("tensor ", scale->name, " in ", scale->file, " scales ", weight.name,
                   ", which is ", weight.tensor->dtype,
                   ", not F8_E4M3; block scales belong to FP8 weights only");
    }
    return absl::OkStatus();
  }
  if (!spec.fp8_eligible) {
    return Error("tensor ", weight.name, " in ", weight.file,
                 " is F8_E4M3, but this tensor stays in bf16 in FP8 checkpoints (only the "
                 "attention, GDN in_proj_qkv/in_proj_z/out_proj, MLP and expert projections are "
                 "quantized)");
  }
  if (!config_.quantization.enabled) {
    return Error("tensor ", weight.name, " in ", weight.file,
                 " is F8_E4M3, but config.json has no quantization_config (quant_method \"fp8\")");
  }
  if (scale == nullptr) {
    return Error("tensor ", weight.name, " in ", weight.file, " is F8_E4M3 but has no scales (",
                 prefix_, scale_suffix, " is missing)");
  }
  const DType scale_dtype = DTypeFromSafetensors(scale->tensor->dtype);
  if (scale_dtype == DType::kInvalid || scale_dtype == DType::kF8E4M3) {
    return Error("tensor ", scale->name, " in ", scale->file, " has dtype ", scale->tensor->dtype,
                 "; block scales must be BF16, F16 or F32");
  }
  const std::vector<int64_t> want = Fp8ScaleShape(weight_shape);
  if (scale->tensor->shape != want) {
    return Error("tensor ", scale->name, " has shape [", absl::StrJoin(scale->tensor->shape, ", "),
                 "], expected [", absl::StrJoin(want, ", "), "]: one scale per ", kFp8BlockSize,
                 "x", kFp8BlockSize, " block of ", weight.name, " [",
                 absl::StrJoin(weight_shape, ", "), "]");
  }
  t.scale_inv.dtype = scale_dtype;
  t.scale_inv.shape = want;
  t.scale_inv.data = Aligned(scale->tensor->data, scale->tensor->nbytes, DTypeSize(scale_dtype));
  expected.insert(scale_suffix);
  return absl::OkStatus();
}

// Stacked experts come fused under the spec's own name (transformers' in-memory
// layout, which BF16 hub releases use) or as one tensor per expert and part
// (what save_pretrained writes, and FP8 releases); the latter are stacked in
// expert order, parts in order, into a copy the model owns.
absl::StatusOr<Tensor> CheckpointLoader::BindExperts(const WeightSpec& spec,
                                                     std::set<std::string>& expected) {
  const int64_t experts = spec.shape[0];
  const int64_t parts = static_cast<int64_t>(spec.expert_parts.size());
  const int64_t part_rows = spec.shape[1] / parts, cols = spec.shape[2];
  // "layers.N.mlp.experts." and "layers.N.mlp.experts.{e}.<part>.weight".
  const std::string base = spec.name.substr(0, spec.name.rfind('.') + 1);
  auto part_name = [&](int64_t e, int64_t p) {
    return absl::StrCat(base, e, ".", spec.expert_parts[static_cast<size_t>(p)], ".weight");
  };
  const auto fused = decoder_.find(spec.name);
  const Found* first_part = nullptr;
  for (int64_t e = 0; e < experts && first_part == nullptr; ++e) {
    for (int64_t p = 0; p < parts && first_part == nullptr; ++p) {
      if (auto it = decoder_.find(part_name(e, p)); it != decoder_.end()) {
        first_part = &it->second;
      }
    }
  }
  if (fused != decoder_.end()) {
    if (first_part != nullptr) {
      return Error("layer ", spec.layer, " stores its experts both fused (", fused->second.name,
                   " in ", fused->second.file, ") and per expert (", first_part->name, " in ",
                   first_part->file, ")");
    }
    const SafetensorsTensor& st = *fused->second.tensor;
    if (st.shape.size() == 3 && st.shape[0] != experts) {
      return Error("tensor ", fused->second.name, " in ", fused->second.file, " holds ",
                   st.shape[0], " experts (its first dim), config.json has num_experts=", experts);
    }
    return Bind(fused->second, spec, expected);
  }
  if (first_part == nullptr) {
    return Error("missing tensor ", prefix_, spec.name, " (or its per-expert form ", prefix_,
                 part_name(0, 0), ", ...; looked in ", absl::StrJoin(shard_names_, ", "), ")");
  }

  Tensor t;
  t.dtype = DTypeFromSafetensors(first_part->tensor->dtype);
  t.shape = spec.shape;
  const size_t part_bytes = static_cast<size_t>(part_rows * cols) * DTypeSize(t.dtype);
  std::unique_ptr<std::byte[]> stacked;
  // FP8 parts: their scales stack the same way, which lines up with the
  // stacked tensor's block grid only when each part is whole blocks tall.
  if (t.fp8() && parts > 1 && part_rows % kFp8BlockSize != 0) {
    return Error("layer ", spec.layer, "'s FP8 experts (", first_part->name,
                 ") cannot be stacked: moe_intermediate_size=", part_rows,
                 " from config.json is not a multiple of the ", kFp8BlockSize, "-row scale block");
  }
  size_t part_scale_bytes = 0;
  std::unique_ptr<std::byte[]> stacked_scales;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t p = 0; p < parts; ++p) {
      const std::string name = part_name(e, p);
      const auto it = decoder_.find(name);
      if (it == decoder_.end()) {
        return Error("missing tensor ", prefix_, name, " (expert ", e, " of num_experts=", experts,
                     " from config.json; looked in ", absl::StrJoin(shard_names_, ", "), ")");
      }
      const Found& f = it->second;
      const DType dtype = DTypeFromSafetensors(f.tensor->dtype);
      if (dtype == DType::kInvalid) {
        return Error("tensor ", f.name, " in ", f.file, " has dtype ", f.tensor->dtype,
                     "; only BF16, F16, F32 and F8_E4M3 are supported");
      }
      if (dtype != t.dtype) {
        return Error("tensor ", f.name, " in ", f.file, " has dtype ", f.tensor->dtype, " but ",
                     first_part->name, " has ", first_part->tensor->dtype,
                     "; one layer's experts must share a dtype");
      }
      if (f.tensor->shape != std::vector<int64_t>{part_rows, cols}) {
        return Error("tensor ", f.name, " in ", f.file, " has shape [",
                     absl::StrJoin(f.tensor->shape, ", "), "], expected [", part_rows, ", ", cols,
                     "] (from config.json: ", spec.origin, ")");
      }
      Tensor part;
      part.dtype = dtype;
      DF_RETURN_IF_ERROR(BindScales(f, name, spec, {part_rows, cols}, expected, part));
      if (t.fp8()) {
        if (stacked_scales == nullptr) {
          t.scale_inv.dtype = part.scale_inv.dtype;
          t.scale_inv.shape = Fp8ScaleShape(spec.shape);
          part_scale_bytes = part.scale_inv.nbytes();
          stacked_scales = std::make_unique<std::byte[]>(part_scale_bytes *
                                                         static_cast<size_t>(experts * parts));
        } else if (part.scale_inv.dtype != t.scale_inv.dtype) {
          return Error("tensor ", prefix_, ScaleSuffix(name), " has dtype ",
                       std::string(DTypeName(part.scale_inv.dtype)), " but the first expert's is ",
                       std::string(DTypeName(t.scale_inv.dtype)),
                       "; one layer's expert scales must share a dtype");
        }
        std::memcpy(stacked_scales.get() + static_cast<size_t>(e * parts + p) * part_scale_bytes,
                    part.scale_inv.data, part_scale_bytes);
      }
      if (stacked == nullptr) {
        stacked = std::make_unique<std::byte[]>(part_bytes * static_cast<size_t>(experts * parts));
      }
      // Read with the others once every tensor is bound (Load).
      stacking_.push_back({.src = f.tensor->data,
                           .bytes = part_bytes,
                           .dst = stacked.get() + static_cast<size_t>(e * parts + p) * part_bytes});
      expected.insert(name);
    }
  }
  t.data = stacked.get();
  storage_->copies.push_back(std::move(stacked));
  if (stacked_scales != nullptr) {
    t.scale_inv.data = stacked_scales.get();
    storage_->copies.push_back(std::move(stacked_scales));
  }
  return t;
}

absl::StatusOr<std::unique_ptr<Model>> CheckpointLoader::Load() {
  std::error_code ec;
  if (!fs::exists(root_, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, " does not exist"));
  }
  if (!fs::is_directory(root_, ec)) return Error("not a directory");
  const fs::path config_path = root_ / kConfigFile;
  if (!fs::exists(config_path, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", dir_, ": no ", kConfigFile));
  }
  DF_ASSIGN_OR_RETURN(std::string config_text, ReadText(config_path));
  DF_ASSIGN_OR_RETURN(config_, ModelConfig::FromJson(config_text, config_path.string()));

  DF_RETURN_IF_ERROR(OpenShards());
  DF_RETURN_IF_ERROR(IndexTensors());
  DF_RETURN_IF_ERROR(Classify());

  auto model = std::make_unique<Model>();
  model->id = dir_;
  model->config = config_;
  ModelWeights& w = model->weights;
  w.layers.resize(static_cast<size_t>(config_.num_layers));
  for (size_t i = 0; i < w.layers.size(); ++i) w.layers[i].kind = config_.layer_types[i];

  const std::vector<WeightSpec> specs = DecoderWeightSpecs(config_);
  std::set<std::string> expected;
  for (const WeightSpec& spec : specs) {
    expected.insert(spec.name);
    if (!spec.expert_parts.empty()) {
      DF_ASSIGN_OR_RETURN(WeightSlot(w, spec), BindExperts(spec, expected));
      continue;
    }
    auto it = decoder_.find(spec.name);
    if (it == decoder_.end()) {
      return Error("missing tensor ", prefix_, spec.name, " (looked in ",
                   absl::StrJoin(shard_names_, ", "), ")");
    }
    DF_ASSIGN_OR_RETURN(WeightSlot(w, spec), Bind(it->second, spec, expected));
  }
  for (const auto& [suffix, found] : decoder_) {
    if (!expected.contains(suffix)) {
      return Error("unexpected tensor ", found.name, " in ", found.file, ExtraReason(suffix));
    }
  }
  if (lm_head_.has_value()) {
    std::set<std::string> head_scales;  // never any: lm_head stays bf16
    DF_ASSIGN_OR_RETURN(Tensor head, Bind(*lm_head_, LmHeadSpec(config_), head_scales));
    // transformers ties a stored head to the embedding regardless.
    w.lm_head = config_.tie_word_embeddings ? w.embed_tokens : head;
  } else if (config_.tie_word_embeddings) {
    w.lm_head = w.embed_tokens;
  }

  if (absl::StatusOr<StagedReadStats> read = ReadToHost(stacking_, files_, {}); !read.ok()) {
    return absl::Status(
        read.status().code(),
        absl::StrCat("checkpoint ", dir_, ": stacking the experts: ", read.status().message()));
  }
  model->storage = storage_;
  model->files = files_;
  model->fingerprint = ComputeFingerprint(*model);
  return model;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& dir) {
  return CheckpointLoader(dir).Load();
}

absl::StatusOr<std::unique_ptr<Model>> OpenModel(const std::string& spec) {
  if (absl::StartsWith(spec, "tiny-random") || absl::StartsWith(spec, "small-random") ||
      absl::StartsWith(spec, "random:")) {
    return MakeRandomModel(spec);
  }
  std::error_code ec;
  if (!fs::exists(spec, ec)) {
    // Every built-in, from the table that makes them: a mistyped name shows its neighbours.
    std::vector<std::string> builtins;
    for (const BuiltinModel& m : BuiltinModels()) builtins.push_back(m.spec);
    return absl::NotFoundError(absl::StrCat("model ", spec,
                                            " not found: no such checkpoint directory, and not a "
                                            "built-in model (",
                                            absl::StrJoin(builtins, ", "), ")"));
  }
  return LoadModel(spec);
}

}  // namespace draftfeed
