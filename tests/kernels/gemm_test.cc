#include "kernels/cpu/gemm.h"

#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace draftfeed::cpu {
namespace {

std::vector<float> Random(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

// Checks Gemm against a naive triple loop in double. A k-term fp32 dot
// product in any order is within k·u·Σ|x·w| of the exact sum (u = 2^−24),
// the textbook bound; 2x that leaves room for the final store rounding.
void CheckAgainstNaive(int64_t m, int64_t n, int64_t k, int threads) {
  const std::vector<float> x = Random(m * k, 1 + m), w = Random(n * k, 2 + n);
  std::vector<float> y(static_cast<size_t>(m * n), NAN);
  Gemm(x.data(), w.data(), y.data(), m, n, k, threads);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0, mag = 0;
      for (int64_t p = 0; p < k; ++p) {
        ref += double(x[i * k + p]) * w[j * k + p];
        mag += std::fabs(double(x[i * k + p]) * w[j * k + p]);
      }
      const double tol = 2.0 * static_cast<double>(k) * 0x1p-24 * mag + 1e-30;
      ASSERT_NEAR(y[i * n + j], ref, tol) << "m=" << m << " n=" << n << " k=" << k << " at (" << i
                                          << ", " << j << ") threads=" << threads;
    }
  }
}

TEST(GemmTest, OddSizesMatchNaiveForSeveralThreadCounts) {
  for (int threads : {1, 2, 3, 8}) {
    CheckAgainstNaive(37, 53, 71, threads);
    CheckAgainstNaive(1, 1, 1, threads);
    CheckAgainstNaive(6, 16, 256, threads);    // exactly one register tile and K panel
    CheckAgainstNaive(97, 301, 523, threads);  // several M/N blocks and K panels, ragged
    CheckAgainstNaive(5, 3, 1000, threads);
  }
}

TEST(GemmTest, ZeroInnerDimensionWritesZeros) {
  std::vector<float> y(6, 7.0f);
  Gemm(nullptr, nullptr, y.data(), 2, 3, 0, 2);
  EXPECT_EQ(y, std::vector<float>(6, 0.0f));
}

TEST(GemmTest, BitIdenticalAcrossThreadCountsAndRowSubsets) {
  // The engine relies on this for packed == separate: a row of Y must not
  // depend on how many rows are multiplied with it, where it sits in a tile
  // or how many threads ran.
  const int64_t m = 211, n = 270, k = 300;
  const std::vector<float> x = Random(m * k, 7), w = Random(n * k, 8);
  std::vector<float> y1(m * n), y4(m * n);
  Gemm(x.data(), w.data(), y1.data(), m, n, k, 1);
  Gemm(x.data(), w.data(), y4.data(), m, n, k, 4);
  EXPECT_EQ(y1, y4);
  for (const auto& [row0, rows] : {std::pair<int64_t, int64_t>{0, 1}, {5, 13}, {100, 111}}) {
    std::vector<float> part(rows * n);
    Gemm(x.data() + row0 * k, w.data(), part.data(), rows, n, k, 2);
    for (int64_t i = 0; i < rows * n; ++i) {
      ASSERT_EQ(part[i], y1[row0 * n + i]) << "rows from " << row0 << ", element " << i;
    }
  }
}

}  // namespace
}  // namespace draftfeed::cpu
