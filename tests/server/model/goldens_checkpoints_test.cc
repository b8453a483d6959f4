// One model saved two ways: qwen35_mm (Qwen3_5ForConditionalGeneration's
// names, 4 shards, vision and MTP tensors) against qwen35_text (CausalLM),
// weights, hidden states and fingerprints, and their goldens.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/model/model.h"
#include "server/model/weight_layout.h"
#include "tests/server/model/goldens.h"

namespace draftfeed::testing {
namespace {

namespace fs = std::filesystem;

// qwen35_mm is qwen35_text saved by Qwen3_5ForConditionalGeneration: other
// names, 4 shards, vision and MTP tensors to skip, and A_log / dt_bias stored
// as F32 (values exactly representable in bf16). The decoder must come out
// the same value for value, and so must every hidden state.
TEST(Qwen35CheckpointsTest, MultimodalCheckpointEqualsText) {
  absl::StatusOr<Loaded> text = LoadWithEngine((DataDir() / "models" / "qwen35_text").string());
  ASSERT_TRUE(text.ok()) << text.status();
  absl::StatusOr<Loaded> mm = LoadWithEngine((DataDir() / "models" / "qwen35_mm").string());
  ASSERT_TRUE(mm.ok()) << mm.status();
  const ModelConfig& tc = text->model->config;
  const ModelConfig& mc = mm->model->config;
  EXPECT_FALSE(tc.multimodal);
  EXPECT_TRUE(mc.multimodal);
  EXPECT_EQ(tc.ToJson(), [&] {
    ModelConfig c = mc;
    c.multimodal = false;
    return c.ToJson();
  }()) << "decoder configs differ";

  std::vector<WeightSpec> specs = DecoderWeightSpecs(tc);
  specs.push_back(LmHeadSpec(tc));
  std::vector<std::string> dtype_differs;
  for (const WeightSpec& spec : specs) {
    const Tensor& a = WeightSlot(text->model->weights, spec);
    const Tensor& b = WeightSlot(mm->model->weights, spec);
    ASSERT_TRUE(a.valid() && b.valid()) << spec.name;
    ASSERT_EQ(a.shape, b.shape) << spec.name;
    const std::vector<float> va = ToFloat(a), vb = ToFloat(b);
    EXPECT_EQ(std::memcmp(va.data(), vb.data(), va.size() * sizeof(float)), 0)
        << spec.name << " has other values";
    if (a.dtype != b.dtype) {
      dtype_differs.push_back(absl::StrCat(spec.name, " ", std::string(DTypeName(a.dtype)), "/",
                                           std::string(DTypeName(b.dtype))));
    }
  }
  // fingerprint.cc hashes dtype and raw bytes on purpose (a bf16 and an f32
  // copy need not give identical states in every backend), so the fingerprints
  // can only be required equal when the dtypes are. Here they are not (the
  // README's 8 F32 tensors), so what is asserted is the stronger property: the
  // hidden states are bit-identical. The naming- and sharding-independence of
  // the fingerprint is checked below on a same-dtype copy.
  std::cout << "text vs mm: " << dtype_differs.size() << " tensors differ in dtype only; "
            << "fingerprints " << text->model->fingerprint << " / " << mm->model->fingerprint
            << "\n";
  if (dtype_differs.empty()) {
    EXPECT_EQ(text->model->fingerprint, mm->model->fingerprint);
  } else {
    EXPECT_EQ(dtype_differs.size(), 8u) << absl::StrJoin(dtype_differs, "; ");
  }

  absl::StatusOr<Goldens> g = LoadGoldens("qwen35_text");
  ASSERT_TRUE(g.ok()) << g.status();
  std::vector<int32_t> tokens, lens;
  for (const GoldenSeq& s : g->seqs) {
    tokens.insert(tokens.end(), s.ids.begin(), s.ids.end());
    lens.push_back(static_cast<int32_t>(s.ids.size()));
  }
  const std::vector<int32_t> ids = AllLayers(tc.num_layers);
  absl::StatusOr<std::vector<float>> a = RunFloat(*text->engine, tokens, lens, ids);
  absl::StatusOr<std::vector<float>> b = RunFloat(*mm->engine, tokens, lens, ids);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(a->size(), b->size());
  EXPECT_EQ(std::memcmp(a->data(), b->data(), a->size() * sizeof(float)), 0)
      << "hidden states of qwen35_mm differ from qwen35_text";

  // Same weights, same dtype, multimodal naming and 4 shards: same fingerprint.
  const fs::path dir = fs::path(::testing::TempDir()) / "goldens_test_mm_bf16";
  fs::remove_all(dir);
  HfWriteOptions opts;
  opts.multimodal_naming = true;
  opts.num_shards = 4;
  opts.dtype = DType::kBF16;
  const absl::Status st = WriteHfCheckpoint(*text->model, dir.string(), opts);
  ASSERT_TRUE(st.ok()) << st;
  absl::StatusOr<std::unique_ptr<Model>> copy = LoadModel(dir.string());
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_TRUE((*copy)->config.multimodal);
  EXPECT_EQ((*copy)->fingerprint, text->model->fingerprint);
  fs::remove_all(dir);
}

// The README says the ConditionalGeneration run reproduced the CausalLM one
// bit for bit; the mm test above relies on that.
TEST(Qwen35CheckpointsTest, MultimodalGoldensEqualTextGoldens) {
  absl::StatusOr<Goldens> a = LoadGoldens("qwen35_text");
  absl::StatusOr<Goldens> b = LoadGoldens("qwen35_mm");
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(a->seqs.size(), b->seqs.size());
  for (size_t i = 0; i < a->seqs.size(); ++i) {
    EXPECT_EQ(a->seqs[i].ids, b->seqs[i].ids);
    EXPECT_EQ(a->seqs[i].fp32_layers, b->seqs[i].fp32_layers) << "seq" << i;
    EXPECT_EQ(a->seqs[i].fp32_final, b->seqs[i].fp32_final) << "seq" << i;
    EXPECT_EQ(a->seqs[i].bf16_layers, b->seqs[i].bf16_layers) << "seq" << i;
    EXPECT_EQ(a->seqs[i].bf16_final, b->seqs[i].bf16_final) << "seq" << i;
  }
}

}  // namespace
}  // namespace draftfeed::testing
