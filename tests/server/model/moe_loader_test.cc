// LoadModel / WriteHfCheckpoint / ComputeFingerprint on MoE checkpoints: the
// per-expert tensors transformers' save_pretrained writes, the fused
// [E, 2I, D] / [E, D, I] layout built here by hand from them, both weight
// prefixes, skipped MTP / vision tensors, and every malformed expert set.
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int64_t kExperts = 4, kInter = 8, kHidden = 32;

// qwen3_5_moe: one GDN and one attention layer, both MoE with a shared expert.
ModelConfig TinyQwen35Moe() {
  ModelConfig c;
  c.SetArch(Arch::kQwen35Moe);
  c.vocab_size = 64;
  c.hidden_size = kHidden;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.partial_rotary_factor = 0.5;
  c.linear_conv_kernel = 4;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 8;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.layer_types = {LayerKind::kLinearAttention, LayerKind::kFullAttention};
  c.num_experts = kExperts;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = kInter;
  c.shared_expert_intermediate_size = 12;
  return c;
}

// qwen3_moe: layer 0 dense (mlp_only_layers), layer 1 MoE.
ModelConfig TinyQwen3Moe() {
  ModelConfig c;
  c.SetArch(Arch::kQwen3Moe);
  c.vocab_size = 64;
  c.hidden_size = kHidden;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 1e6;
  c.partial_rotary_factor = 1.0;
  c.tie_word_embeddings = true;
  c.layer_types = {LayerKind::kFullAttention, LayerKind::kFullAttention};
  c.num_experts = kExperts;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = kInter;
  c.norm_topk_prob = false;
  c.mlp_only_layers = {0};
  return c;
}

class MoeLoaderTest : public ::testing::Test {
 protected:
  std::string Dir(const std::string& name) {
    const fs::path p = fs::temp_directory_path() / "moe_loader_test" /
                       ::testing::UnitTest::GetInstance()->current_test_info()->name() / name;
    fs::remove_all(p);
    return p.string();
  }

  static std::unique_ptr<Model> Random(const ModelConfig& c, uint64_t seed) {
    absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(c, seed);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? std::move(*m) : nullptr;
  }

  // Writes `m` as a one-file checkpoint in `dir`.
  static void Write(const Model& m, const std::string& dir, bool multimodal = false) {
    HfWriteOptions o;
    o.multimodal_naming = multimodal;
    const absl::Status st = WriteHfCheckpoint(m, dir, o);
    ASSERT_TRUE(st.ok()) << st;
  }

  // Rewrites dir/model.safetensors through `edit`, which may drop, add or
  // replace entries (new data goes into `keep`).
  static void Rewrite(const std::string& dir,
                      const std::function<void(std::map<std::string, SafetensorsTensor>&,
                                               std::vector<std::vector<std::byte>>& keep)>& edit) {
    const std::string path = (fs::path(dir) / "model.safetensors").string();
    absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    std::map<std::string, SafetensorsTensor> tensors = f->tensors();
    std::vector<std::vector<std::byte>> keep;
    keep.reserve(1024);  // entries point into these buffers: no reallocation
    edit(tensors, keep);
    std::vector<SafetensorsTensor> out;
    for (auto& [name, t] : tensors) out.push_back(t);
    const std::string tmp = path + ".tmp";
    ASSERT_TRUE(WriteSafetensors(tmp, out, {{"format", "pt"}}).ok());
    fs::rename(tmp, path);
  }

  // Replaces each MoE layer's per-expert tensors under `prefix` by the fused
  // pair transformers holds in memory: gate_up_proj [E, 2I, D] (expert e's
  // gate rows, then its up rows) and down_proj [E, D, I].
  static void Fuse(std::map<std::string, SafetensorsTensor>& tensors,
                   std::vector<std::vector<std::byte>>& keep, const std::string& prefix,
                   int layer) {
    const std::string base = absl::StrCat(prefix, "layers.", layer, ".mlp.experts.");
    auto take = [&](const std::string& name) {
      auto it = tensors.find(name);
      EXPECT_NE(it, tensors.end()) << name;
      SafetensorsTensor t = it->second;
      tensors.erase(it);
      return t;
    };
    std::vector<std::byte>& gate_up = keep.emplace_back();
    std::vector<std::byte>& down = keep.emplace_back();
    std::string dtype;
    for (int64_t e = 0; e < kExperts; ++e) {
      for (const char* part : {"gate_proj", "up_proj"}) {
        const SafetensorsTensor t = take(absl::StrCat(base, e, ".", part, ".weight"));
        gate_up.insert(gate_up.end(), t.data, t.data + t.nbytes);
        dtype = t.dtype;
      }
      const SafetensorsTensor t = take(absl::StrCat(base, e, ".down_proj.weight"));
      down.insert(down.end(), t.data, t.data + t.nbytes);
    }
    tensors[base + "gate_up_proj"] = {base + "gate_up_proj",
                                      dtype,
                                      {kExperts, 2 * kInter, kHidden},
                                      gate_up.data(),
                                      gate_up.size()};
    tensors[base + "down_proj"] = {
        base + "down_proj", dtype, {kExperts, kHidden, kInter}, down.data(), down.size()};
  }

  static absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& dir) {
    return LoadModel(dir);
  }

  static std::string LoadError(const std::string& dir) {
    absl::StatusOr<std::unique_ptr<Model>> m = LoadModel(dir);
    EXPECT_FALSE(m.ok());
    return m.ok() ? "" : std::string(m.status().message());
  }

  // Every decoder tensor of `b` holds the bytes of `a`'s (both bf16).
  static void ExpectSameWeights(const Model& a, const Model& b) {
    for (const WeightSpec& s : DecoderWeightSpecs(a.config)) {
      const Tensor& x = WeightSlot(a.weights, s);
      const Tensor& y = WeightSlot(b.weights, s);
      ASSERT_EQ(x.shape, y.shape) << s.name;
      ASSERT_EQ(x.dtype, y.dtype) << s.name;
      ASSERT_EQ(std::memcmp(x.data, y.data, x.nbytes()), 0) << s.name;
    }
  }
};

TEST_F(MoeLoaderTest, PerExpertCheckpointsRoundTripBothArchitecturesAndPrefixes) {
  for (const ModelConfig& c : {TinyQwen35Moe(), TinyQwen3Moe()}) {
    for (bool multimodal : {false, true}) {
      if (multimodal && !c.features.linear_attention) continue;  // text_config is Qwen3.5's
      SCOPED_TRACE(absl::StrCat(std::string(ArchName(c.arch)), multimodal ? " multimodal" : ""));
      auto src = Random(c, 5);
      const std::string dir = Dir(absl::StrCat(std::string(ArchName(c.arch)), multimodal));
      Write(*src, dir, multimodal);
      // Written as transformers 5.17 saves: one tensor per expert and part.
      absl::StatusOr<SafetensorsFile> f =
          SafetensorsFile::Open((fs::path(dir) / "model.safetensors").string());
      ASSERT_TRUE(f.ok());
      const std::string p = multimodal ? "model.language_model.layers.1." : "model.layers.1.";
      const SafetensorsTensor* up = f->Find(p + "mlp.experts.3.up_proj.weight");
      ASSERT_NE(up, nullptr);
      EXPECT_EQ(up->shape, (std::vector<int64_t>{kInter, kHidden}));
      EXPECT_EQ(f->Find(p + "mlp.experts.3.down_proj.weight")->shape,
                (std::vector<int64_t>{kHidden, kInter}));
      EXPECT_EQ(f->Find(p + "mlp.gate.weight")->shape, (std::vector<int64_t>{kExperts, kHidden}));
      EXPECT_EQ(f->Find(p + "mlp.experts.gate_up_proj"), nullptr);
      EXPECT_EQ(f->Find(p + "mlp.shared_expert_gate.weight") != nullptr,
                c.features.mlp == MlpKind::kMoeSharedExpert);
      // Expert 3's up rows sit at [I, 2I) of its block of the stacked tensor.
      const Tensor& stacked = src->weights.layers[1].experts_gate_up;
      EXPECT_EQ(
          std::memcmp(up->data, stacked.data + (3 * 2 * kInter + kInter) * kHidden * 2, up->nbytes),
          0);

      auto loaded = Load(dir);
      ASSERT_TRUE(loaded.ok()) << loaded.status();
      EXPECT_EQ((*loaded)->config.num_experts, kExperts);
      ExpectSameWeights(*src, **loaded);
      EXPECT_EQ((*loaded)->fingerprint, src->fingerprint);
    }
  }
}

TEST_F(MoeLoaderTest, FusedExpertLayoutLoadsTheSameModel) {
  for (bool multimodal : {false, true}) {
    auto src = Random(TinyQwen35Moe(), 6);
    const std::string dir = Dir(multimodal ? "mm" : "text");
    Write(*src, dir, multimodal);
    const std::string prefix = multimodal ? "model.language_model." : "model.";
    Rewrite(dir, [&](auto& tensors, auto& keep) {
      Fuse(tensors, keep, prefix, 0);
      Fuse(tensors, keep, prefix, 1);
    });
    auto loaded = Load(dir);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ExpectSameWeights(*src, **loaded);
    EXPECT_EQ((*loaded)->fingerprint, src->fingerprint);
  }
}

TEST_F(MoeLoaderTest, MtpAndVisionTensorsAreSkipped) {
  auto src = Random(TinyQwen35Moe(), 7);
  const std::string dir = Dir("ckpt");
  Write(*src, dir, /*multimodal=*/true);
  Rewrite(dir, [&](auto& tensors, auto& keep) {
    const SafetensorsTensor& like =
        tensors.at("model.language_model.layers.0.mlp.experts.0.gate_proj.weight");
    for (const char* name :
         {"mtp.layers.0.mlp.experts.0.gate_proj.weight", "mtp.layers.0.mlp.experts.gate_up_proj",
          "model.visual.blocks.0.mlp.linear_fc1.weight"}) {
      SafetensorsTensor t = like;
      t.name = name;
      tensors[name] = t;
    }
    (void)keep;
  });
  auto loaded = Load(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->fingerprint, src->fingerprint);
}

TEST_F(MoeLoaderTest, MissingExpertNamesTheTensor) {
  auto src = Random(TinyQwen35Moe(), 8);
  const std::string dir = Dir("ckpt");
  Write(*src, dir);
  Rewrite(dir, [](auto& tensors, auto&) {
    tensors.erase("model.layers.1.mlp.experts.2.up_proj.weight");
  });
  EXPECT_THAT(LoadError(dir),
              HasSubstr("missing tensor model.layers.1.mlp.experts.2.up_proj.weight (expert 2 of "
                        "num_experts=4 from config.json; looked in model.safetensors)"));
}

TEST_F(MoeLoaderTest, ExpertBeyondNumExpertsIsUnexpected) {
  auto src = Random(TinyQwen35Moe(), 9);
  const std::string dir = Dir("ckpt");
  Write(*src, dir);
  Rewrite(dir, [](auto& tensors, auto&) {
    SafetensorsTensor t = tensors.at("model.layers.0.mlp.experts.3.down_proj.weight");
    t.name = "model.layers.0.mlp.experts.4.down_proj.weight";
    tensors[t.name] = t;
  });
  EXPECT_THAT(LoadError(dir),
              HasSubstr("unexpected tensor model.layers.0.mlp.experts.4.down_proj.weight in "
                        "model.safetensors (expert 4 >= num_experts=4 from config.json)"));
}

TEST_F(MoeLoaderTest, FusedTensorWithTheWrongExpertCount) {
  auto src = Random(TinyQwen35Moe(), 10);
  const std::string dir = Dir("ckpt");
  Write(*src, dir);
  Rewrite(dir, [&](auto& tensors, auto& keep) {
    Fuse(tensors, keep, "model.", 0);
    SafetensorsTensor& t = tensors.at("model.layers.0.mlp.experts.down_proj");
    t.shape[0] = kExperts - 1;  // three experts' worth of bytes
    t.nbytes = t.nbytes / kExperts * (kExperts - 1);
  });
  EXPECT_THAT(LoadError(dir),
              HasSubstr("tensor model.layers.0.mlp.experts.down_proj in model.safetensors holds 3 "
                        "experts (its first dim), config.json has num_experts=4"));
}

TEST_F(MoeLoaderTest, ShapeMismatchesNameTheTensorAndTheConfigFields) {
  auto src = Random(TinyQwen35Moe(), 11);
  const std::string dir = Dir("per_expert");
  Write(*src, dir);
  Rewrite(dir, [](auto& tensors, auto&) {
    SafetensorsTensor& t = tensors.at("model.layers.1.mlp.experts.1.gate_proj.weight");
    t.shape = {kInter / 2, kHidden};
    t.nbytes /= 2;
  });
  EXPECT_THAT(LoadError(dir),
              HasSubstr("tensor model.layers.1.mlp.experts.1.gate_proj.weight in "
                        "model.safetensors has shape [4, 32], expected [8, 32] (from config.json: "
                        "num_experts=4, moe_intermediate_size=8 x2 (gate, up), hidden_size=32)"));

  const std::string fused = Dir("fused");
  Write(*src, fused);
  Rewrite(fused, [&](auto& tensors, auto& keep) {
    Fuse(tensors, keep, "model.", 1);
    SafetensorsTensor& t = tensors.at("model.layers.1.mlp.experts.gate_up_proj");
    t.shape = {kExperts, kHidden, 2 * kInter};  // transposed per expert
  });
  EXPECT_THAT(LoadError(fused),
              HasSubstr("tensor model.layers.1.mlp.experts.gate_up_proj has shape [4, 32, 16], "
                        "expected [4, 16, 32]"));

  const std::string router = Dir("router");
  Write(*src, router);
  Rewrite(router, [](auto& tensors, auto&) {
    SafetensorsTensor& t = tensors.at("model.layers.0.mlp.gate.weight");
    t.shape = {kHidden, kExperts};
  });
  EXPECT_THAT(LoadError(router), HasSubstr("tensor model.layers.0.mlp.gate.weight has shape [32, "
                                           "4], expected [4, 32] (from config.json: num_experts=4, "
                                           "hidden_size=32)"));
}

TEST_F(MoeLoaderTest, BothLayoutsAtOnceIsAnError) {
  auto src = Random(TinyQwen35Moe(), 12);
  const std::string dir = Dir("ckpt");
  Write(*src, dir);
  Rewrite(dir, [&](auto& tensors, auto& keep) {
    std::map<std::string, SafetensorsTensor> copy = tensors;
    Fuse(copy, keep, "model.", 1);
    const std::string fused = "model.layers.1.mlp.experts.gate_up_proj";
    tensors[fused] = copy.at(fused);
  });
  EXPECT_THAT(LoadError(dir),
              HasSubstr("layer 1 stores its experts both fused "
                        "(model.layers.1.mlp.experts.gate_up_proj in model.safetensors) and per "
                        "expert (model.layers.1.mlp.experts.0.gate_proj.weight in "
                        "model.safetensors)"));
}

TEST_F(MoeLoaderTest, NoExpertsAtAllNamesBothForms) {
  auto src = Random(TinyQwen3Moe(), 13);
  const std::string dir = Dir("ckpt");
  Write(*src, dir);
  Rewrite(dir, [](auto& tensors, auto&) {
    for (int64_t e = 0; e < kExperts; ++e) {
      for (const char* part : {"gate_proj", "up_proj"}) {
        tensors.erase(absl::StrCat("model.layers.1.mlp.experts.", e, ".", part, ".weight"));
      }
    }
  });
  EXPECT_THAT(LoadError(dir),
              HasSubstr("missing tensor model.layers.1.mlp.experts.gate_up_proj (or its "
                        "per-expert form model.layers.1.mlp.experts.0.gate_proj.weight, ...;"));
}

TEST_F(MoeLoaderTest, TensorsOfTheOtherMlpKindAreUnexpected) {
  // Layer 0 of the qwen3_moe model is dense (mlp_only_layers = [0]).
  auto src = Random(TinyQwen3Moe(), 14);
  const std::string dir = Dir("dense_layer");
  Write(*src, dir);
  Rewrite(dir, [](auto& tensors, auto&) {
    SafetensorsTensor t = tensors.at("model.layers.1.mlp.gate.weight");
    t.name = "model.layers.0.mlp.gate.weight";
    tensors[t.name] = t;
  });
  EXPECT_THAT(LoadError(dir),
              HasSubstr("unexpected tensor model.layers.0.mlp.gate.weight in model.safetensors "
                        "(layer 0 has a dense MLP in config.json: num_experts, mlp_only_layers, "
                        "decoder_sparse_step)"));

  const std::string moe = Dir("moe_layer");
  Write(*src, moe);
  Rewrite(moe, [](auto& tensors, auto&) {
    SafetensorsTensor t = tensors.at("model.layers.0.mlp.up_proj.weight");
    t.name = "model.layers.1.mlp.up_proj.weight";
    tensors[t.name] = t;
  });
  EXPECT_THAT(LoadError(moe),
              HasSubstr("unexpected tensor model.layers.1.mlp.up_proj.weight in model.safetensors "
                        "(layer 1 is a mixture-of-experts layer in config.json)"));

  const std::string shared = Dir("shared");
  Write(*src, shared);
  Rewrite(shared, [](auto& tensors, auto&) {
    SafetensorsTensor t = tensors.at("model.layers.1.mlp.gate.weight");
    t.name = "model.layers.1.mlp.shared_expert_gate.weight";
    tensors[t.name] = t;
  });
  EXPECT_THAT(LoadError(shared), HasSubstr("(qwen3_moe has no shared expert)"));
}

TEST_F(MoeLoaderTest, MixedExpertDtypesAreAnError) {
  auto src = Random(TinyQwen35Moe(), 15);
  const std::string dir = Dir("ckpt");
  Write(*src, dir);
  Rewrite(dir, [](auto& tensors, auto& keep) {
    SafetensorsTensor& t = tensors.at("model.layers.0.mlp.experts.2.down_proj.weight");
    std::vector<std::byte>& f32 = keep.emplace_back(t.nbytes * 2);
    for (size_t i = 0; i < t.nbytes / 2; ++i) {  // bf16 -> f32: the bits in the high half
      std::memcpy(f32.data() + 4 * i + 2, t.data + 2 * i, 2);
    }
    t.dtype = "F32";
    t.data = f32.data();
    t.nbytes = f32.size();
  });
  EXPECT_THAT(LoadError(dir), HasSubstr("tensor model.layers.0.mlp.experts.2.down_proj.weight in "
                                        "model.safetensors has dtype F32 but "
                                        "model.layers.0.mlp.experts.0.down_proj.weight has BF16"));
}

TEST_F(MoeLoaderTest, FingerprintCoversExpertsAndMoeFields) {
  auto a = Random(TinyQwen35Moe(), 16);
  const std::string dir = Dir("ckpt");
  Write(*a, dir);
  Rewrite(dir, [](auto& tensors, auto& keep) {
    SafetensorsTensor& t = tensors.at("model.layers.1.mlp.experts.3.down_proj.weight");
    std::vector<std::byte>& bytes = keep.emplace_back(t.data, t.data + t.nbytes);
    bytes[5] ^= std::byte{1};
    t.data = bytes.data();
  });
  auto changed = Load(dir);
  ASSERT_TRUE(changed.ok()) << changed.status();
  EXPECT_NE((*changed)->fingerprint, a->fingerprint);

  ModelConfig other = TinyQwen35Moe();
  other.num_experts_per_tok = 3;  // same tensors, different routing
  auto b = Random(other, 16);
  EXPECT_NE(b->fingerprint, a->fingerprint);
  ModelConfig renorm = TinyQwen3Moe();
  renorm.norm_topk_prob = true;
  EXPECT_NE(Random(renorm, 16)->fingerprint, Random(TinyQwen3Moe(), 16)->fingerprint);
}

}  // namespace
}  // namespace draftfeed
