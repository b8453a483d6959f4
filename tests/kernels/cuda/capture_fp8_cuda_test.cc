// The GPU fp8_e4m3 capture encoder against the host encoder: the same bytes,
// codes and scales, on random bf16 rows of very different magnitudes, an
// all-zero row, exact ties of the e4m3 grid, and odd widths (unaligned
// scales). Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/fp8_capture.h"
#include "kernels/capture_fp8.cuh"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda {
namespace {

using ::draftfeed::testing::DeviceBuffer;

uint16_t RoundBf16(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

// [T, K, H] bf16 bit patterns: rows of magnitudes 2^-20 .. 2^20, an outlier
// channel in some, row (0, 0) all zero, and in row (1 % T, 1 % K) values that
// are exact ties of the e4m3 grid once divided by the row's scale.
std::vector<uint16_t> Rows(int64_t T, int64_t K, int64_t H, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> log_mag(-20.0f, 20.0f);
  std::vector<uint16_t> x(static_cast<size_t>(T * K * H));
  for (int64_t r = 0; r < T * K; ++r) {
    const float mag = std::exp2(log_mag(rng));
    for (int64_t i = 0; i < H; ++i) x[r * H + i] = RoundBf16(normal(rng) * mag);
    if (r % 4 == 1) x[r * H + (r % H)] = RoundBf16(100.0f * mag);
  }
  std::fill_n(x.begin(), H, uint16_t{0});  // all-zero row: scale 1
  const int64_t tie_row = (1 % T) * K + (1 % K);
  if (tie_row != 0 && H >= 4) {
    // amax 448 -> scale 1: 1.0625 lies halfway between 1 and 1.125 (even:
    // 1), 1.1875 between 1.125 and 1.25 (even: 1.25), 17 between 16 and 18.
    const float ties[4] = {448.0f, 1.0625f, -1.1875f, 17.0f};
    for (int i = 0; i < 4; ++i) x[tie_row * H + i] = RoundBf16(ties[i]);
  }
  return x;
}

class CaptureFp8CudaTest : public ::testing::TestWithParam<std::tuple<int, int, int>> {};

TEST_P(CaptureFp8CudaTest, MatchesTheHostEncoderBitForBit) {
  DF_REQUIRE_GPU();
  const auto [T, K, H] = GetParam();
  const std::vector<uint16_t> x = Rows(T, K, H, 7 + T * 31 + H);
  const size_t bytes = static_cast<size_t>(T) * (K * H + 4 * K);
  std::vector<std::byte> want(bytes);
  ASSERT_TRUE(EncodeFp8CaptureBf16(x, T, K, H, want).ok());
  DeviceBuffer<uint16_t> d_x(x);
  DeviceBuffer<uint8_t> d_out(std::vector<uint8_t>(bytes, 0xa5));  // poison
  DF_CUDA_OK(
      EncodeFp8Capture(reinterpret_cast<const bf16*>(d_x.get()), T, K, H, d_out.get(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = d_out.Download();
  size_t mismatches = 0;
  for (size_t i = 0; i < bytes; ++i) {
    if (got[i] != static_cast<uint8_t>(want[i]) && ++mismatches <= 5) {
      ADD_FAILURE() << "byte " << i << " (token " << i / (K * H + 4 * K) << "): GPU 0x" << std::hex
                    << int{got[i]} << ", host 0x" << int(want[i]);
    }
  }
  EXPECT_EQ(mismatches, 0u);
  float s00;
  std::memcpy(&s00, got.data() + K * H, 4);
  EXPECT_EQ(s00, 1.0f);  // the all-zero row
}

INSTANTIATE_TEST_SUITE_P(Shapes, CaptureFp8CudaTest,
                         ::testing::Values(std::make_tuple(1, 1, 4), std::make_tuple(3, 2, 5),
                                           std::make_tuple(17, 3, 257),
                                           std::make_tuple(40, 5, 5120),
                                           std::make_tuple(9, 4, 2048)));

TEST(CaptureFp8CudaErrorsTest, NegativeShapeIsRefused) {
  DF_REQUIRE_GPU();
  EXPECT_EQ(EncodeFp8Capture(nullptr, -1, 1, 1, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(EncodeFp8Capture(nullptr, 0, 3, 8, nullptr, nullptr), cudaSuccess);  // nothing to do
}

}  // namespace
}  // namespace draftfeed::cuda
