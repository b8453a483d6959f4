#include "kernels/cpu/rmsnorm.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace draftfeed::cpu {
namespace {

// Expected values below were worked out in double. The kernel does a handful
// of fp32 roundings per element (sum kept in double), so a few fp32 ulps of
// relative error is all it can show: 1e-6 relative is ~8 ulps.
void ExpectClose(const std::vector<float>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], 1e-6 * std::fabs(want[i]) + 1e-7) << "element " << i;
  }
}

TEST(RmsNormTest, ZeroCentredScalesByOnePlusWeight) {
  // mean(x²) = 30/4 = 7.5, so x̂ = x / sqrt(7.5).
  const std::vector<float> x = {1, 2, 3, 4};
  const std::vector<float> w = {0, 0.5f, -0.5f, 1};
  std::vector<float> y(4);
  RmsNorm(x.data(), w.data(), 1, 4, 0.0f, RmsNormKind::kZeroCentred, y.data());
  ExpectClose(y, {0.3651483716701107, 1.0954451150103321, 0.5477225575051661, 2.9211869733608857});
}

TEST(RmsNormTest, MultiplicativeScalesByWeight) {
  const std::vector<float> x = {1, 2, 3, 4};
  const std::vector<float> w = {1, 0.5f, 2, -1};
  std::vector<float> y(4);
  RmsNorm(x.data(), w.data(), 1, 4, 0.0f, RmsNormKind::kMultiplicative, y.data());
  ExpectClose(y, {0.3651483716701107, 0.3651483716701107, 2.1908902300206643, -1.4605934866804429});
}

TEST(RmsNormTest, ZeroWeightMeansIdentityScaleOnlyForZeroCentred) {
  // The silent failure the design warns of: w ≈ 0 read with the wrong
  // convention collapses the output.
  const std::vector<float> x = {3, 4};
  const std::vector<float> w = {0, 0};
  std::vector<float> zc(2), mul(2);
  RmsNorm(x.data(), w.data(), 1, 2, 0.0f, RmsNormKind::kZeroCentred, zc.data());
  RmsNorm(x.data(), w.data(), 1, 2, 0.0f, RmsNormKind::kMultiplicative, mul.data());
  ExpectClose(zc, {3 / std::sqrt(12.5), 4 / std::sqrt(12.5)});
  ExpectClose(mul, {0, 0});
}

TEST(RmsNormTest, EpsIsAddedToTheMeanSquare) {
  // mean(x²) = 12.5, + eps 0.5 = 13.
  const std::vector<float> x = {3, 4};
  const std::vector<float> w = {1, 1};
  std::vector<float> y(2);
  RmsNorm(x.data(), w.data(), 1, 2, 0.5f, RmsNormKind::kMultiplicative, y.data());
  ExpectClose(y, {0.8320502943378437, 1.1094003924504583});
}

TEST(RmsNormTest, RowsAreIndependentAndInPlaceWorks) {
  // Three rows of odd width 5, checked against a double-precision formula,
  // computed in place (y aliases x) as the per-head q/k norms do.
  const int64_t rows = 3, width = 5;
  std::vector<float> x(rows * width), w(width);
  for (int64_t i = 0; i < rows * width; ++i) x[i] = std::sin(0.7 * i + 0.3) * (1 + i % 4);
  for (int64_t i = 0; i < width; ++i) w[i] = 0.1f * static_cast<float>(i) - 0.2f;
  std::vector<double> want(rows * width);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < width; ++i) ss += double(x[r * width + i]) * x[r * width + i];
    const double inv = 1.0 / std::sqrt(ss / width + 1e-6);
    for (int64_t i = 0; i < width; ++i) want[r * width + i] = x[r * width + i] * inv * (1.0 + w[i]);
  }
  RmsNorm(x.data(), w.data(), rows, width, 1e-6f, RmsNormKind::kZeroCentred, x.data());
  ExpectClose(x, want);
}

TEST(GatedRmsNormTest, MultipliesWeightNormAndSiluGate) {
  // SiLU(z) for z = 0, 1, −1, 2 is 0, 0.7311, −0.2689, 1.7616.
  const std::vector<float> x = {1, 2, 3, 4};
  const std::vector<float> z = {0, 1, -1, 2};
  const std::vector<float> w = {1, 1, 2, 0.5f};
  std::vector<float> y(4);
  GatedRmsNorm(x.data(), z.data(), w.data(), 1, 4, 0.0f, y.data());
  ExpectClose(y, {0.0, 0.5338896991644237, -0.5892211325273929, 1.2864864751816611});
}

TEST(GatedRmsNormTest, TwoRowsUseTheirOwnStatistics) {
  const std::vector<float> x = {1, 2, 3, 4, 10, 20, 30, 40};
  const std::vector<float> z = {50, 50, 50, 50, 50, 50, 50, 50};  // SiLU(50) = 50 in fp32
  const std::vector<float> w = {1, 1, 1, 1};
  std::vector<float> y(8);
  GatedRmsNorm(x.data(), z.data(), w.data(), 2, 4, 0.0f, y.data());
  // Scaling a row by 10 leaves its normalised values unchanged.
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(y[i], y[i + 4], 1e-5f) << i;
  EXPECT_NEAR(y[3], 50 * 4 / std::sqrt(7.5), 1e-4);
}

}  // namespace
}  // namespace draftfeed::cpu
