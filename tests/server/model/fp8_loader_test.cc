// Fine-grained FP8 checkpoints through WriteHfCheckpoint / LoadModel /
// ModelConfig::FromJson / CheckWeightsFinite: every architecture round-trips
// bit for bit (weights, scales, fingerprint), BF16 scales as Qwen ships
// them, transformers 5's fused expert form, and each malformed checkpoint or
// quantization_config refused with a message naming the tensor or field.
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/fp8_e4m3.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/fp8_quantize.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"
#include "server/model/weight_check.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

std::string ReadText(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteText(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

bool SameScales(const Tensor& a, const Tensor& b) {
  if (a.scale_inv.dtype != b.scale_inv.dtype || a.scale_inv.shape != b.scale_inv.shape) {
    return false;
  }
  if (!a.scale_inv.valid()) return !b.scale_inv.valid();
  return std::memcmp(a.scale_inv.data, b.scale_inv.data, a.scale_inv.nbytes()) == 0;
}

void ExpectSameModel(const Model& want, const Model& got) {
  std::vector<WeightSpec> specs = DecoderWeightSpecs(want.config);
  specs.push_back(LmHeadSpec(want.config));
  for (const WeightSpec& s : specs) {
    const Tensor& a = WeightSlot(want.weights, s);
    const Tensor& b = WeightSlot(got.weights, s);
    ASSERT_EQ(a.dtype, b.dtype) << s.name;
    ASSERT_EQ(a.shape, b.shape) << s.name;
    EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes()), 0) << s.name;
    EXPECT_TRUE(SameScales(a, b)) << s.name;
  }
  EXPECT_EQ(got.config.quantization.enabled, want.config.quantization.enabled);
  EXPECT_EQ(got.fingerprint, want.fingerprint);
}

class Fp8LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::path(::testing::TempDir()) / "fp8_loader_test" / info->name();
    fs::remove_all(root_);
    fs::create_directories(root_);
  }

  std::string Dir(const std::string& name) const { return (root_ / name).string(); }

  // Writes `model` as a single-file checkpoint "src" and reads its tensors
  // back as entries that a test edits before WriteByHand.
  void Source(const Model& model) {
    src_ = Dir("src");
    ASSERT_TRUE(WriteHfCheckpoint(model, src_, {}).ok());
    auto f = SafetensorsFile::Open((fs::path(src_) / "model.safetensors").string());
    ASSERT_TRUE(f.ok()) << f.status();
    file_ = std::make_unique<SafetensorsFile>(std::move(*f));
    entries_ = file_->tensors();
    config_ = ReadText(fs::path(src_) / "config.json");
  }

  std::string WriteByHand(const std::string& name) {
    const fs::path dir = Dir(name);
    fs::create_directories(dir);
    WriteText(dir / "config.json", config_);
    std::vector<SafetensorsTensor> list;
    for (const auto& [n, e] : entries_) list.push_back(e);
    EXPECT_TRUE(
        WriteSafetensors((dir / "model.safetensors").string(), list, {{"format", "pt"}}).ok());
    return dir.string();
  }

  std::string LoadError(const std::string& dir) {
    auto m = LoadModel(dir);
    EXPECT_FALSE(m.ok());
    return m.ok() ? "" : std::string(m.status().message());
  }

  fs::path root_;
  std::string src_;
  std::unique_ptr<SafetensorsFile> file_;
  std::map<std::string, SafetensorsTensor> entries_;
  std::string config_;
  std::vector<std::vector<std::byte>> keep_;  // bytes of edited entries
};

TEST_F(Fp8LoaderTest, EveryArchitectureRoundTrips) {
  for (const char* spec : {"tiny-random-fp8:3", "tiny-random-qwen3-fp8:3", "tiny-random-moe-fp8:3",
                           "tiny-random-qwen3-moe-fp8:3"}) {
    auto m = MakeRandomModel(spec);
    ASSERT_TRUE(m.ok()) << m.status();
    for (const bool multimodal : {false, true}) {
      HfWriteOptions opts;
      opts.multimodal_naming = multimodal && (*m)->config.features.linear_attention;
      opts.num_shards = multimodal ? 3 : 1;
      const std::string dir = Dir(absl::StrCat(spec, multimodal ? "-mm" : ""));
      ASSERT_TRUE(WriteHfCheckpoint(**m, dir, opts).ok()) << spec;
      auto got = LoadModel(dir);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectSameModel(**m, **got);
      // Written again from the loaded model: the same files.
      const std::string again = dir + "-again";
      ASSERT_TRUE(WriteHfCheckpoint(**got, again, opts).ok());
      EXPECT_EQ(ReadText(fs::path(dir) / "config.json"), ReadText(fs::path(again) / "config.json"));
    }
  }
}

TEST_F(Fp8LoaderTest, ConfigAndTensorNamesAreTheReleasedOnes) {
  auto m = MakeRandomModel("tiny-random-moe-fp8:1");
  ASSERT_TRUE(m.ok());
  Source(**m);
  EXPECT_THAT(config_, HasSubstr("\"quant_method\": \"fp8\""));
  EXPECT_THAT(config_, HasSubstr("\"fmt\": \"e4m3\""));
  EXPECT_THAT(config_, HasSubstr("\"activation_scheme\": \"dynamic\""));
  EXPECT_THAT(config_, HasSubstr("\"weight_block_size\": [128, 128]"));
  // Every Linear left in bf16, by its full module name.
  EXPECT_THAT(config_, HasSubstr("\"modules_to_not_convert\": [\"lm_head\", "
                                 "\"model.layers.0.linear_attn.in_proj_b\", "
                                 "\"model.layers.0.linear_attn.in_proj_a\", "
                                 "\"model.layers.0.mlp.gate\", "
                                 "\"model.layers.0.mlp.shared_expert_gate\", "));
  const SafetensorsTensor& q = entries_.at("model.layers.3.self_attn.q_proj.weight");
  EXPECT_EQ(q.dtype, "F8_E4M3");
  const SafetensorsTensor& qs = entries_.at("model.layers.3.self_attn.q_proj.weight_scale_inv");
  EXPECT_EQ(qs.dtype, "F32");
  EXPECT_EQ(qs.shape, (std::vector<int64_t>{4, 1}));  // [512, 128]
  const SafetensorsTensor& gate = entries_.at("model.layers.1.mlp.experts.7.gate_proj.weight");
  EXPECT_EQ(gate.dtype, "F8_E4M3");
  EXPECT_EQ(gate.shape, (std::vector<int64_t>{128, 128}));
  EXPECT_EQ(entries_.at("model.layers.1.mlp.experts.7.up_proj.weight_scale_inv").shape,
            (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(entries_.at("model.layers.1.mlp.gate.weight").dtype, "BF16");
  EXPECT_EQ(entries_.count("model.layers.1.mlp.gate.weight_scale_inv"), 0u);
  EXPECT_EQ(entries_.at("model.embed_tokens.weight").dtype, "BF16");
  EXPECT_EQ(entries_.at("lm_head.weight").dtype, "BF16");

  auto back = LoadModel(src_);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ((*back)->config.quantization.modules_to_not_convert.front(), "lm_head");
}

// Qwen's releases store scales in BF16; they load as BF16 and dequantize
// exactly (an e4m3 value times a bf16 scale fits fp32's mantissa).
TEST_F(Fp8LoaderTest, Bf16ScalesAsQwenShipsThem) {
  auto m = MakeRandomModel("tiny-random-qwen3-fp8:5");
  ASSERT_TRUE(m.ok());
  std::vector<std::vector<uint16_t>> bf16_scales;
  for (const WeightSpec& s : DecoderWeightSpecs((*m)->config)) {
    Tensor& t = WeightSlot((*m)->weights, s);
    if (!t.fp8()) continue;
    std::vector<uint16_t>& b = bf16_scales.emplace_back(static_cast<size_t>(t.scale_inv.numel()));
    const float* f = reinterpret_cast<const float*>(t.scale_inv.data);
    for (size_t i = 0; i < b.size(); ++i) b[i] = FloatToBf16(f[i]);
    t.scale_inv.dtype = DType::kBF16;
    t.scale_inv.data = reinterpret_cast<const std::byte*>(b.data());
  }
  (*m)->fingerprint = ComputeFingerprint(**m);
  const std::string dir = Dir("bf16-scales");
  ASSERT_TRUE(WriteHfCheckpoint(**m, dir, {}).ok());
  auto got = LoadModel(dir);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameModel(**m, **got);
  const Tensor& k = (*got)->weights.layers[0].k_proj;  // [64, 128]: one partial block
  ASSERT_EQ(k.scale_inv.dtype, DType::kBF16);
  const std::vector<float> deq = ToFloat(k);
  uint16_t s;
  std::memcpy(&s, k.scale_inv.data, 2);
  for (int64_t i = 0; i < k.numel(); ++i) {
    ASSERT_EQ(deq[i], E4m3ToFloat(static_cast<uint8_t>(k.data[i])) * Bf16ToFloat(s)) << i;
  }
}

// transformers 5 holds FP8 experts fused: gate_up_proj [E, 2I, D] with
// gate_up_proj_scale_inv [E, 2I/128, D/128], down_proj likewise.
TEST_F(Fp8LoaderTest, FusedFp8ExpertsLoadLikePerExpertOnes) {
  auto m = MakeRandomModel("tiny-random-qwen3-moe-fp8:2");
  ASSERT_TRUE(m.ok());
  Source(**m);
  const ModelConfig& c = (*m)->config;
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    if (c.MlpOfLayer(layer) == MlpKind::kDenseSwiGlu) continue;
    const LayerWeights& l = (*m)->weights.layers[static_cast<size_t>(layer)];
    const std::string p = absl::StrCat("model.layers.", layer, ".mlp.experts.");
    for (int64_t e = 0; e < c.num_experts; ++e) {
      for (const char* part : {"gate_proj", "up_proj", "down_proj"}) {
        entries_.erase(absl::StrCat(p, e, ".", part, ".weight"));
        entries_.erase(absl::StrCat(p, e, ".", part, ".weight_scale_inv"));
      }
    }
    for (const auto& [name, t] :
         {std::pair<std::string, const Tensor*>{"gate_up_proj", &l.experts_gate_up},
          {"down_proj", &l.experts_down}}) {
      SafetensorsTensor w{p + name, "F8_E4M3", t->shape, t->data, t->nbytes()};
      SafetensorsTensor s{p + name + "_scale_inv", "F32", t->scale_inv.shape, t->scale_inv.data,
                          t->scale_inv.nbytes()};
      entries_[w.name] = w;
      entries_[s.name] = s;
    }
  }
  auto got = LoadModel(WriteByHand("fused"));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameModel(**m, **got);
}

TEST_F(Fp8LoaderTest, MalformedTensorsAreRefusedByName) {
  auto m = MakeRandomModel("tiny-random-moe-fp8:1");
  ASSERT_TRUE(m.ok());
  Source(**m);
  const auto saved = entries_;
  const std::string q = "model.layers.3.self_attn.q_proj.weight";

  // A scale of the wrong shape.
  entries_[q + "_scale_inv"].shape = {1, 4};
  std::string dir = WriteByHand("shape");
  EXPECT_EQ(LoadError(dir), absl::StrCat("checkpoint ", dir, ": tensor ", q,
                                         "_scale_inv has shape [1, 4], expected [4, 1]: one scale "
                                         "per 128x128 block of ",
                                         q, " [512, 128]"));
  // No scale at all.
  entries_ = saved;
  entries_.erase(q + "_scale_inv");
  dir = WriteByHand("missing");
  EXPECT_EQ(LoadError(dir), absl::StrCat("checkpoint ", dir, ": tensor ", q,
                                         " in model.safetensors is F8_E4M3 but has no scales (", q,
                                         "_scale_inv is missing)"));
  // A per-expert part without its scale.
  entries_ = saved;
  entries_.erase("model.layers.2.mlp.experts.5.up_proj.weight_scale_inv");
  dir = WriteByHand("expert-missing");
  EXPECT_THAT(LoadError(dir), HasSubstr("tensor model.layers.2.mlp.experts.5.up_proj.weight in "
                                        "model.safetensors is F8_E4M3 but has no scales"));
  // The router in FP8: the engines keep it in bf16.
  entries_ = saved;
  const std::string router = "model.layers.0.mlp.gate.weight";
  SafetensorsTensor& r = entries_[router];
  keep_.emplace_back(static_cast<size_t>(r.nbytes / 2), std::byte{0x38});
  r.dtype = "F8_E4M3";
  r.data = keep_.back().data();
  r.nbytes = keep_.back().size();
  static const float kOne = 1.0f;
  entries_[router + "_scale_inv"] = {
      router + "_scale_inv", "F32", {1, 1}, reinterpret_cast<const std::byte*>(&kOne), 4};
  dir = WriteByHand("router");
  EXPECT_EQ(LoadError(dir),
            absl::StrCat("checkpoint ", dir, ": tensor ", router,
                         " in model.safetensors is F8_E4M3, but this tensor stays in bf16 in FP8 "
                         "checkpoints (only the attention, GDN in_proj_qkv/in_proj_z/out_proj, MLP "
                         "and expert projections are quantized)"));
  // Scales beside a bf16 weight.
  entries_ = saved;
  const std::string a = "model.layers.0.linear_attn.in_proj_a.weight";
  entries_[a + "_scale_inv"] = {
      a + "_scale_inv", "F32", {1, 1}, reinterpret_cast<const std::byte*>(&kOne), 4};
  dir = WriteByHand("bf16-with-scale");
  EXPECT_EQ(LoadError(dir), absl::StrCat("checkpoint ", dir, ": tensor ", a,
                                         "_scale_inv in model.safetensors scales ", a,
                                         ", which is BF16, not F8_E4M3; block scales belong to "
                                         "FP8 weights only"));
  // Another format's scale name.
  entries_ = saved;
  const std::string o = "model.layers.3.self_attn.o_proj.weight";
  entries_[o + "_scale"] = {
      o + "_scale", "F32", {1, 1}, reinterpret_cast<const std::byte*>(&kOne), 4};
  dir = WriteByHand("weight-scale");
  EXPECT_THAT(LoadError(dir), HasSubstr("unexpected tensor " + o +
                                        "_scale in model.safetensors (fine-grained FP8 "
                                        "checkpoints name their block scales weight_scale_inv"));
  // F8 weights but no quantization_config.
  entries_ = saved;
  ModelConfig unquantized = (*m)->config;
  unquantized.quantization = Fp8Quantization{};
  const std::string plain = unquantized.ToJson();
  ASSERT_THAT(plain, Not(HasSubstr("quantization_config")));
  config_ = plain;
  dir = WriteByHand("no-config");
  EXPECT_THAT(LoadError(dir),
              HasSubstr("is F8_E4M3, but config.json has no quantization_config (quant_method "
                        "\"fp8\")"));
}

TEST_F(Fp8LoaderTest, Fp8ExpertsNarrowerThanABlockAreRefused) {
  // The bf16 tiny-random-qwen3-moe (experts 64 wide), each expert part
  // quantized on its own and saved per expert.
  auto m = MakeRandomModel("tiny-random-qwen3-moe:1");
  ASSERT_TRUE(m.ok());
  Source(**m);
  std::vector<Fp8Blocks> blocks;
  blocks.reserve(entries_.size());
  for (auto& [name, e] : std::map<std::string, SafetensorsTensor>(entries_)) {
    if (name.find(".mlp.experts.") == std::string::npos) continue;
    Tensor t;
    t.dtype = DType::kBF16;
    t.shape = e.shape;
    t.data = e.data;
    const Fp8Blocks& q = blocks.emplace_back(QuantizeFp8Blocks(t));
    entries_[name] = {name, "F8_E4M3", e.shape, reinterpret_cast<const std::byte*>(q.codes.data()),
                      q.codes.size()};
    const std::string s = name + "_scale_inv";
    entries_[s] = {s, "F32", Fp8ScaleShape(e.shape),
                   reinterpret_cast<const std::byte*>(q.scales.data()), q.scales.size() * 4};
  }
  config_ = absl::StrReplaceAll(
      config_, {{"\n}", ",\n  \"quantization_config\": {\"quant_method\": \"fp8\"}\n}"}});
  const std::string dir = WriteByHand("narrow");
  EXPECT_EQ(LoadError(dir),
            absl::StrCat("checkpoint ", dir,
                         ": layer 0's FP8 experts (model.layers.0.mlp.experts.0.gate_proj.weight) "
                         "cannot be stacked: moe_intermediate_size=64 from config.json is not a "
                         "multiple of the 128-row scale block"));
}

TEST_F(Fp8LoaderTest, QuantizationConfigFieldsAreChecked) {
  auto m = MakeRandomModel("tiny-random-qwen3:0");
  ASSERT_TRUE(m.ok());
  const std::string base = (*m)->config.ToJson();
  auto with = [&](const std::string& quant) {
    return absl::StrReplaceAll(base, {{"\n}", ",\n  \"quantization_config\": " + quant + "\n}"}});
  };
  auto error = [&](const std::string& quant) {
    auto c = ModelConfig::FromJson(with(quant), "config.json");
    return c.ok() ? std::string("ok") : std::string(c.status().message());
  };
  EXPECT_EQ(error(R"({"quant_method": "fp8"})"), "ok");
  auto full = ModelConfig::FromJson(
      with(R"({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", "x.y"]})"),
      "config.json");
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_TRUE(full->quantization.enabled);
  EXPECT_EQ(full->quantization.modules_to_not_convert,
            (std::vector<std::string>{"lm_head", "x.y"}));
  EXPECT_EQ(error(R"({"quant_method": "gptq", "bits": 4})"),
            "config.json: quantization_config.quant_method \"gptq\" is not supported; only "
            "\"fp8\" (fine-grained FP8: e4m3 weights, 128x128 block scales, dynamic activations)");
  EXPECT_THAT(error(R"({"quant_method": "compressed-tensors"})"),
              HasSubstr("quant_method \"compressed-tensors\" is not supported"));
  EXPECT_EQ(error(R"({"fmt": "e4m3"})"),
            "config.json: missing required field quantization_config.quant_method");
  EXPECT_EQ(error(R"({"quant_method": "fp8", "fmt": "e5m2"})"),
            "config.json: quantization_config.fmt \"e5m2\" is not supported; only \"e4m3\"");
  EXPECT_EQ(error(R"({"quant_method": "fp8", "activation_scheme": "static"})"),
            "config.json: quantization_config.activation_scheme \"static\" is not supported; only "
            "\"dynamic\" (per-token activation scales)");
  EXPECT_EQ(error(R"({"quant_method": "fp8", "weight_block_size": [64, 64]})"),
            "config.json: quantization_config.weight_block_size [64, 64] is not supported (only "
            "[128, 128])");
  EXPECT_EQ(error(R"({"quant_method": "fp8", "weight_block_size": [128]})"),
            "config.json: quantization_config.weight_block_size has 1 entries; it must be [rows, "
            "cols] ([128, 128])");
  EXPECT_EQ(error(R"({"quant_method": "fp8", "weight_block_size": [128, "128"]})"),
            "config.json: field quantization_config.weight_block_size[1] must be an integer, got "
            "string");
  EXPECT_EQ(error(R"("fp8")"),
            "config.json: field quantization_config must be an object, got string");

  // Block size 64 in a whole checkpoint.
  Source(**MakeRandomModel("tiny-random-qwen3-fp8:0"));
  config_ = absl::StrReplaceAll(config_, {{"[128, 128]", "[64, 64]"}});
  const std::string dir = WriteByHand("block64");
  EXPECT_EQ(LoadError(dir), absl::StrCat(dir,
                                         "/config.json: quantization_config.weight_block_size "
                                         "[64, 64] is not supported (only [128, 128])"));
}

TEST_F(Fp8LoaderTest, CheckWeightsCoversScalesAndNaNCodes) {
  auto m = MakeRandomModel("tiny-random-fp8:0");
  ASSERT_TRUE(m.ok());
  Model& model = **m;
  EXPECT_TRUE(CheckWeightsFinite(model).ok());
  Tensor& o = model.weights.layers[3].o_proj;  // [128, 256]: scales [1, 2]
  ASSERT_TRUE(o.fp8());
  std::vector<float> scales(2);
  std::memcpy(scales.data(), o.scale_inv.data, 8);
  const BlockScales saved = o.scale_inv;
  o.scale_inv.data = reinterpret_cast<const std::byte*>(scales.data());
  // 3e38 is a finite float, but 448 x 3e38 is not (kMaxFp8BlockScale).
  for (const float bad : {0.0f, -0.5f, std::nanf(""), INFINITY, 3e38f, 4.2e16f}) {
    scales[1] = bad;
    const absl::Status st = CheckWeightsFinite(model);
    EXPECT_EQ(st.message(),
              absl::StrCat("tiny-random-fp8:0: tensor layers.3.self_attn.o_proj.weight_scale_inv "
                           "(F32 [1, 2]) holds ",
                           bad,
                           " at element 1 (index [0, 1]); an FP8 block scale must be finite, > 0 "
                           "and <= ",
                           kMaxFp8BlockScale,
                           " (448 x scale under 2^64, so that the FP8 GEMMs "
                           "cannot overflow to Inf); the checkpoint is corrupt: download or "
                           "convert it again (--check_weights=false starts without this check, "
                           "serving whatever these weights compute)"));
  }
  scales[1] = 4.1e16f;  // under the bound
  EXPECT_TRUE(CheckWeightsFinite(model).ok());
  o.scale_inv = saved;
  std::vector<uint8_t> codes(static_cast<size_t>(o.numel()));
  std::memcpy(codes.data(), o.data, codes.size());
  o.data = reinterpret_cast<const std::byte*>(codes.data());
  for (const uint8_t nan : {0x7f, 0xff}) {
    codes[300] = nan;
    EXPECT_EQ(CheckWeightsFinite(model).message(),
              "tiny-random-fp8:0: tensor layers.3.self_attn.o_proj.weight (F8_E4M3 [128, 256]) "
              "holds NaN at element 300 (index [1, 44]); the checkpoint is corrupt: download or "
              "convert it again (--check_weights=false starts without this check, serving "
              "whatever these weights compute)");
  }
  codes[300] = 0x7e;  // 448, the largest finite code
  codes[301] = 0xfe;  // -448
  EXPECT_TRUE(CheckWeightsFinite(model).ok());
}

}  // namespace
}  // namespace draftfeed
