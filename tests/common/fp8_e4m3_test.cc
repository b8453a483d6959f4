// The host e4m3 conversions against the format's definition: every value
// round-trips, ties go to the even code, the neighbours of a tie go to their
// side, and out-of-range values saturate as the hardware's satfinite does.
#include "common/fp8_e4m3.h"

#include <gtest/gtest.h>

#include <cmath>

namespace draftfeed {
namespace {

TEST(Fp8E4m3Test, DecodesTheFormatsLandmarks) {
  EXPECT_EQ(E4m3ToFloat(0x00), 0.0f);
  EXPECT_EQ(E4m3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(E4m3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(E4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0xfe), -448.0f);
  EXPECT_TRUE(std::isnan(E4m3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(E4m3ToFloat(0xff)));
  for (int v = 0; v < 256; ++v) {
    const float a = E4m3ToFloat(static_cast<uint8_t>(v));
    const float b = E4m3ToFloatFast(static_cast<uint8_t>(v));
    if (std::isnan(a)) {
      EXPECT_TRUE(std::isnan(b));
    } else {
      EXPECT_EQ(a, b) << v;
    }
  }
}

TEST(Fp8E4m3Test, EveryFiniteCodeRoundTrips) {
  for (int v = 0; v < 256; ++v) {
    if (v == 0x7f || v == 0xff) continue;
    EXPECT_EQ(FloatToE4m3(E4m3ToFloat(static_cast<uint8_t>(v))), v) << v;
  }
}

TEST(Fp8E4m3Test, RoundsToNearestEven) {
  for (int sign : {0x00, 0x80}) {
    for (int v = 0; v < 0x7e; ++v) {
      const float lo = E4m3ToFloat(static_cast<uint8_t>(sign | v));
      const float hi = E4m3ToFloat(static_cast<uint8_t>(sign | (v + 1)));
      const float mid = (lo + hi) / 2;  // exact in fp32
      const int even = (v % 2 == 0) ? v : v + 1;
      EXPECT_EQ(FloatToE4m3(mid), sign | even) << "tie above code " << v;
      EXPECT_EQ(FloatToE4m3(std::nextafter(mid, lo)), sign | v) << v;
      EXPECT_EQ(FloatToE4m3(std::nextafter(mid, hi)), sign | (v + 1)) << v;
    }
  }
}

TEST(Fp8E4m3Test, SaturatesLikeSatfinite) {
  EXPECT_EQ(FloatToE4m3(448.0f), 0x7e);
  EXPECT_EQ(FloatToE4m3(464.0f), 0x7e);  // the tie with the next (missing) code
  EXPECT_EQ(FloatToE4m3(1e30f), 0x7e);
  EXPECT_EQ(FloatToE4m3(-1e30f), 0xfe);
  EXPECT_EQ(FloatToE4m3(INFINITY), 0x7e);
  EXPECT_EQ(FloatToE4m3(-INFINITY), 0xfe);
  EXPECT_EQ(FloatToE4m3(NAN), 0x7f);
  EXPECT_EQ(FloatToE4m3(std::ldexp(1.0f, -11)), 0x00);  // below half the smallest subnormal
  EXPECT_EQ(FloatToE4m3(-0.0f), 0x80);
}

}  // namespace
}  // namespace draftfeed
