// The CPU engine's fp8_e4m3 capture: the bytes are EncodeFp8Capture of its
// fp32 states (one rounding), K*H + 4K bytes a token, and the dequantized
// states' rms error against the fp32 states is within 1.1x of e4m3
// rounding's. That reference is the rms error of rounding each fp32 state to
// the e4m3 grid at its row's scale (amax / 448 of the same fp32 row): for an
// encoder that works from the fp32 states it is the same number (ratio 1.00);
// the bar is there for the encoding the CUDA engine does, from the bf16
// capture (two roundings), which is checked here on the same states too.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "common/fp8_capture.h"
#include "common/fp8_e4m3.h"
#include "server/model/cpu_engine.h"
#include "server/model/tensor.h"

namespace draftfeed {
namespace {

struct Captured {
  int64_t T = 0, K = 0, H = 0;
  std::vector<float> states;    // ForwardFloat
  std::vector<std::byte> fp8;   // Forward(fp8_e4m3)
  std::vector<std::byte> bf16;  // Forward(bf16)
};

Captured Capture(const std::string& spec) {
  Captured r;
  absl::StatusOr<std::unique_ptr<Model>> model = OpenModel(spec);
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return r;
  absl::StatusOr<std::unique_ptr<CpuEngine>> engine = CpuEngine::Create(model->get(), 2);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return r;
  const ModelConfig& c = (*model)->config;
  EXPECT_TRUE(std::find((*engine)->encodings().begin(), (*engine)->encodings().end(),
                        CaptureEncoding::kFp8E4m3) != (*engine)->encodings().end());
  const std::vector<int32_t> lens = {1, 37, 90};
  std::vector<int32_t> ids;
  std::mt19937_64 rng(11);
  for (int32_t l : lens) {
    for (int32_t i = 0; i < l; ++i) ids.push_back(static_cast<int32_t>(rng() % c.vocab_size));
  }
  std::vector<int32_t> layers;
  for (int32_t i = 0; i < c.num_layers; ++i) layers.push_back(i);
  layers.push_back(kFinalLayerId);
  r.T = static_cast<int64_t>(ids.size());
  r.K = static_cast<int64_t>(layers.size());
  r.H = c.hidden_size;
  r.states.resize(static_cast<size_t>(r.T * r.K * r.H));
  EXPECT_TRUE((*engine)->ForwardFloat({ids, lens, layers}, r.states).ok());
  ForwardInput in{ids, lens, layers, CaptureEncoding::kFp8E4m3};
  EXPECT_EQ(CaptureBytes(c, in), static_cast<size_t>(r.T * (r.K * r.H + 4 * r.K)));
  r.fp8.resize(CaptureBytes(c, in));
  EXPECT_TRUE((*engine)->Forward(in, r.fp8).ok());
  in.encoding = CaptureEncoding::kBf16;
  r.bf16.resize(CaptureBytes(c, in));
  EXPECT_TRUE((*engine)->Forward(in, r.bf16).ok());
  return r;
}

double Rms(const std::vector<float>& a, const std::vector<float>& b) {
  double sum = 0;
  for (size_t i = 0; i < a.size(); ++i) sum += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return std::sqrt(sum / static_cast<double>(a.size()));
}

class CpuEngineFp8Test : public ::testing::TestWithParam<const char*> {};

TEST_P(CpuEngineFp8Test, EncodesItsFp32StatesWithinE4m3Rounding) {
  const Captured r = Capture(GetParam());
  ASSERT_FALSE(r.states.empty());
  const size_t n = r.states.size();
  // The bytes: the host encoder over the fp32 states, bit for bit.
  std::vector<std::byte> want(r.fp8.size());
  ASSERT_TRUE(EncodeFp8Capture(r.states, r.T, r.K, r.H, want).ok());
  ASSERT_EQ(r.fp8, want);
  // Half of bf16's bytes, plus the scales.
  EXPECT_EQ(r.fp8.size() * 2, r.bf16.size() + static_cast<size_t>(8 * r.T * r.K));

  std::vector<float> got(n);
  ASSERT_TRUE(DecodeFp8CaptureToFloat(r.fp8, r.T, r.K, r.H, got).ok());
  // e4m3 rounding of each fp32 state at its row's fp32 scale.
  std::vector<float> rounded(n);
  for (int64_t row = 0; row < r.T * r.K; ++row) {
    const float* x = r.states.data() + row * r.H;
    float amax = 0;
    for (int64_t i = 0; i < r.H; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = Fp8RowScale(amax);
    for (int64_t i = 0; i < r.H; ++i) {
      rounded[static_cast<size_t>(row * r.H + i)] = E4m3ToFloat(FloatToE4m3(x[i] / s)) * s;
    }
  }
  const double reference = Rms(rounded, r.states);
  const double fp8 = Rms(got, r.states);
  ASSERT_GT(reference, 0);
  EXPECT_LE(fp8, 1.1 * reference) << GetParam();
  EXPECT_EQ(fp8, reference);  // the same rounding, from the same fp32 states

  // What the CUDA engine does: encode the bf16 capture. Two roundings, still
  // within the bar.
  std::vector<uint16_t> bits(n);
  for (size_t i = 0; i < n; ++i) {
    bits[i] = static_cast<uint16_t>(static_cast<uint16_t>(r.bf16[2 * i]) |
                                    (static_cast<uint16_t>(r.bf16[2 * i + 1]) << 8));
  }
  std::vector<std::byte> from_bf16(r.fp8.size());
  ASSERT_TRUE(EncodeFp8CaptureBf16(bits, r.T, r.K, r.H, from_bf16).ok());
  std::vector<float> got_bf16(n);
  ASSERT_TRUE(DecodeFp8CaptureToFloat(from_bf16, r.T, r.K, r.H, got_bf16).ok());
  const double via_bf16 = Rms(got_bf16, r.states);
  EXPECT_LE(via_bf16, 1.1 * reference) << GetParam();
  // And e4m3's error is what it should be beside bf16's: 4 significant bits
  // against 8, about 16x (a broken scale would show here first).
  std::vector<float> bf16_values(n);
  for (size_t i = 0; i < n; ++i) bf16_values[i] = Bf16ToFloat(bits[i]);
  const double bf16 = Rms(bf16_values, r.states);
  EXPECT_GT(fp8, 8 * bf16);
  EXPECT_LT(fp8, 32 * bf16);
  std::printf("%s: rms error fp8 %.4g (e4m3 rounding %.4g, via bf16 %.4g = %.4fx), bf16 %.4g\n",
              GetParam(), fp8, reference, via_bf16, via_bf16 / reference, bf16);
}

INSTANTIATE_TEST_SUITE_P(DenseAndMoe, CpuEngineFp8Test,
                         ::testing::Values("tiny-random", "tiny-random-moe"), [](const auto& info) {
                           std::string name = info.param;
                           std::erase(name, '-');
                           return name;
                         });

}  // namespace
}  // namespace draftfeed
