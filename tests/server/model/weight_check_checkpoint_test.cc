// CheckWeightsFinite over checkpoints on disk: a built-in model written as an
// HF checkpoint, one element of one tensor overwritten in the file, loaded
// back (the tensors are views of the mmap'd safetensors bytes) and scanned.
// Each of these loaded and served NaN states when the check was off, as it
// was by default; one (a 3e38 scale) passed the check too.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"
#include "server/model/weight_check.h"

namespace draftfeed {
namespace {

namespace fs = std::filesystem;

constexpr char kFix[] =
    "; the checkpoint is corrupt: download or convert it again (--check_weights=false starts "
    "without this check, serving whatever these weights compute)";

class WeightCheckCheckpointTest : public ::testing::Test {
 protected:
  // Writes built-in `spec` as a one-file checkpoint (FP8 scales in F32).
  std::string Write(const std::string& spec) {
    const fs::path dir = fs::temp_directory_path() / "weight_check_checkpoint_test" /
                         ::testing::UnitTest::GetInstance()->current_test_info()->name() / spec;
    fs::remove_all(dir);
    auto model = MakeRandomModel(spec);
    EXPECT_TRUE(model.ok()) << model.status();
    const absl::Status st = WriteHfCheckpoint(**model, dir.string(), {});
    EXPECT_TRUE(st.ok()) << st;
    return dir.string();
  }

  // Overwrites element `element` of tensor `name` of dir/model.safetensors with `bytes`.
  static void Patch(const std::string& dir, const std::string& name, int64_t element,
                    const std::vector<uint8_t>& bytes) {
    const std::string path = dir + "/model.safetensors";
    int64_t offset = -1;
    {
      auto f = SafetensorsFile::Open(path);
      ASSERT_TRUE(f.ok()) << f.status();
      const SafetensorsTensor* t = f->Find(name);
      ASSERT_NE(t, nullptr) << name;
      ASSERT_LE((element + 1) * static_cast<int64_t>(bytes.size()),
                static_cast<int64_t>(t->nbytes));
      offset = (t->data - f->file()->data()) + element * static_cast<int64_t>(bytes.size());
    }
    std::fstream out(path, std::ios::in | std::ios::out | std::ios::binary);
    out.seekp(offset);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    ASSERT_TRUE(out.good());
  }

  static std::vector<uint8_t> F32(float v) {
    std::vector<uint8_t> b(4);
    std::memcpy(b.data(), &v, 4);
    return b;
  }

  static std::string CheckError(const std::string& dir) {
    auto model = OpenModel(dir);
    EXPECT_TRUE(model.ok()) << model.status();
    if (!model.ok()) return "not loaded";
    return std::string(CheckWeightsFinite(**model).message());
  }

  // The first layer of `dir`'s model that has a router.
  static int RouterLayer(const std::string& dir) {
    auto model = OpenModel(dir);
    EXPECT_TRUE(model.ok()) << model.status();
    for (size_t l = 0; model.ok() && l < (*model)->weights.layers.size(); ++l) {
      if ((*model)->weights.layers[l].router.valid()) return static_cast<int>(l);
    }
    ADD_FAILURE() << dir << " has no MoE layer";
    return 0;
  }
};

TEST_F(WeightCheckCheckpointTest, CleanCheckpointsPassAndEveryByteIsScannedInTheMapping) {
  for (const char* spec : {"tiny-random-moe", "tiny-random-fp8", "tiny-random-moe-fp8"}) {
    const std::string dir = Write(spec);
    auto model = OpenModel(dir);
    ASSERT_TRUE(model.ok()) << model.status();
    const Model& m = **model;
    ASSERT_EQ(m.files.size(), 1u);
    WeightCheckStats stats;
    ASSERT_TRUE(CheckWeightsFinite(m, &stats).ok()) << spec;
    // Every tensor of the file but a tied lm_head: routers, scales and all.
    auto f = SafetensorsFile::Open(dir + "/model.safetensors");
    ASSERT_TRUE(f.ok()) << f.status();
    int64_t file_bytes = 0;
    for (const auto& [name, t] : f->tensors()) file_bytes += static_cast<int64_t>(t.nbytes);
    EXPECT_EQ(stats.bytes, file_bytes) << spec;
    if (m.config.num_experts == 0) {  // MoE: the file's experts are stacked, E to a tensor
      EXPECT_EQ(stats.tensors, static_cast<int64_t>(f->tensors().size())) << spec;
    }
    EXPECT_GE(stats.threads, 1);
    // The router is read where the loader left it: in the checkpoint's mapping.
    if (m.config.num_experts > 0) {
      const Tensor& router = m.weights.layers[RouterLayer(dir)].router;
      EXPECT_TRUE(m.files[0]->Contains(router.data, router.nbytes())) << spec;
    }
  }
}

TEST_F(WeightCheckCheckpointTest, NaNAndInfinityInARouterAreNamed) {
  const std::string dir = Write("tiny-random-moe");
  const int l = RouterLayer(dir);
  const std::string name = absl::StrCat("layers.", l, ".mlp.gate.weight");
  Patch(dir, "model." + name, 70, {0xc0, 0x7f});  // bf16 NaN
  auto model = OpenModel(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor& router = (*model)->weights.layers[l].router;
  const int64_t cols = router.shape[1];
  EXPECT_EQ(CheckError(dir), absl::StrCat(dir, ": tensor ", name, " (BF16 ", router.ShapeString(),
                                          ") holds NaN at element 70 (index [", 70 / cols, ", ",
                                          70 % cols, "])", kFix));
  Patch(dir, "model." + name, 70, {0x80, 0x3f});  // 1.0 again
  Patch(dir, "model." + name, 3, {0x80, 0xff});   // -Inf
  EXPECT_EQ(CheckError(dir), absl::StrCat(dir, ": tensor ", name, " (BF16 ", router.ShapeString(),
                                          ") holds -Inf at element 3 (index [0, 3])", kFix));
}

TEST_F(WeightCheckCheckpointTest, E4m3NaNCodesAreNamedInDenseAndExpertWeights) {
  for (const uint8_t nan : {0x7f, 0xff}) {
    const std::string dir = Write("tiny-random-fp8");
    Patch(dir, "model.layers.3.self_attn.o_proj.weight", 300, {nan});
    EXPECT_EQ(CheckError(dir), absl::StrCat(dir,
                                            ": tensor layers.3.self_attn.o_proj.weight (F8_E4M3 "
                                            "[128, 256]) holds NaN at element 300 (index [1, 44])",
                                            kFix));
  }
  // An expert's weight, stacked with the others at load: the index names the expert.
  const std::string dir = Write("tiny-random-moe-fp8");
  const int l = RouterLayer(dir);
  Patch(dir, absl::StrCat("model.layers.", l, ".mlp.experts.1.down_proj.weight"), 5, {0x7f});
  auto model = OpenModel(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor& down = (*model)->weights.layers[l].experts_down;
  ASSERT_EQ(down.shape.size(), 3u);
  const int64_t element = down.shape[1] * down.shape[2] + 5;
  EXPECT_EQ(CheckError(dir),
            absl::StrCat(dir, ": tensor layers.", l, ".mlp.experts.down_proj (F8_E4M3 ",
                         down.ShapeString(), ") holds NaN at element ", element,
                         " (index [1, 0, 5])", kFix));
}

TEST_F(WeightCheckCheckpointTest, ScalesMustBeFinitePositiveAndUnderTheBound) {
  const std::string name = "layers.3.self_attn.o_proj.weight_scale_inv";  // F32 [1, 2]
  // 3e38 is finite, but 448 x 3e38 is not: the check used to accept it.
  for (const float bad :
       {3e38f, 1e35f, 4.2e16f, INFINITY, -INFINITY, std::nanf(""), 0.0f, -1e-3f}) {
    const std::string dir = Write("tiny-random-fp8");
    Patch(dir, "model." + name, 1, F32(bad));
    EXPECT_EQ(CheckError(dir),
              absl::StrCat(dir, ": tensor ", name, " (F32 [1, 2]) holds ", bad,
                           " at element 1 (index [0, 1]); an FP8 block scale must be finite, > 0 "
                           "and <= ",
                           kMaxFp8BlockScale,
                           " (448 x scale under 2^64, so that the FP8 GEMMs cannot overflow to "
                           "Inf)",
                           kFix))
        << bad;
  }
  const std::string dir = Write("tiny-random-fp8");
  Patch(dir, "model." + name, 1, F32(4.1e16f));  // under the bound: a strange but finite model
  EXPECT_EQ(CheckError(dir), "");
}

}  // namespace
}  // namespace draftfeed
