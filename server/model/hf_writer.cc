// Saves a Model as a Hugging Face directory: config.json plus one
// model.safetensors, or N shards and model.safetensors.index.json. FP8
// weights go out as fine-grained FP8 checkpoints ship: F8_E4M3 `weight` plus
// `weight_scale_inv` in the dtype the model holds them (F32 from the
// quantizer, BF16 from Qwen's releases: rewriting them in another dtype could
// change their values, and LoadModel must round-trip bit for bit; transformers
// upcasts either to fp32), experts per expert, and a quantization_config
// whose modules_to_not_convert names every Linear left in bf16.
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kIndexFile = "model.safetensors.index.json";
constexpr std::string_view kSingleFile = "model.safetensors";

std::string_view TorchDTypeName(DType d) {
  switch (d) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF32:
      return "float32";
    case DType::kF8E4M3:  // weights, never a checkpoint's dtype
    case DType::kInvalid:
      break;
  }
  return "";
}

std::string Quote(std::string_view s) {
  google::protobuf::Value v;
  v.set_string_value(std::string(s));
  std::string out;
  (void)google::protobuf::util::MessageToJsonString(v, &out);
  return out;
}

absl::Status WriteText(const fs::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path.string()));
  return absl::OkStatus();
}

struct Item {
  std::string name;  // full name in the checkpoint
  const Tensor* tensor;
  uint64_t out_bytes;
  DType out_dtype;
};

// `t` in dtype `to`; `buffer` receives the converted bytes unless no
// conversion is needed, in which case the result points at `t`'s own data.
SafetensorsTensor Convert(const Item& item, std::vector<std::byte>& buffer) {
  const Tensor& t = *item.tensor;
  const DType to = item.out_dtype;
  SafetensorsTensor out;
  out.name = item.name;
  out.dtype = std::string(DTypeName(to));
  out.shape = t.shape;
  out.nbytes = item.out_bytes;
  if (t.dtype == to) {
    out.data = t.data;
    return out;
  }
  const std::vector<float> f = ToFloat(t);
  buffer.resize(item.out_bytes);
  if (to == DType::kF32) {
    std::memcpy(buffer.data(), f.data(), item.out_bytes);
  } else {
    for (size_t i = 0; i < f.size(); ++i) {
      const uint16_t h = to == DType::kBF16 ? FloatToBf16(f[i]) : FloatToFp16(f[i]);
      std::memcpy(buffer.data() + 2 * i, &h, 2);
    }
  }
  out.data = buffer.data();
  return out;
}

}  // namespace

absl::Status WriteHfCheckpoint(const Model& model, const std::string& dir,
                               const HfWriteOptions& options) {
  if (TorchDTypeName(options.dtype).empty()) {
    return absl::InvalidArgumentError("WriteHfCheckpoint: dtype must be BF16, F16 or F32");
  }
  if (options.num_shards < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("WriteHfCheckpoint: num_shards must be at least 1, got ", options.num_shards));
  }
  ModelConfig config = model.config;
  config.multimodal = options.multimodal_naming;
  DF_RETURN_IF_ERROR(config.Validate());
  if (model.weights.layers.size() != static_cast<size_t>(config.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("WriteHfCheckpoint: model ", model.id, " has ",
                                                   model.weights.layers.size(),
                                                   " layers, its config ", config.num_layers));
  }

  const std::string prefix = options.multimodal_naming ? "model.language_model." : "model.";
  // A tensor stays F8 on disk unless asked to dequantize; its scales follow
  // it under <weight name>_scale_inv.
  auto keep_fp8 = [&](const Tensor& t) { return t.fp8() && !options.dequantize_fp8; };
  auto out_dtype = [&](const Tensor& t) { return keep_fp8(t) ? DType::kF8E4M3 : options.dtype; };
  std::deque<Tensor> scale_views;
  std::vector<Item> items;
  auto add_scales = [&](const Item& weight) {
    const Tensor& t = *weight.tensor;
    if (!keep_fp8(t)) return;
    Tensor& s = scale_views.emplace_back();
    s.dtype = t.scale_inv.dtype;
    s.shape = t.scale_inv.shape;
    s.data = t.scale_inv.data;
    items.push_back({weight.name + "_scale_inv", &s, s.nbytes(), s.dtype});
  };
  std::vector<std::string> bf16_modules;  // quantization_config.modules_to_not_convert
  bool any_fp8 = false;
  auto add = [&](const WeightSpec& spec, std::string name) -> absl::Status {
    const Tensor& t = WeightSlot(model.weights, spec);
    if (!t.valid() || t.shape != spec.shape || DTypeSize(t.dtype) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "WriteHfCheckpoint: model ", model.id, " tensor ", spec.name, " is ",
          t.valid() ? absl::StrCat(std::string(DTypeName(t.dtype)), " ", t.ShapeString())
                    : "missing",
          ", expected shape [", absl::StrJoin(spec.shape, ", "), "]"));
    }
    if (t.fp8() && (!t.scale_inv.valid() || t.scale_inv.shape != Fp8ScaleShape(t.shape))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "WriteHfCheckpoint: model ", model.id, " FP8 tensor ", spec.name,
          " has no block scales of shape [", absl::StrJoin(Fp8ScaleShape(t.shape), ", "), "]"));
    }
    any_fp8 |= keep_fp8(t);
    // Linear layers (2-D weights and the experts) left unquantized, named as
    // transformers names modules; embed_tokens is an Embedding, never converted.
    // (conv1d, 3-D without expert parts, is a Conv1d).
    const bool linear = (spec.shape.size() == 2 || !spec.expert_parts.empty()) &&
                        spec.global != &ModelWeights::embed_tokens && spec.name != "lm_head.weight";
    if (linear && !keep_fp8(t)) {  // "x.weight" -> module "x"; "experts.down_proj" -> "experts"
      bf16_modules.push_back(absl::StrCat(prefix, spec.name.substr(0, spec.name.rfind('.'))));
    }
    items.push_back({std::move(name), &t,
                     static_cast<uint64_t>(t.numel()) * DTypeSize(out_dtype(t)), out_dtype(t)});
    return absl::OkStatus();
  };
  // Stacked experts go out one tensor per expert and part, as transformers'
  // save_pretrained writes them: views into the stacked tensor.
  std::deque<Tensor> expert_views;
  for (const WeightSpec& spec : DecoderWeightSpecs(config)) {
    DF_RETURN_IF_ERROR(add(spec, prefix + spec.name));
    if (spec.expert_parts.empty()) {
      add_scales(items.back());
      continue;
    }
    const Tensor& stacked = *items.back().tensor;
    items.pop_back();
    const int64_t parts = static_cast<int64_t>(spec.expert_parts.size());
    const int64_t rows = spec.shape[1] / parts, cols = spec.shape[2];
    const std::string base = prefix + spec.name.substr(0, spec.name.rfind('.') + 1);
    for (int64_t e = 0; e < spec.shape[0]; ++e) {
      for (int64_t p = 0; p < parts; ++p) {
        Tensor& view = expert_views.emplace_back();
        view.dtype = stacked.dtype;
        view.shape = {rows, cols};
        view.data = stacked.data +
                    static_cast<size_t>((e * parts + p) * rows * cols) * DTypeSize(stacked.dtype);
        if (stacked.fp8()) {
          // Each part must be whole scale blocks tall (the loader and the
          // quantizer refuse other widths); then its scales are a contiguous
          // run of the stacked ones.
          if (parts > 1 && rows % kFp8BlockSize != 0) {
            return absl::InvalidArgumentError(
                absl::StrCat("WriteHfCheckpoint: model ", model.id, " FP8 experts ", spec.name,
                             " cannot be split per expert: moe_intermediate_size=", rows,
                             " is not a multiple of ", kFp8BlockSize));
          }
          view.scale_inv.dtype = stacked.scale_inv.dtype;
          view.scale_inv.shape = Fp8ScaleShape(view.shape);
          view.scale_inv.data =
              stacked.scale_inv.data + static_cast<size_t>(e * parts + p) * view.scale_inv.nbytes();
        }
        items.push_back(
            {absl::StrCat(base, e, ".", spec.expert_parts[static_cast<size_t>(p)], ".weight"),
             &view, static_cast<uint64_t>(rows * cols) * DTypeSize(out_dtype(view)),
             out_dtype(view)});
        add_scales(items.back());
      }
    }
  }
  if (!config.tie_word_embeddings && model.weights.lm_head.valid()) {
    const WeightSpec head = LmHeadSpec(config);
    DF_RETURN_IF_ERROR(add(head, head.name));
    add_scales(items.back());
  }
  bf16_modules.insert(bf16_modules.begin(), "lm_head");
  // Multimodal naming: transformers builds the vision tower this file does
  // not hold and initialises it; left to its FP8 conversion, that init fails
  // on e4m3 ("normal_kernel_cuda not implemented for Float8_e4m3fn", seen with
  // transformers 5.17). Keeping it bf16 lets the checkpoint load.
  if (options.multimodal_naming) bf16_modules.push_back("model.visual");
  config.quantization =
      any_fp8 ? Fp8Quantization{.enabled = true, .modules_to_not_convert = bf16_modules}
              : Fp8Quantization{};
  const size_t n = static_cast<size_t>(options.num_shards);
  if (n > items.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("WriteHfCheckpoint: ", n, " shards for ", items.size(), " tensors"));
  }

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  const fs::path root(dir);
  std::string config_json = config.ToJson();
  absl::StrReplaceAll({{"\"bfloat16\"", Quote(TorchDTypeName(options.dtype))}}, &config_json);
  DF_RETURN_IF_ERROR(WriteText(root / "config.json", config_json));
  // A stale file of the other layout would shadow this one for some readers.
  fs::remove(root / (n == 1 ? kIndexFile : kSingleFile), ec);

  // Contiguous runs of tensors, split where the running byte count crosses
  // each 1/n of the total; every shard gets at least one tensor.
  uint64_t total = 0;
  for (const Item& it : items) total += it.out_bytes;
  std::vector<size_t> shard_of(items.size());
  size_t s = 0;
  uint64_t running = 0;
  for (size_t k = 0; k < items.size(); ++k) {
    shard_of[k] = s;
    running += items[k].out_bytes;
    const size_t tensors_left = items.size() - 1 - k;
    const size_t shards_left = n - 1 - s;
    if (shards_left > 0 && (tensors_left == shards_left || running * n >= (s + 1) * total)) ++s;
  }

  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  std::vector<std::string> file_names;
  for (size_t shard = 0; shard < n; ++shard) {
    file_names.push_back(n == 1 ? std::string(kSingleFile)
                                : absl::StrFormat("model-%05d-of-%05d.safetensors", shard + 1, n));
    std::vector<std::vector<std::byte>> buffers;
    std::vector<SafetensorsTensor> entries;
    for (size_t k = 0; k < items.size(); ++k) {
      if (shard_of[k] != shard) continue;
      buffers.emplace_back();
      entries.push_back(Convert(items[k], buffers.back()));
    }
    DF_RETURN_IF_ERROR(WriteSafetensors((root / file_names.back()).string(), entries, metadata));
  }
  if (n == 1) return absl::OkStatus();

  std::vector<std::string> weight_map;
  for (size_t k = 0; k < items.size(); ++k) {
    weight_map.push_back(
        absl::StrCat("    ", Quote(items[k].name), ": ", Quote(file_names[shard_of[k]])));
  }
  const std::string index =
      absl::StrCat("{\n  \"metadata\": {\n    \"total_size\": ", total,
                   "\n  },\n  \"weight_map\": {\n", absl::StrJoin(weight_map, ",\n"), "\n  }\n}\n");
  return WriteText(root / kIndexFile, index);
}

}  // namespace draftfeed
