// LoadModel / WriteHfCheckpoint / ComputeFingerprint on small models built
// here, with tensor names and shapes spelled out from the HF checkpoints
// (model.language_model. / model. prefixes, q_proj's per-head query|gate
// rows) rather than taken from the loader's own tables. One file past ~600
// lines because every test, the fingerprint's too, reads and writes
// checkpoints built by the same independent spelling of the HF layout above
// its tests; apart, that spelling would be a fixture header of its own.
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"

namespace draftfeed {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr LayerKind kLin = LayerKind::kLinearAttention;
constexpr LayerKind kFull = LayerKind::kFullAttention;

ModelConfig TinyHybrid() {
  ModelConfig c;
  c.SetArch(Arch::kQwen35Hybrid);
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e7;
  c.partial_rotary_factor = 0.5;
  c.tie_word_embeddings = false;
  c.linear_conv_kernel = 4;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 8;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.layer_types = {kLin, kFull, kLin, kFull};
  return c;
}

ModelConfig TinyDense() {
  ModelConfig c;
  c.SetArch(Arch::kQwen3Dense);
  c.vocab_size = 64;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 1e6;
  c.partial_rotary_factor = 1.0;
  c.tie_word_embeddings = true;
  c.layer_types = {kFull, kFull};
  return c;
}

// Every tensor of a model with its HF checkpoint name (decoder prefix given).
std::vector<std::pair<std::string, Tensor*>> Named(Model& m, const std::string& prefix,
                                                   const std::string& head = "lm_head.weight") {
  std::vector<std::pair<std::string, Tensor*>> out;
  ModelWeights& w = m.weights;
  out.emplace_back(prefix + "embed_tokens.weight", &w.embed_tokens);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    LayerWeights& l = w.layers[i];
    const std::string p = absl::StrCat(prefix, "layers.", i, ".");
    out.emplace_back(p + "input_layernorm.weight", &l.input_layernorm);
    out.emplace_back(p + "post_attention_layernorm.weight", &l.post_attention_layernorm);
    out.emplace_back(p + "mlp.gate_proj.weight", &l.gate_proj);
    out.emplace_back(p + "mlp.up_proj.weight", &l.up_proj);
    out.emplace_back(p + "mlp.down_proj.weight", &l.down_proj);
    if (l.kind == kFull) {
      out.emplace_back(p + "self_attn.q_proj.weight", &l.q_proj);
      out.emplace_back(p + "self_attn.k_proj.weight", &l.k_proj);
      out.emplace_back(p + "self_attn.v_proj.weight", &l.v_proj);
      out.emplace_back(p + "self_attn.o_proj.weight", &l.o_proj);
      out.emplace_back(p + "self_attn.q_norm.weight", &l.q_norm);
      out.emplace_back(p + "self_attn.k_norm.weight", &l.k_norm);
    } else {
      out.emplace_back(p + "linear_attn.in_proj_qkv.weight", &l.in_proj_qkv);
      out.emplace_back(p + "linear_attn.in_proj_z.weight", &l.in_proj_z);
      out.emplace_back(p + "linear_attn.in_proj_b.weight", &l.in_proj_b);
      out.emplace_back(p + "linear_attn.in_proj_a.weight", &l.in_proj_a);
      out.emplace_back(p + "linear_attn.conv1d.weight", &l.conv1d);
      out.emplace_back(p + "linear_attn.A_log", &l.A_log);
      out.emplace_back(p + "linear_attn.dt_bias", &l.dt_bias);
      out.emplace_back(p + "linear_attn.norm.weight", &l.norm);
      out.emplace_back(p + "linear_attn.out_proj.weight", &l.out_proj);
    }
  }
  out.emplace_back(prefix + "norm.weight", &w.norm);
  if (!m.config.tie_word_embeddings) out.emplace_back(head, &w.lm_head);
  return out;
}

// A model with random weights in `dtype`, HF checkpoint shapes from the config.
std::unique_ptr<Model> BuildModel(const ModelConfig& c, DType dtype, uint32_t seed) {
  auto buffers = std::make_shared<std::vector<std::vector<std::byte>>>();
  std::mt19937 rng(seed);  // its output sequence is fixed by the standard
  auto make = [&](std::vector<int64_t> shape) {
    Tensor t;
    t.dtype = dtype;
    t.shape = std::move(shape);
    auto& buf = buffers->emplace_back(t.nbytes());
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float v = static_cast<float>(static_cast<int32_t>(rng() >> 8) - (1 << 23)) / (1 << 24);
      if (dtype == DType::kF32) {
        std::memcpy(buf.data() + 4 * i, &v, 4);
      } else {
        const uint16_t h = dtype == DType::kBF16 ? FloatToBf16(v) : FloatToFp16(v);
        std::memcpy(buf.data() + 2 * i, &h, 2);
      }
    }
    t.data = buf.data();
    return t;
  };
  auto m = std::make_unique<Model>();
  m->id = "test";
  m->config = c;
  const int64_t D = c.hidden_size, F = c.intermediate_size, hd = c.head_dim;
  const int64_t nk = c.linear_num_key_heads, dk = c.linear_key_head_dim;
  const int64_t nv = c.linear_num_value_heads, dv = c.linear_value_head_dim;
  const int64_t conv = 2 * nk * dk + nv * dv;
  ModelWeights& w = m->weights;
  w.embed_tokens = make({c.vocab_size, D});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    LayerWeights& l = w.layers.emplace_back();
    l.kind = c.layer_types[static_cast<size_t>(i)];
    l.input_layernorm = make({D});
    l.post_attention_layernorm = make({D});
    if (l.kind == kFull) {
      l.q_proj = make({c.num_heads * hd * (c.features.gated_attention ? 2 : 1), D});
      l.k_proj = make({c.num_kv_heads * hd, D});
      l.v_proj = make({c.num_kv_heads * hd, D});
      l.o_proj = make({D, c.num_heads * hd});
      l.q_norm = make({hd});
      l.k_norm = make({hd});
    } else {
      l.in_proj_qkv = make({conv, D});
      l.in_proj_z = make({nv * dv, D});
      l.in_proj_b = make({nv, D});
      l.in_proj_a = make({nv, D});
      l.conv1d = make({conv, 1, c.linear_conv_kernel});
      l.A_log = make({nv});
      l.dt_bias = make({nv});
      l.norm = make({dv});
      l.out_proj = make({D, nv * dv});
    }
    l.gate_proj = make({F, D});
    l.up_proj = make({F, D});
    l.down_proj = make({D, F});
  }
  w.norm = make({D});
  w.lm_head = c.tie_word_embeddings ? w.embed_tokens : make({c.vocab_size, D});
  m->storage = buffers;
  m->fingerprint = ComputeFingerprint(*m);
  return m;
}

SafetensorsTensor Entry(const std::string& name, const Tensor& t) {
  SafetensorsTensor e;
  e.name = name;
  e.dtype = std::string(DTypeName(t.dtype));
  e.shape = t.shape;
  e.data = t.data;
  e.nbytes = t.nbytes();
  return e;
}

std::vector<SafetensorsTensor> Entries(Model& m, const std::string& prefix,
                                       const std::string& head = "lm_head.weight") {
  std::vector<SafetensorsTensor> out;
  for (const auto& [name, t] : Named(m, prefix, head)) out.push_back(Entry(name, *t));
  return out;
}

bool SameBytes(const Tensor& a, const Tensor& b) {
  return a.dtype == b.dtype && a.shape == b.shape && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

void ExpectSameWeights(Model& want, Model& got) {
  auto a = Named(want, "");
  auto b = Named(got, "");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(b[i].second->valid()) << b[i].first;
    EXPECT_TRUE(SameBytes(*a[i].second, *b[i].second)) << a[i].first;
  }
}

void ExpectSameValues(Model& want, Model& got, DType got_dtype) {
  auto a = Named(want, "");
  auto b = Named(got, "");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(b[i].second->dtype, got_dtype) << b[i].first;
    EXPECT_EQ(a[i].second->shape, b[i].second->shape) << b[i].first;
    EXPECT_EQ(ToFloat(*a[i].second), ToFloat(*b[i].second)) << b[i].first;
  }
}

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::path(::testing::TempDir()) / "loader_test" / info->name();
    fs::remove_all(root_);
    fs::create_directories(root_);
  }

  std::string Dir(const std::string& name) const { return (root_ / name).string(); }

  // A checkpoint written by hand: config.json from `config` and one
  // model.safetensors holding exactly `entries`.
  std::string WriteByHand(const std::string& name, const ModelConfig& config,
                          const std::vector<SafetensorsTensor>& entries) {
    const std::string dir = Dir(name);
    fs::create_directories(dir);
    WriteFile(fs::path(dir) / "config.json", config.ToJson());
    EXPECT_TRUE(WriteSafetensors((fs::path(dir) / "model.safetensors").string(), entries,
                                 {{"format", "pt"}})
                    .ok());
    return dir;
  }

  std::string LoadError(const std::string& dir) {
    auto m = LoadModel(dir);
    EXPECT_FALSE(m.ok());
    return m.ok() ? "" : std::string(m.status().message());
  }

  fs::path root_;
};

TEST_F(LoaderTest, SingleFileRoundTripBf16) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 1);
  const std::string dir = Dir("single");
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, {}).ok());
  EXPECT_TRUE(fs::exists(fs::path(dir) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  EXPECT_THAT(ReadFile(fs::path(dir) / "config.json"), HasSubstr("\"Qwen3_5ForCausalLM\""));

  auto got = LoadModel(dir);
  ASSERT_TRUE(got.ok()) << got.status();
  Model& m = **got;
  EXPECT_EQ(m.id, dir);
  EXPECT_FALSE(m.config.multimodal);
  EXPECT_EQ(m.config.layer_types, TinyHybrid().layer_types);
  EXPECT_EQ(m.config.partial_rotary_factor, 0.5);
  EXPECT_EQ(m.config.rope_theta, 1e7);
  ASSERT_EQ(m.weights.layers.size(), 4u);
  EXPECT_EQ(m.weights.layers[0].kind, kLin);
  EXPECT_EQ(m.weights.layers[1].kind, kFull);
  EXPECT_EQ(m.weights.layers[1].q_proj.shape, (std::vector<int64_t>{64, 32}));  // 4 x 8 x 2
  EXPECT_EQ(m.weights.layers[0].conv1d.shape, (std::vector<int64_t>{64, 1, 4}));
  EXPECT_NE(m.weights.lm_head.data, m.weights.embed_tokens.data);
  ExpectSameWeights(*src, m);
  EXPECT_EQ(m.fingerprint, src->fingerprint);
  EXPECT_EQ(m.fingerprint.size(), 32u);

  // The mappings outlive the files.
  fs::remove_all(dir);
  EXPECT_EQ(ToFloat(m.weights.norm), ToFloat(src->weights.norm));
}

TEST_F(LoaderTest, ShardedMultimodalF32) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 2);
  const std::string dir = Dir("sharded");
  HfWriteOptions opts;
  opts.multimodal_naming = true;
  opts.num_shards = 3;
  opts.dtype = DType::kF32;
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, opts).ok());
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors"));
  for (int i = 1; i <= 3; ++i) {
    EXPECT_TRUE(fs::exists(fs::path(dir) / absl::StrCat("model-0000", i, "-of-00003.safetensors")));
  }
  const std::string index = ReadFile(fs::path(dir) / "model.safetensors.index.json");
  EXPECT_THAT(index, HasSubstr("\"total_size\": "));
  EXPECT_THAT(index, HasSubstr("\"model.language_model.layers.0.linear_attn.A_log\": "
                               "\"model-00001-of-00003.safetensors\""));
  EXPECT_THAT(index, HasSubstr("\"lm_head.weight\": \"model-00003-of-00003.safetensors\""));
  const std::string config = ReadFile(fs::path(dir) / "config.json");
  EXPECT_THAT(config, HasSubstr("\"Qwen3_5ForConditionalGeneration\""));
  EXPECT_THAT(config, HasSubstr("\"torch_dtype\": \"float32\""));

  auto got = LoadModel(dir);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE((*got)->config.multimodal);
  ExpectSameValues(*src, **got, DType::kF32);
  EXPECT_NE((*got)->fingerprint, src->fingerprint);  // the dtype differs

  // Same f32 bytes under the other naming and one file: same fingerprint.
  const std::string dir2 = Dir("resaved");
  opts.multimodal_naming = false;
  opts.num_shards = 1;
  ASSERT_TRUE(WriteHfCheckpoint(**got, dir2, opts).ok());
  auto again = LoadModel(dir2);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->fingerprint, (*got)->fingerprint);
  ExpectSameWeights(**got, **again);
}

TEST_F(LoaderTest, Float16AndDenseTied) {
  auto src = BuildModel(TinyDense(), DType::kBF16, 3);
  const std::string dir = Dir("dense");
  HfWriteOptions opts;
  opts.dtype = DType::kF16;
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, opts).ok());
  auto f = SafetensorsFile::Open((fs::path(dir) / "model.safetensors").string());
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->Find("lm_head.weight"), nullptr);  // tied: not written
  EXPECT_EQ(f->metadata().at("format"), "pt");
  EXPECT_THAT(ReadFile(fs::path(dir) / "config.json"), HasSubstr("\"Qwen3ForCausalLM\""));

  auto got = LoadModel(dir);
  ASSERT_TRUE(got.ok()) << got.status();
  const Model& m = **got;
  EXPECT_EQ(m.config.arch, Arch::kQwen3Dense);
  EXPECT_EQ(m.weights.layers[0].q_proj.shape, (std::vector<int64_t>{32, 32}));  // no gate rows
  EXPECT_EQ(m.weights.lm_head.data, m.weights.embed_tokens.data);
  EXPECT_EQ(m.weights.embed_tokens.dtype, DType::kF16);
}

TEST_F(LoaderTest, AcceptsEveryPrefixAndSkipsMtpAndVision) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 4);
  const std::vector<int64_t> junk = {1, 2, 3, 4};
  SafetensorsTensor mtp;
  mtp.name = "mtp.layers.0.self_attn.q_proj.weight";
  mtp.dtype = "BF16";
  mtp.shape = {2, 4};
  mtp.data = reinterpret_cast<const std::byte*>(junk.data());
  mtp.nbytes = 16;
  // An integer dtype that the loader would refuse if it did not skip these.
  SafetensorsTensor visual = mtp;
  visual.name = "model.visual.blocks.0.attn.qkv.weight";
  visual.dtype = "I64";
  visual.shape = {4};
  visual.nbytes = 32;
  SafetensorsTensor visual2 = visual;
  visual2.name = "visual.merger.linear_fc1.bias";

  struct Case {
    std::string prefix, head;
  };
  for (const Case& c :
       {Case{"model.", "lm_head.weight"}, Case{"model.language_model.", "lm_head.weight"},
        Case{"language_model.model.", "language_model.lm_head.weight"}}) {
    SCOPED_TRACE(c.prefix);
    auto entries = Entries(*src, c.prefix, c.head);
    entries.push_back(mtp);
    entries.push_back(visual);
    entries.push_back(visual2);
    const std::string dir =
        WriteByHand("p" + std::to_string(c.prefix.size()), src->config, entries);
    auto got = LoadModel(dir);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameWeights(*src, **got);
    EXPECT_EQ((*got)->fingerprint, src->fingerprint);
  }
}

TEST_F(LoaderTest, MissingTensor) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 5);
  auto entries = Entries(*src, "model.");
  std::erase_if(entries,
                [](const auto& e) { return e.name == "model.layers.2.linear_attn.A_log"; });
  const std::string dir = WriteByHand("missing", src->config, entries);
  EXPECT_EQ(LoadError(dir), "checkpoint " + dir +
                                ": missing tensor model.layers.2.linear_attn.A_log (looked in "
                                "model.safetensors)");
}

TEST_F(LoaderTest, MissingTensorInShardedCheckpointNamesShards) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 5);
  const std::string dir = Dir("sharded_missing");
  HfWriteOptions opts;
  opts.num_shards = 2;
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, opts).ok());
  // Drop the tensor from the index and from its shard.
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::string text = ReadFile(index);
  const std::string line = "    \"model.norm.weight\": \"model-00002-of-00002.safetensors\",\n";
  ASSERT_THAT(text, HasSubstr(line));
  absl::StrReplaceAll({{line, ""}}, &text);
  WriteFile(index, text);
  const std::string shard = (fs::path(dir) / "model-00002-of-00002.safetensors").string();
  auto f = SafetensorsFile::Open(shard);
  ASSERT_TRUE(f.ok());
  std::vector<SafetensorsTensor> kept;
  for (const auto& [name, t] : f->tensors()) {
    if (name != "model.norm.weight") kept.push_back(t);
  }
  ASSERT_TRUE(WriteSafetensors(shard + ".new", kept, {}).ok());
  fs::rename(shard + ".new", shard);
  EXPECT_EQ(LoadError(dir), "checkpoint " + dir +
                                ": missing tensor model.norm.weight (looked in "
                                "model-00001-of-00002.safetensors, "
                                "model-00002-of-00002.safetensors)");
}

TEST_F(LoaderTest, IndexPointsAtWrongShard) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 6);
  const std::string dir = Dir("wrong_shard");
  HfWriteOptions opts;
  opts.num_shards = 3;
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, opts).ok());
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::string text = ReadFile(index);
  const std::string from = "\"model.embed_tokens.weight\": \"model-00001-of-00003.safetensors\"";
  ASSERT_THAT(text, HasSubstr(from));
  absl::StrReplaceAll(
      {{from, "\"model.embed_tokens.weight\": \"model-00003-of-00003.safetensors\""}}, &text);
  WriteFile(index, text);
  EXPECT_EQ(LoadError(dir), "checkpoint " + dir +
                                ": missing tensor model.embed_tokens.weight (looked in "
                                "model-00003-of-00003.safetensors)");
}

TEST_F(LoaderTest, WrongShape) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 7);
  auto entries = Entries(*src, "model.");
  for (auto& e : entries) {
    if (e.name == "model.layers.3.self_attn.k_proj.weight") {
      e.shape = {8, 32};
      e.nbytes = 8 * 32 * 2;
    }
  }
  const std::string dir = WriteByHand("shape", src->config, entries);
  EXPECT_EQ(LoadError(dir),
            "checkpoint " + dir +
                ": tensor model.layers.3.self_attn.k_proj.weight has shape [8, 32], "
                "expected [16, 32] (from config.json: num_key_value_heads=2, "
                "head_dim=8, hidden_size=32)");

  entries = Entries(*src, "model.");
  for (auto& e : entries) {
    if (e.name == "lm_head.weight") {
      e.shape = {32, 64};
    }
  }
  const std::string dir2 = WriteByHand("head_shape", src->config, entries);
  EXPECT_EQ(LoadError(dir2), "checkpoint " + dir2 +
                                 ": tensor lm_head.weight has shape [32, 64], expected [64, 32] "
                                 "(from config.json: vocab_size=64, hidden_size=32)");
}

TEST_F(LoaderTest, TruncatedShard) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 8);
  const std::string dir = Dir("truncated");
  HfWriteOptions opts;
  opts.num_shards = 3;
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, opts).ok());
  const std::string shard = (fs::path(dir) / "model-00002-of-00003.safetensors").string();
  fs::resize_file(shard, fs::file_size(shard) - 6);
  const std::string err = LoadError(dir);
  EXPECT_THAT(err, HasSubstr("safetensors file " + shard + ": tensor model.layers."));
  EXPECT_THAT(err, HasSubstr("run past the end of the data section"));
  EXPECT_THAT(err, HasSubstr("file truncated?"));
}

TEST_F(LoaderTest, HeaderLiesAboutOffsets) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 9);
  const std::string dir = Dir("lying");
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, {}).ok());
  // Rewrite the header so model.norm.weight claims the bytes of another tensor.
  const fs::path file = fs::path(dir) / "model.safetensors";
  const std::string bytes = ReadFile(file);
  uint64_t len = 0;
  std::memcpy(&len, bytes.data(), 8);
  std::string header = bytes.substr(8, len);
  const std::string data = bytes.substr(8 + len);
  const size_t at = header.find("\"model.norm.weight\"");
  ASSERT_NE(at, std::string::npos);
  const size_t off = header.find("\"data_offsets\":[", at) + 16;
  const size_t close = header.find(']', off);
  header.replace(off, close - off, "0,64");
  std::string out(8, '\0');
  const uint64_t new_len = header.size();
  std::memcpy(out.data(), &new_len, 8);
  WriteFile(file, out + header + data);
  EXPECT_THAT(LoadError(dir),
              HasSubstr("safetensors file " + file.string() +
                        ": tensor model.embed_tokens.weight [0, 4096) overlaps tensor "
                        "model.norm.weight [0, 64)"));
}

TEST_F(LoaderTest, UnknownArchitecture) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 10);
  const std::string dir = Dir("arch");
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, {}).ok());
  const fs::path config = fs::path(dir) / "config.json";
  std::string text = ReadFile(config);
  absl::StrReplaceAll({{"Qwen3_5ForCausalLM", "MambaForCausalLM"}}, &text);
  WriteFile(config, text);
  EXPECT_EQ(LoadError(dir), config.string() +
                                ": unsupported architecture \"MambaForCausalLM\"; supported: "
                                "Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM, "
                                "Qwen3ForCausalLM, Qwen3_5MoeForConditionalGeneration, "
                                "Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM");
}

TEST_F(LoaderTest, MissingShard) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 11);
  const std::string dir = Dir("no_shard");
  HfWriteOptions opts;
  opts.num_shards = 3;
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, opts).ok());
  fs::remove(fs::path(dir) / "model-00002-of-00003.safetensors");
  auto m = LoadModel(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(m.status().message(), HasSubstr("checkpoint " + dir +
                                              ": shard model-00002-of-00003.safetensors (listed in "
                                              "model.safetensors.index.json for model.layers."));
  EXPECT_THAT(m.status().message(), HasSubstr(") does not exist"));
}

TEST_F(LoaderTest, BadDtype) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 12);
  auto entries = Entries(*src, "model.");
  const std::vector<int32_t> ints(4, 7);
  for (auto& e : entries) {
    if (e.name == "model.layers.0.linear_attn.dt_bias") {
      e.dtype = "I32";
      e.data = reinterpret_cast<const std::byte*>(ints.data());
      e.nbytes = 16;
    }
  }
  const std::string dir = WriteByHand("dtype", src->config, entries);
  EXPECT_EQ(LoadError(dir), "checkpoint " + dir +
                                ": tensor model.layers.0.linear_attn.dt_bias in model.safetensors "
                                "has dtype I32; only BF16, F16, F32 and F8_E4M3 are supported");
}

TEST_F(LoaderTest, UnexpectedTensors) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 13);
  const Tensor& up = src->weights.layers[0].up_proj;
  const Tensor& q = src->weights.layers[1].q_proj;
  struct Case {
    SafetensorsTensor extra;
    std::string want;
  };
  const Case cases[] = {
      {Entry("model.layers.4.mlp.up_proj.weight", up),
       "unexpected tensor model.layers.4.mlp.up_proj.weight in model.safetensors (layer 4 >= "
       "num_hidden_layers=4 from config.json)"},
      {Entry("model.layers.0.self_attn.q_proj.weight", q),
       "unexpected tensor model.layers.0.self_attn.q_proj.weight in model.safetensors (layer 0 "
       "is linear_attention in config.json)"},
      {Entry("model.layers.1.mlp.up_proj.bias", up),
       "unexpected tensor model.layers.1.mlp.up_proj.bias in model.safetensors"},
      {Entry("model.layers.1.linear_attn.A_log", src->weights.layers[0].A_log),
       "unexpected tensor model.layers.1.linear_attn.A_log in model.safetensors (layer 1 is "
       "full_attention in config.json)"},
      {Entry("model.rotary_emb.inv_freq", up),
       "unexpected tensor model.rotary_emb.inv_freq in model.safetensors"},
      {Entry("score.weight", up), "unexpected tensor score.weight in model.safetensors"},
      {Entry("model.language_model.norm.weight", src->weights.norm),
       "tensor model.language_model.norm.weight uses the prefix model.language_model. but others "
       "use model."},
  };
  int n = 0;
  for (const Case& c : cases) {
    auto entries = Entries(*src, "model.");
    entries.push_back(c.extra);
    const std::string dir = WriteByHand("extra" + std::to_string(n++), src->config, entries);
    EXPECT_EQ(LoadError(dir), "checkpoint " + dir + ": " + c.want);
  }
}

TEST_F(LoaderTest, MissingFilesAndPaths) {
  const std::string nowhere = Dir("does_not_exist");
  auto m = LoadModel(nowhere);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m.status().message(), "checkpoint " + nowhere + " does not exist");

  m = OpenModel(nowhere);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  // Every built-in model is listed, in the table's order.
  std::string builtins;
  for (const BuiltinModel& b : BuiltinModels()) {
    builtins += (builtins.empty() ? "" : ", ") + b.spec;
  }
  EXPECT_EQ(m.status().message(), "model " + nowhere +
                                      " not found: no such checkpoint directory, and not a "
                                      "built-in model (" +
                                      builtins + ")");
  EXPECT_NE(builtins.find("tiny-random[:SEED], tiny-random-qwen3[:SEED], tiny-random-8l[:SEED], "),
            std::string::npos);
  EXPECT_NE(builtins.find("random:qwen3-8b[:SEED], NAME-fp8[:SEED]"), std::string::npos);

  const std::string empty = Dir("empty");
  fs::create_directories(empty);
  m = LoadModel(empty);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m.status().message(), "checkpoint " + empty + ": no config.json");

  WriteFile(fs::path(empty) / "config.json", TinyHybrid().ToJson());
  m = LoadModel(empty);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m.status().message(), "checkpoint " + empty +
                                      ": found neither model.safetensors nor "
                                      "model.safetensors.index.json");

  WriteFile(fs::path(empty) / "model.safetensors.index.json", "{\"metadata\": {}}");
  EXPECT_EQ(LoadError(empty),
            "checkpoint " + empty + ": model.safetensors.index.json has no \"weight_map\" object");
  WriteFile(fs::path(empty) / "model.safetensors.index.json",
            R"({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}})");
  EXPECT_EQ(LoadError(empty), "checkpoint " + empty +
                                  ": model.safetensors.index.json: weight_map entry "
                                  "model.norm.weight names \"../elsewhere.safetensors\", which is "
                                  "not a file in the checkpoint directory");
}

TEST_F(LoaderTest, WriterRejectsBadOptions) {
  auto src = BuildModel(TinyDense(), DType::kBF16, 14);
  HfWriteOptions opts;
  opts.num_shards = 100;
  EXPECT_EQ(WriteHfCheckpoint(*src, Dir("w"), opts).message(),
            "WriteHfCheckpoint: 100 shards for 24 tensors");
  opts.num_shards = 0;
  EXPECT_EQ(WriteHfCheckpoint(*src, Dir("w"), opts).message(),
            "WriteHfCheckpoint: num_shards must be at least 1, got 0");
  opts.num_shards = 1;
  src->weights.layers[1].k_norm = Tensor();
  EXPECT_EQ(WriteHfCheckpoint(*src, Dir("w"), opts).message(),
            "WriteHfCheckpoint: model test tensor layers.1.self_attn.k_norm.weight is missing, "
            "expected shape [8]");
}

TEST_F(LoaderTest, RewritingLayoutRemovesTheStaleOne) {
  auto src = BuildModel(TinyHybrid(), DType::kBF16, 15);
  const std::string dir = Dir("relayout");
  HfWriteOptions opts;
  opts.num_shards = 2;
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, opts).ok());
  opts.num_shards = 1;
  ASSERT_TRUE(WriteHfCheckpoint(*src, dir, opts).ok());
  EXPECT_FALSE(fs::exists(fs::path(dir) / "model.safetensors.index.json"));
  auto got = LoadModel(dir);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)->fingerprint, src->fingerprint);
}

TEST_F(LoaderTest, MisalignedTensorsAreCopied) {
  auto src = BuildModel(TinyHybrid(), DType::kF32, 16);
  // One skipped byte first leaves every F32 tensor after it at an odd address.
  const uint8_t pad = 0;
  SafetensorsTensor odd;
  odd.name = "model.visual.pad";
  odd.dtype = "U8";
  odd.shape = {1};
  odd.data = reinterpret_cast<const std::byte*>(&pad);
  odd.nbytes = 1;
  std::vector<SafetensorsTensor> entries = {odd};
  for (const auto& e : Entries(*src, "model.")) entries.push_back(e);
  const std::string dir = WriteByHand("misaligned", src->config, entries);
  auto got = LoadModel(dir);
  ASSERT_TRUE(got.ok()) << got.status();
  for (const auto& [name, t] : Named(**got, "")) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % 4, 0u) << name;
  }
  ExpectSameWeights(*src, **got);
}

TEST_F(LoaderTest, SingleFileWinsOverIndex) {
  auto a = BuildModel(TinyHybrid(), DType::kBF16, 17);
  auto b = BuildModel(TinyHybrid(), DType::kBF16, 18);
  const std::string dir = Dir("both");
  HfWriteOptions sharded;
  sharded.num_shards = 2;
  ASSERT_TRUE(WriteHfCheckpoint(*a, dir, sharded).ok());
  ASSERT_TRUE(WriteSafetensors((fs::path(dir) / "model.safetensors").string(),
                               Entries(*b, "model."), {{"format", "pt"}})
                  .ok());
  auto got = LoadModel(dir);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)->fingerprint, b->fingerprint);
}

// --- fingerprint ------------------------------------------------------------

TEST(FingerprintTest, StableAndSensitive) {
  auto a = BuildModel(TinyHybrid(), DType::kBF16, 1);
  auto b = BuildModel(TinyHybrid(), DType::kBF16, 1);
  EXPECT_EQ(a->fingerprint, b->fingerprint);
  // Pinned: a change here breaks every client that stored a fingerprint.
  EXPECT_EQ(a->fingerprint, "45816dca3e02bfb5bd558c45f088bf3f");

  // One weight byte.
  auto* bytes = const_cast<std::byte*>(b->weights.layers[2].dt_bias.data);
  bytes[1] ^= std::byte{1};
  EXPECT_NE(ComputeFingerprint(*b), a->fingerprint);
  bytes[1] ^= std::byte{1};
  EXPECT_EQ(ComputeFingerprint(*b), a->fingerprint);

  // Config fields the maths reads; not the naming layout.
  b->config.rope_theta = 1e6;
  EXPECT_NE(ComputeFingerprint(*b), a->fingerprint);
  b->config.rope_theta = 1e7;
  b->config.rms_norm_eps = 1e-5;
  EXPECT_NE(ComputeFingerprint(*b), a->fingerprint);
  b->config.rms_norm_eps = 1e-6;
  b->config.multimodal = true;
  EXPECT_EQ(ComputeFingerprint(*b), a->fingerprint);

  // Same values, other dtype.
  auto f32 = BuildModel(TinyHybrid(), DType::kF32, 1);
  EXPECT_NE(f32->fingerprint, a->fingerprint);
  // Another seed.
  EXPECT_NE(BuildModel(TinyHybrid(), DType::kBF16, 2)->fingerprint, a->fingerprint);
}

TEST(FingerprintTest, LargeModelsAreSampled) {
  auto m = BuildModel(TinyDense(), DType::kBF16, 1);
  // An 80 MiB embedding pushes the decoder over the whole-hash limit.
  const int64_t vocab = int64_t{5} << 18;  // 1.25 Mi rows x 32 x 2 bytes
  std::vector<std::byte> big(static_cast<size_t>(vocab * 32 * 2), std::byte{0});
  m->config.vocab_size = vocab;
  m->weights.embed_tokens.shape = {vocab, 32};
  m->weights.embed_tokens.data = big.data();
  m->weights.lm_head = m->weights.embed_tokens;

  const auto start = std::chrono::steady_clock::now();
  const std::string base = ComputeFingerprint(*m);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 0.5);

  big[10] = std::byte{1};  // inside the first sampled window
  EXPECT_NE(ComputeFingerprint(*m), base);
  big[10] = std::byte{0};
  big[big.size() / 2 + 8192] = std::byte{1};  // between windows: not seen
  EXPECT_EQ(ComputeFingerprint(*m), base);
}

// --- built-in random models (written by another module) -------------------

TEST_F(LoaderTest, RandomModelRoundTrip) {
  auto made = MakeRandomModel("tiny-random:3");
  if (!made.ok() && made.status().code() == absl::StatusCode::kUnimplemented) {
    GTEST_SKIP() << made.status();
  }
  ASSERT_TRUE(made.ok()) << made.status();
  Model& src = **made;
  const DType dtype = src.weights.embed_tokens.dtype;

  HfWriteOptions single;
  single.dtype = dtype;
  ASSERT_TRUE(WriteHfCheckpoint(src, Dir("single"), single).ok());
  auto got = LoadModel(Dir("single"));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameWeights(src, **got);
  EXPECT_EQ((*got)->fingerprint, src.fingerprint);

  HfWriteOptions sharded;
  sharded.multimodal_naming = true;
  sharded.num_shards = 3;
  sharded.dtype = DType::kF32;
  ASSERT_TRUE(WriteHfCheckpoint(src, Dir("sharded"), sharded).ok());
  auto got32 = LoadModel(Dir("sharded"));
  ASSERT_TRUE(got32.ok()) << got32.status();
  EXPECT_TRUE((*got32)->config.multimodal);
  ExpectSameValues(src, **got32, DType::kF32);
  if (dtype == DType::kF32) {
    EXPECT_EQ((*got32)->fingerprint, src.fingerprint);
  } else {
    EXPECT_NE((*got32)->fingerprint, src.fingerprint);
  }

  auto opened = OpenModel("tiny-random:3");
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)->fingerprint, src.fingerprint);
}

// A FIFO in place of config.json would block the read forever: it is refused by name.
TEST_F(LoaderTest, AFifoInPlaceOfTheConfigIsRefused) {
  auto src = OpenModel("tiny-random:3");
  ASSERT_TRUE(src.ok()) << src.status();
  ASSERT_TRUE(WriteHfCheckpoint(**src, Dir("fifo"), {}).ok());
  const fs::path config = fs::path(Dir("fifo")) / "config.json";
  fs::remove(config);
  ASSERT_EQ(mkfifo(config.c_str(), 0600), 0);
  auto got = LoadModel(Dir("fifo"));
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(std::string(got.status().message()), ::testing::HasSubstr("config.json"));
}

}  // namespace
}  // namespace draftfeed
