// Loads a Hugging Face checkpoint directory: config.json, then one
// model.safetensors or the shards that model.safetensors.index.json names.
// Every decoder tensor is checked against the shape the config implies, and
// the Tensors point straight into the read-only mappings (copied only when a
// tensor's offset leaves it misaligned for its dtype).
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
  absl::StatusOr<Tensor> Bind(const Found& f, const WeightSpec& spec);
  absl::StatusOr<Tensor> BindExperts(const WeightSpec& spec, std::set<std::string>& expected);
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

absl::StatusOr<Tensor> CheckpointLoader::Bind(const Found& f, const WeightSpec& spec) {
  const SafetensorsTensor& st = *f.tensor;
  Tensor t;
  t.dtype = DTypeFromSafetensors(st.dtype);
  if (t.dtype == DType::kInvalid) {
    return Error("tensor ", f.name, " in ", f.file, " has dtype ", st.dtype,
                 "; only BF16, F16 and F32 are supported");
  }
  if (st.shape != spec.shape) {
    return Error("tensor ", f.name, " has shape [", absl::StrJoin(st.shape, ", "), "], expected [",
                 absl::StrJoin(spec.shape, ", "), "] (from config.json: ", spec.origin, ")");
  }
  t.shape = st.shape;
  t.data = st.data;
  if (reinterpret_cast<uintptr_t>(st.data) % DTypeSize(t.dtype) != 0) {
    auto copy = std::make_unique<std::byte[]>(st.nbytes);
    std::memcpy(copy.get(), st.data, st.nbytes);
    t.data = copy.get();
    storage_->copies.push_back(std::move(copy));
  }
  return t;
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
    return Bind(fused->second, spec);
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
                     "; only BF16, F16 and F32 are supported");
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
      if (stacked == nullptr) {
        stacked = std::make_unique<std::byte[]>(part_bytes * static_cast<size_t>(experts * parts));
      }
      std::memcpy(stacked.get() + static_cast<size_t>(e * parts + p) * part_bytes, f.tensor->data,
                  part_bytes);
      expected.insert(name);
    }
  }
  t.data = stacked.get();
  storage_->copies.push_back(std::move(stacked));
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
    DF_ASSIGN_OR_RETURN(WeightSlot(w, spec), Bind(it->second, spec));
  }
  for (const auto& [suffix, found] : decoder_) {
    if (!expected.contains(suffix)) {
      return Error("unexpected tensor ", found.name, " in ", found.file, ExtraReason(suffix));
    }
  }
  if (lm_head_.has_value()) {
    DF_ASSIGN_OR_RETURN(Tensor head, Bind(*lm_head_, LmHeadSpec(config_)));
    // transformers ties a stored head to the embedding regardless.
    w.lm_head = config_.tie_word_embeddings ? w.embed_tokens : head;
  } else if (config_.tie_word_embeddings) {
    w.lm_head = w.embed_tokens;
  }

  model->storage = storage_;
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
    return absl::NotFoundError(
        absl::StrCat("model ", spec,
                     " not found: no such checkpoint directory, and not a built-in spec "
                     "(tiny-random[:SEED], tiny-random-qwen3[:SEED])"));
  }
  return LoadModel(spec);
}

}  // namespace draftfeed
