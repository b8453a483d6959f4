// The fp8_e4m3 capture codec: a row checked by hand, the layout (codes, then
// unaligned little-endian scales), the all-zero and NaN rows, the scale that
// puts the row's largest magnitude on 448 exactly, the per-element error bound
// of decode(encode(x)), and the bf16 decoder's two paths agreeing bit for bit.
#include "common/fp8_capture.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/capture_encoding.h"
#include "common/fp8_e4m3.h"

namespace draftfeed {
namespace {

std::vector<float> RandomRows(int64_t rows, int64_t hidden, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_mag(-12.0f, 12.0f);
  std::vector<float> x(static_cast<size_t>(rows * hidden));
  for (int64_t r = 0; r < rows; ++r) {
    // Rows of very different magnitudes, and an outlier channel in some, as
    // hidden states have.
    const float mag = std::exp2(log_mag(rng));
    for (int64_t i = 0; i < hidden; ++i) x[r * hidden + i] = normal(rng) * mag;
    if (r % 3 == 0) x[r * hidden + (r % hidden)] *= 50.0f;
  }
  return x;
}

// Half the e4m3 spacing around |v| (v in units of the scale): 2^-10 below
// the smallest normal 2^-6, else 2^(e-4) for |v| in [2^e, 2^(e+1)).
double HalfStep(double v) {
  const double a = std::fabs(v);
  if (a < 0x1p-6) return 0x1p-10;
  return std::ldexp(1.0, static_cast<int>(std::floor(std::log2(a))) - 4);
}

uint16_t RoundBf16(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

TEST(Fp8CaptureTest, BytesPerTokenAreCodesThenScales) {
  EXPECT_EQ(CaptureBytesPerToken(CaptureEncoding::kFp8E4m3, 5, 5120), 5 * 5120 + 20);
  EXPECT_EQ(CaptureBytesPerToken(CaptureEncoding::kBf16, 5, 5120), 5 * 5120 * 2);
  EXPECT_EQ(EncodingName(CaptureEncoding::kFp8E4m3), "fp8_e4m3");
  EXPECT_EQ(EncodingFromWire(2), CaptureEncoding::kFp8E4m3);
  EXPECT_EQ(EncodingFromWire(3), std::nullopt);  // 3 (once bf16_zstd): reserved
}

TEST(Fp8CaptureTest, EncodesAHandCheckedRow) {
  // amax 3.5: scale 3.5 / 448 = 2^-7, so the codes are x * 128 rounded.
  const std::vector<float> x = {3.5f, -1.75f, 0.0f, 0.4375f, 1.0f, 0.3f};
  std::vector<std::byte> out(6 + 4);
  ASSERT_TRUE(EncodeFp8Capture(x, 1, 1, 6, out).ok());
  const std::vector<uint8_t> want = {
      0x7e,  // 448 = 2^8 * 1.75
      0xf6,  // -224 = -(2^7 * 1.75)
      0x00,  // 0
      0x66,  // 56 = 2^5 * 1.75
      0x70,  // 128 = 2^7
      0x62,  // 38.4 -> 40 = 2^5 * 1.25 (spacing 4 there)
  };
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(static_cast<uint8_t>(out[i]), want[i]) << i;
  }
  // The scale, little endian: 2^-7 is 0x3c000000.
  EXPECT_EQ(static_cast<uint8_t>(out[6]), 0x00);
  EXPECT_EQ(static_cast<uint8_t>(out[7]), 0x00);
  EXPECT_EQ(static_cast<uint8_t>(out[8]), 0x00);
  EXPECT_EQ(static_cast<uint8_t>(out[9]), 0x3c);
  std::vector<float> back(6);
  ASSERT_TRUE(DecodeFp8CaptureToFloat(out, 1, 1, 6, back).ok());
  EXPECT_EQ(back[0], 3.5f);
  EXPECT_EQ(back[1], -1.75f);
  EXPECT_EQ(back[2], 0.0f);
  EXPECT_EQ(back[3], 0.4375f);
  EXPECT_EQ(back[4], 1.0f);
  EXPECT_EQ(back[5], 0.3125f);
}

TEST(Fp8CaptureTest, AnAllZeroRowHasScaleOne) {
  const int64_t T = 2, K = 2, H = 7;
  std::vector<float> x(static_cast<size_t>(T * K * H), 0.0f);
  for (int64_t i = 0; i < H; ++i) x[static_cast<size_t>(H + i)] = 1.0f + i;  // row (0, 1)
  std::vector<std::byte> out(static_cast<size_t>(T * (K * H + 4 * K)));
  ASSERT_TRUE(EncodeFp8Capture(x, T, K, H, out).ok());
  EXPECT_EQ(Fp8CaptureScale(out.data(), K, H, 0, 0), 1.0f);
  EXPECT_EQ(Fp8CaptureScale(out.data(), K, H, 0, 1), 7.0f / 448.0f);
  EXPECT_EQ(Fp8CaptureScale(out.data(), K, H, 1, 0), 1.0f);
  EXPECT_EQ(Fp8CaptureScale(out.data(), K, H, 1, 1), 1.0f);
  std::vector<float> back(x.size());
  ASSERT_TRUE(DecodeFp8CaptureToFloat(out, T, K, H, back).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] == 0.0f) {
      EXPECT_EQ(back[i], 0.0f) << i;
    }
  }
  // A magnitude so small that amax / 448 underflows to 0 gets scale 1 too
  // (and codes 0) instead of a division by zero.
  const std::vector<float> tiny = {std::numeric_limits<float>::denorm_min(), 0.0f};
  std::vector<std::byte> tiny_out(2 + 4);
  ASSERT_TRUE(EncodeFp8Capture(tiny, 1, 1, 2, tiny_out).ok());
  EXPECT_EQ(Fp8CaptureScale(tiny_out.data(), 1, 2, 0, 0), 1.0f);
  EXPECT_EQ(static_cast<uint8_t>(tiny_out[0]), 0x00);
}

TEST(Fp8CaptureTest, LaysOutEveryRowAtItsPlace) {
  // H odd, so the scales are unaligned; every row as EncodeFp8Row makes it.
  const int64_t T = 3, K = 3, H = 5;
  const std::vector<float> x = RandomRows(T * K, H, 1);
  std::vector<std::byte> out(static_cast<size_t>(T * (K * H + 4 * K)));
  ASSERT_TRUE(EncodeFp8Capture(x, T, K, H, out).ok());
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      uint8_t codes[H];
      const float s = EncodeFp8Row(x.data() + (t * K + k) * H, H, codes);
      EXPECT_EQ(Fp8CaptureScale(out.data(), K, H, t, k), s);
      const std::byte* token = out.data() + t * (K * H + 4 * K);
      EXPECT_EQ(std::memcmp(token + k * H, codes, H), 0) << t << "," << k;
      float stored;
      std::memcpy(&stored, token + K * H + 4 * k, 4);
      EXPECT_EQ(stored, s);
    }
  }
}

TEST(Fp8CaptureTest, TheLargestMagnitudeLandsOn448AndNothingSaturates) {
  const int64_t rows = 400, H = 257;
  const std::vector<float> x = RandomRows(rows, H, 2);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data() + r * H;
    std::vector<uint8_t> codes(H);
    const float s = EncodeFp8Row(row, H, codes.data());
    float amax = 0;
    for (int64_t i = 0; i < H; ++i) amax = std::max(amax, std::fabs(row[i]));
    EXPECT_EQ(s, amax / 448.0f) << r;
    int at_max = 0;
    for (int64_t i = 0; i < H; ++i) {
      // By construction |x / s| <= 448 (up to the division's rounding, which
      // e4m3 rounds back to 448): satfinite never clips a value.
      EXPECT_LE(std::fabs(row[i] / s), 448.0f * (1.0f + 0x1p-23f)) << r << "," << i;
      if (std::fabs(row[i]) == amax) {
        EXPECT_EQ(codes[i] & 0x7f, 0x7e) << r << "," << i;
        ++at_max;
      } else {
        EXPECT_NE(codes[i] & 0x7f, 0x7f) << "NaN code for a number";
      }
    }
    EXPECT_GE(at_max, 1);
  }
}

TEST(Fp8CaptureTest, DecodedValuesAreWithinHalfAStep) {
  const int64_t T = 64, K = 3, H = 300;
  const std::vector<float> x = RandomRows(T * K, H, 3);
  std::vector<std::byte> out(static_cast<size_t>(T * (K * H + 4 * K)));
  ASSERT_TRUE(EncodeFp8Capture(x, T, K, H, out).ok());
  std::vector<float> back(x.size());
  ASSERT_TRUE(DecodeFp8CaptureToFloat(out, T, K, H, back).ok());
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const double s = Fp8CaptureScale(out.data(), K, H, t, k);
      for (int64_t i = 0; i < H; ++i) {
        const size_t j = static_cast<size_t>((t * K + k) * H + i);
        const double err = std::fabs(static_cast<double>(back[j]) - x[j]);
        // Half an e4m3 step at x / s, times s; plus the fp32 division's and
        // multiply's roundings (each under 2^-24 relative).
        const double bound = HalfStep(x[j] / s) * s + 0x1p-22 * std::fabs(x[j]);
        EXPECT_LE(err, bound) << t << "," << k << "," << i << " x=" << x[j];
        worst = std::max(worst, err / bound);
      }
    }
  }
  // Round to nearest uses most of the half step somewhere in 57,600 values:
  // a decoder off by a step, or a truncating encoder, fails the bound above,
  // and one that were far too exact would mean the test measures nothing.
  EXPECT_GT(worst, 0.9);
}

TEST(Fp8CaptureTest, Bf16DecodeIsOneRoundingOfTheFloatDecode) {
  // H = 300 takes the per-row table path, H = 100 the direct one: both give
  // bf16(float(code) * scale) for every element.
  for (const int64_t H : {int64_t{100}, int64_t{300}}) {
    const int64_t T = 16, K = 2;
    const std::vector<float> x = RandomRows(T * K, H, 4 + H);
    std::vector<std::byte> out(static_cast<size_t>(T * (K * H + 4 * K)));
    ASSERT_TRUE(EncodeFp8Capture(x, T, K, H, out).ok());
    std::vector<float> f(x.size());
    std::vector<uint16_t> b(x.size());
    ASSERT_TRUE(DecodeFp8CaptureToFloat(out, T, K, H, f).ok());
    ASSERT_TRUE(DecodeFp8CaptureToBf16(out, T, K, H, b).ok());
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(b[i], RoundBf16(f[i])) << H << ":" << i;
  }
}

TEST(Fp8CaptureTest, TheBf16EncoderWidensFirst) {
  const int64_t T = 5, K = 2, H = 33;
  std::vector<float> x = RandomRows(T * K, H, 5);
  std::vector<uint16_t> bits(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    bits[i] = RoundBf16(x[i]);
    x[i] = std::bit_cast<float>(static_cast<uint32_t>(bits[i]) << 16);
  }
  std::vector<std::byte> a(static_cast<size_t>(T * (K * H + 4 * K))), b(a.size());
  ASSERT_TRUE(EncodeFp8Capture(x, T, K, H, a).ok());
  ASSERT_TRUE(EncodeFp8CaptureBf16(bits, T, K, H, b).ok());
  EXPECT_EQ(a, b);
}

TEST(Fp8CaptureTest, ANanStaysNaNAndTheRowScalesWithoutIt) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {nan, 3.5f, -1.75f, 0.4375f};
  uint8_t codes[4];
  const float s = EncodeFp8Row(x.data(), 4, codes);
  EXPECT_EQ(s, 0x1p-7f);  // 3.5 / 448, the NaN left out of the max
  EXPECT_EQ(codes[0] & 0x7f, 0x7f);
  EXPECT_EQ(codes[1], 0x7e);
  EXPECT_EQ(codes[2], 0xf6);
  EXPECT_EQ(codes[3], 0x66);
}

TEST(Fp8CaptureTest, RefusesMismatchedSizesByName) {
  std::vector<float> x(2 * 3 * 4);
  std::vector<std::byte> out(2 * (3 * 4 + 12) - 1);
  const absl::Status s = EncodeFp8Capture(x, 2, 3, 4, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("EncodeFp8Capture"), std::string::npos) << s;
  EXPECT_NE(s.message().find("48 fp8_e4m3 bytes"), std::string::npos) << s;
  std::vector<uint16_t> b(2 * 3 * 4 + 1);
  std::vector<std::byte> in(48);
  const absl::Status d = DecodeFp8CaptureToBf16(in, 2, 3, 4, b);
  EXPECT_EQ(d.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(d.message().find("got 25 values"), std::string::npos) << d;
}

}  // namespace
}  // namespace draftfeed
