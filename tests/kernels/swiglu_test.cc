#include "kernels/cpu/swiglu.h"

#include <cmath>
#include <vector>

#include "gtest/gtest.h"

namespace draftfeed::cpu {
namespace {

TEST(SwiGluTest, HandComputedValues) {
  // SiLU(g)·u worked out in double; fp32 exp + divide + multiply is within
  // a few ulps, hence 1e-6 relative. The extremes check the formula stays
  // finite: SiLU(−100) underflows towards −0 and SiLU(100) is exactly 100.
  const std::vector<float> gate = {0, 1, -1, 2, -100, 100};
  const std::vector<float> up = {3, 2, 4, 0.5f, 1, 1};
  const std::vector<double> want = {
      0.0,  1.4621171572600098, -1.0757656854799804, 0.8807970779778823, -3.720075976020836e-42,
      100.0};
  std::vector<float> out(gate.size());
  SwiGlu(gate.data(), up.data(), static_cast<int64_t>(gate.size()), out.data());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(out[i], want[i], 1e-6 * std::abs(want[i]) + 1e-30) << i;
  }
  EXPECT_EQ(out[5], 100.0f);
}

TEST(SwiGluTest, InPlaceOverGate) {
  std::vector<float> gate = {1, -1};
  const std::vector<float> up = {2, 4};
  SwiGlu(gate.data(), up.data(), 2, gate.data());
  EXPECT_NEAR(gate[0], 1.4621171572600098, 1e-6);
  EXPECT_NEAR(gate[1], -1.0757656854799804, 1e-6);
}

}  // namespace
}  // namespace draftfeed::cpu
