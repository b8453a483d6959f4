// QuantizeFp8Blocks / QuantizeModelFp8 / the -fp8 built-ins: codes and
// scales equal the definition (s = max|W| / 448 per 128x128 block, q =
// e4m3(W / s) round to nearest even) on hand-checked blocks, partial last
// blocks, all-zero blocks and stacked experts; the dequantized error bound;
// which tensors a model's quantization touches; the refusals.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/fp8_e4m3.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/fp8_quantize.h"
#include "server/model/model.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

using ::testing::HasSubstr;

Tensor F32Tensor(const std::vector<float>& values, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype = DType::kF32;
  t.shape = std::move(shape);
  t.data = reinterpret_cast<const std::byte*>(values.data());
  return t;
}

Tensor Fp8View(const Fp8Blocks& q, std::vector<int64_t> shape) {
  Tensor t;
  t.dtype = DType::kF8E4M3;
  t.shape = shape;
  t.data = reinterpret_cast<const std::byte*>(q.codes.data());
  t.scale_inv.dtype = DType::kF32;
  t.scale_inv.shape = Fp8ScaleShape(shape);
  t.scale_inv.data = reinterpret_cast<const std::byte*>(q.scales.data());
  return t;
}

std::vector<float> Gaussian(size_t n, uint64_t seed, float scale) {
  std::mt19937_64 rng(seed);
  std::vector<float> v(n);
  for (float& x : v) {
    // Box-Muller over the raw stream: the same values on every standard library.
    const double u1 = (static_cast<double>(rng() >> 11) + 0.5) * 0x1p-53;
    const double u2 = (static_cast<double>(rng() >> 11) + 0.5) * 0x1p-53;
    x = static_cast<float>(scale * std::sqrt(-2 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
  return v;
}

// Half the spacing of e4m3 values around |x| (x = w / s, at most 448): the
// most round-to-nearest can move it. Normal values in [2^e, 2^(e+1)) are
// 2^(e-3) apart; below 2^-6 (subnormals) the spacing stays 2^-9.
double HalfStep(double x) {
  const int e = std::max(static_cast<int>(std::floor(std::log2(std::fabs(x)))), -6);
  return std::ldexp(1.0, e - 4);
}

TEST(Fp8QuantizeTest, HandCheckedBlock) {
  // max|W| = 896, so s = 896 / 448 = 2 exactly and q = e4m3(W / 2).
  const std::vector<float> w = {896, -448, 2, 1, 6, -0.002f};
  const Fp8Blocks q = QuantizeFp8Blocks(F32Tensor(w, {2, 3}));
  ASSERT_EQ(q.scales, std::vector<float>{2.0f});
  // 448 = 2^8 x 1.75: exponent field 15, mantissa 6 (0x7e); 224 = 2^7 x 1.75
  // (0x76, negative 0xf6); 1 = 0x38; 0.5 = 0x30; 3 = 2^1 x 1.5 (0x44);
  // -0.001 = -0.512 x 2^-9 rounds to the smallest subnormal (0x81).
  EXPECT_EQ(q.codes, (std::vector<uint8_t>{0x7e, 0xf6, 0x38, 0x30, 0x44, 0x81}));
  const std::vector<float> back = ToFloat(Fp8View(q, {2, 3}));
  EXPECT_EQ(back, (std::vector<float>{896, -448, 2, 1, 6, -2 * 0x1p-9f}));
}

TEST(Fp8QuantizeTest, PartialBlocksAndStackedExpertsFollowTheDefinition) {
  // Two experts of [130, 200]: blocks of 128 rows and cols, the last ones
  // partial (2 rows, 72 cols), each expert its own grid.
  const std::vector<int64_t> shape = {2, 130, 200};
  const std::vector<float> w = Gaussian(2 * 130 * 200, 11, 0.05f);
  const Fp8Blocks q = QuantizeFp8Blocks(F32Tensor(w, shape));
  ASSERT_EQ(Fp8ScaleShape(shape), (std::vector<int64_t>{2, 2, 2}));
  ASSERT_EQ(q.scales.size(), 8u);
  ASSERT_EQ(q.codes.size(), w.size());
  for (int64_t e = 0; e < 2; ++e) {
    for (int64_t br = 0; br < 2; ++br) {
      for (int64_t bc = 0; bc < 2; ++bc) {
        float amax = 0;
        for (int64_t r = br * 128; r < std::min<int64_t>(130, br * 128 + 128); ++r) {
          for (int64_t c = bc * 128; c < std::min<int64_t>(200, bc * 128 + 128); ++c) {
            amax = std::max(amax, std::fabs(w[(e * 130 + r) * 200 + c]));
          }
        }
        const float s = q.scales[(e * 2 + br) * 2 + bc];
        EXPECT_EQ(s, amax / 448.0f) << e << " " << br << " " << bc;
        for (int64_t r = br * 128; r < std::min<int64_t>(130, br * 128 + 128); ++r) {
          for (int64_t c = bc * 128; c < std::min<int64_t>(200, bc * 128 + 128); ++c) {
            const size_t i = static_cast<size_t>((e * 130 + r) * 200 + c);
            ASSERT_EQ(q.codes[i], FloatToE4m3(w[i] / s)) << i;
          }
        }
      }
    }
  }
  // Dequantized, every element is within half an e4m3 step of |W / s|,
  // times s; the slack covers the two fp32 roundings (of W / s and of q * s),
  // a few ulps of |W|.
  const std::vector<float> back = ToFloat(Fp8View(q, shape));
  double worst = 0;
  for (int64_t e = 0; e < 2; ++e) {
    for (int64_t r = 0; r < 130; ++r) {
      for (int64_t c = 0; c < 200; ++c) {
        const size_t i = static_cast<size_t>((e * 130 + r) * 200 + c);
        const double s = q.scales[(e * 2 + r / 128) * 2 + c / 128];
        const double err = std::fabs(static_cast<double>(w[i]) - back[i]);
        const double bound = s * HalfStep(w[i] / s) + 4e-7 * std::fabs(w[i]) + 1e-30;
        ASSERT_LE(err, bound) << i << " w=" << w[i] << " s=" << s;
        worst = std::max(worst, err / bound);
      }
    }
  }
  EXPECT_GT(worst, 0.5);  // the bound is tight: some element rounds by nearly half a step
}

TEST(Fp8QuantizeTest, AllZeroBlockGetsScaleOne) {
  std::vector<float> w(128 * 256, 0.0f);
  for (int64_t r = 0; r < 128; ++r) w[r * 256 + 5] = 0.25f * static_cast<float>(r + 1) / 128;
  const Fp8Blocks q = QuantizeFp8Blocks(F32Tensor(w, {128, 256}));
  // Left block: max 0.25 -> s = 0.25 / 448; right block all zero -> s = 1, codes +0.
  EXPECT_EQ(q.scales, (std::vector<float>{0.25f / 448.0f, 1.0f}));
  for (int64_t r = 0; r < 128; ++r) {
    for (int64_t c = 128; c < 256; ++c) ASSERT_EQ(q.codes[r * 256 + c], 0) << r << " " << c;
  }
  EXPECT_EQ(q.codes[127 * 256 + 5], 0x7e);  // the block's maximum maps to 448
}

TEST(Fp8QuantizeTest, ModelQuantizesEligibleTensorsOnly) {
  for (const char* spec : {"tiny-random:4", "tiny-random-qwen3:4"}) {
    auto bf16 = MakeRandomModel(spec);
    auto fp8 = MakeRandomModel(spec);
    ASSERT_TRUE(bf16.ok() && fp8.ok());
    ASSERT_TRUE(QuantizeModelFp8(**fp8).ok());
    EXPECT_TRUE((*fp8)->config.quantization.enabled);
    EXPECT_NE((*fp8)->fingerprint, (*bf16)->fingerprint);
    int quantized = 0;
    for (const WeightSpec& s : DecoderWeightSpecs((*bf16)->config)) {
      const Tensor& a = WeightSlot((*bf16)->weights, s);
      const Tensor& b = WeightSlot((*fp8)->weights, s);
      if (!s.fp8_eligible) {
        EXPECT_EQ(b.dtype, DType::kBF16) << s.name;
        EXPECT_EQ(std::memcmp(a.data, b.data, a.nbytes()), 0) << s.name;
        continue;
      }
      ++quantized;
      ASSERT_EQ(b.dtype, DType::kF8E4M3) << s.name;
      EXPECT_EQ(b.scale_inv.dtype, DType::kF32) << s.name;
      EXPECT_EQ(b.scale_inv.shape, Fp8ScaleShape(s.shape)) << s.name;
      const Fp8Blocks want = QuantizeFp8Blocks(a);
      EXPECT_EQ(std::memcmp(b.data, want.codes.data(), want.codes.size()), 0) << s.name;
      EXPECT_EQ(std::memcmp(b.scale_inv.data, want.scales.data(), want.scales.size() * 4), 0)
          << s.name;
    }
    // Per layer: 4 attention projections (or 3 GDN ones) and the 3 MLP ones.
    EXPECT_GE(quantized, 6 * (*bf16)->config.num_layers) << spec;
    EXPECT_EQ((*fp8)->weights.embed_tokens.dtype, DType::kBF16);

    const absl::Status again = QuantizeModelFp8(**fp8);
    EXPECT_THAT(again.message(), HasSubstr("is already FP8 (an FP8 checkpoint or -fp8 built-in)"))
        << again;
  }
}

TEST(Fp8QuantizeTest, FingerprintCoversScalesAndScheme) {
  auto m = MakeRandomModel("tiny-random-qwen3-fp8:2");
  ASSERT_TRUE(m.ok());
  Model& model = **m;
  const std::string base = model.fingerprint;
  EXPECT_EQ(ComputeFingerprint(model), base);
  Tensor& v = model.weights.layers[2].v_proj;
  std::vector<float> scales(static_cast<size_t>(v.scale_inv.numel()));
  std::memcpy(scales.data(), v.scale_inv.data, scales.size() * 4);
  const std::byte* saved = v.scale_inv.data;
  v.scale_inv.data = reinterpret_cast<const std::byte*>(scales.data());
  EXPECT_EQ(ComputeFingerprint(model), base);  // the same values elsewhere
  scales[0] = std::nextafter(scales[0], 1.0f);
  EXPECT_NE(ComputeFingerprint(model), base);
  v.scale_inv.data = saved;
  model.config.quantization.modules_to_not_convert = {"lm_head"};  // names, not maths
  EXPECT_EQ(ComputeFingerprint(model), base);
}

TEST(Fp8QuantizeDeathTest, ToFloatOfFp8WithoutScalesIsAProgrammerError) {
  const std::vector<uint8_t> codes(4, 0x38);
  Tensor t;
  t.dtype = DType::kF8E4M3;
  t.shape = {2, 2};
  t.data = reinterpret_cast<const std::byte*>(codes.data());
  EXPECT_DEATH(ToFloat(t), "FP8 tensor \\[2, 2\\] without scales of shape \\[1, 1\\]");
}

TEST(Fp8QuantizeTest, FlagValuesAndRefusals) {
  auto m = MakeRandomModel("tiny-random:1");
  ASSERT_TRUE(m.ok());
  const std::string before = (*m)->fingerprint;
  EXPECT_TRUE(ApplyQuantizeFlag(**m, "none").ok());
  EXPECT_TRUE(ApplyQuantizeFlag(**m, "").ok());
  EXPECT_EQ((*m)->fingerprint, before);
  EXPECT_EQ(ApplyQuantizeFlag(**m, "int8").message(),
            "--quantize=int8 is not supported; accepted: none, fp8");
  EXPECT_TRUE(ApplyQuantizeFlag(**m, "fp8").ok());
  EXPECT_NE((*m)->fingerprint, before);

  // Experts 64 wide: a 128-row scale block would straddle gate and up.
  auto moe = MakeRandomModel("tiny-random-moe:1");
  ASSERT_TRUE(moe.ok());
  EXPECT_THAT(QuantizeModelFp8(**moe).message(),
              HasSubstr("moe_intermediate_size=64 is not a multiple of 128"));

  auto device = MakeRandomModel("random:qwen3-8b");
  ASSERT_TRUE(device.ok());
  EXPECT_THAT(QuantizeModelFp8(**device).message(), HasSubstr("use its -fp8 built-in variant"));
}

TEST(Fp8QuantizeTest, BuiltinFp8VariantsAreTheQuantizedBf16Models) {
  for (const char* base : {"tiny-random", "tiny-random-qwen3", "small-random-qwen3"}) {
    auto want = MakeRandomModel(absl::StrCat(base, ":9"));
    auto got = MakeRandomModel(absl::StrCat(base, "-fp8:9"));
    ASSERT_TRUE(want.ok() && got.ok()) << base;
    ASSERT_TRUE(QuantizeModelFp8(**want).ok());
    EXPECT_EQ((*got)->fingerprint, (*want)->fingerprint) << base;
    EXPECT_EQ((*got)->id, absl::StrCat(base, "-fp8:9"));
  }
  // The MoE variants widen their experts to 128 so gate and up split on a
  // block edge; otherwise they are the bf16 shape quantized.
  for (const char* base : {"tiny-random-moe", "tiny-random-qwen3-moe"}) {
    auto got = MakeRandomModel(absl::StrCat(base, "-fp8:2"));
    ASSERT_TRUE(got.ok()) << got.status();
    ModelConfig c = (*got)->config;
    EXPECT_EQ(c.moe_intermediate_size, 128) << base;
    c.quantization = Fp8Quantization{};
    auto want = MakeRandomModel(c, 2);
    ASSERT_TRUE(want.ok());
    ASSERT_TRUE(QuantizeModelFp8(**want).ok());
    EXPECT_EQ((*got)->fingerprint, (*want)->fingerprint) << base;
    const Tensor& experts = (*got)->weights.layers[0].experts_down;
    EXPECT_TRUE(experts.fp8());
    EXPECT_EQ(experts.scale_inv.shape, (std::vector<int64_t>{8, 1, 1}));
  }
}

TEST(Fp8QuantizeTest, DeviceRandomFp8ShapesCarryDtypesAndScaleShapes) {
  for (const char* spec :
       {"random:qwen3.6-27b-fp8", "random:qwen3.6-35b-a3b-fp8", "random:qwen3-30b-a3b-fp8"}) {
    auto m = MakeRandomModel(spec);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_TRUE((*m)->weights_on_device_random);
    EXPECT_TRUE((*m)->config.quantization.enabled);
    for (const WeightSpec& s : DecoderWeightSpecs((*m)->config)) {
      const Tensor& t = WeightSlot((*m)->weights, s);
      EXPECT_EQ(t.data, nullptr);
      EXPECT_EQ(t.fp8(), s.fp8_eligible) << s.name;
      if (s.fp8_eligible) {
        EXPECT_EQ(t.scale_inv.dtype, DType::kF32) << s.name;
        EXPECT_EQ(t.scale_inv.shape, Fp8ScaleShape(s.shape)) << s.name;
        EXPECT_EQ(t.scale_inv.data, nullptr);
      }
    }
    auto bf16 = MakeRandomModel(std::string(spec).substr(0, std::string(spec).size() - 4));
    ASSERT_TRUE(bf16.ok());
    EXPECT_NE((*m)->fingerprint, (*bf16)->fingerprint) << spec;
  }
  const auto m = MakeRandomModel("random:qwen3.6-35b-a3b-fp8:3");
  ASSERT_TRUE(m.ok());
  const LayerWeights& l = (*m)->weights.layers[0];
  EXPECT_EQ(l.experts_gate_up.scale_inv.shape, (std::vector<int64_t>{256, 8, 16}));
  EXPECT_EQ(l.in_proj_qkv.scale_inv.shape, (std::vector<int64_t>{64, 16}));
  EXPECT_EQ(l.in_proj_a.dtype, DType::kBF16);
  EXPECT_EQ(l.router.dtype, DType::kBF16);
  EXPECT_EQ(l.shared_expert_gate.dtype, DType::kBF16);
}

}  // namespace
}  // namespace draftfeed
