// cuBLAS's grouped GEMM (bench/micro/moe_cublas.h, the route draftfeed-bench-kernels times
// beside ours) against the fused MoE GEMMs of kernels/moe_gemm.cu on one small routing, so
// that the benchmark compares the same maths: the same rows of the same experts, the same
// layouts, fp32 accumulation, one rounding to bf16.
//
// The routing: 6 experts, top 2, 300 tokens; expert 0 takes 200 rows (two row tiles, the
// second partial), expert 3 none (left out of cuBLAS's groups), the rest share the other 400.
// D = 136 and I = 72 are not multiples of the kernels' 64-element K step or 128-column tile.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "bench/micro/moe_cublas.h"
#include "gtest/gtest.h"
#include "kernels/elementwise.cuh"
#include "kernels/moe.cuh"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda {
namespace {

using ::draftfeed::bench::CublasGroupedGemm;
using ::draftfeed::bench::MoeGatherRows;
using ::draftfeed::testing::DeviceBuffer;
using ::draftfeed::testing::RandomBf16Values;
using ::draftfeed::testing::ToBf16;
using ::draftfeed::testing::ToF32;

constexpr int kExperts = 6, kTopK = 2;
constexpr int64_t kTokens = 300, kHidden = 136, kInter = 72, kRows = kTokens * kTopK;

std::vector<int32_t> ExpertIds() {
  const int others[4] = {1, 2, 4, 5};
  std::vector<int32_t> ids(kRows);
  for (int64_t t = 0; t < kTokens; ++t) {
    const int j = static_cast<int>(t % 4);
    ids[t * kTopK] = t < 200 ? 0 : others[j];
    ids[t * kTopK + 1] = t < 200 ? others[j] : others[(j + 1 + (t / 4) % 3) % 4];
  }
  return ids;
}

// Values in {-1, 0, 1} (or {-2, ..., 2}): every product and partial sum of up to 136 terms
// is a small integer, exact in fp32 in any order and exact in bf16 (|sum| <= 256).
std::vector<float> SmallIntegers(size_t n, int max_abs, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> d(-max_abs, max_abs);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(d(rng));
  return v;
}

uint16_t Bits(bf16 v) {
  uint16_t b;
  std::memcpy(&b, &v, 2);
  return b;
}

// One bf16 ulp at |v| (8 significant bits).
double UlpBf16(double v) {
  int e;
  std::frexp(std::max(std::abs(v), 1e-30), &e);
  return std::ldexp(1.0, e - 8);
}

struct Outputs {
  std::vector<int32_t> offsets, row_token;
  std::vector<bf16> act_ours, act_cublas;  // [rows, I]
  std::vector<bf16> gate_up_cublas;        // [rows, 2I]: cuBLAS's gate | up before the SwiGLU
  std::vector<bf16> y_ours, y_cublas;      // [rows, D], both from the same `act_in`
  int groups = 0;
};

// Both routes over the same routing: gate_up from x, down from act_in (given, so that the
// down GEMMs see identical inputs whatever the gate_up GEMMs did).
void RunBoth(const std::vector<float>& x, const std::vector<float>& gate_up,
             const std::vector<float>& down, const std::vector<float>& act_in, Outputs* out) {
  DeviceBuffer<bf16> dx(ToBf16(x)), dgu(ToBf16(gate_up)), dd(ToBf16(down)), dact(ToBf16(act_in));
  DeviceBuffer<char> ws(MoeWorkspaceBytes(kTokens, kExperts, kTopK, kHidden, kInter));
  const MoeBuffers b = CarveMoeWorkspace(ws.get(), kTokens, kExperts, kTopK, kHidden, kInter);
  const std::vector<int32_t> ids = ExpertIds();
  DF_CUDA_OK(cudaMemcpy(b.expert_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  DF_CUDA_OK(MoePermute(b.expert_ids, kTokens, kExperts, kTopK, b.routing, nullptr));
  DeviceBuffer<bf16> y(kRows * kHidden);
  DF_CUDA_OK(MoeGateUpSwiGlu(dx.get(), kHidden, dgu.get(), kHidden, kInter, kExperts, kRows,
                             b.routing, b.act, nullptr));
  DF_CUDA_OK(
      MoeDown(dact.get(), dd.get(), kHidden, kInter, kExperts, kRows, b.routing, y.get(), nullptr));

  // The benchmark's route: offsets to the host, gather, grouped GEMM, SwiGLU; the down GEMM.
  out->offsets.resize(kExperts + 1);
  out->row_token.resize(kRows);
  DF_CUDA_OK(cudaMemcpy(out->offsets.data(), b.routing.offsets, out->offsets.size() * 4,
                        cudaMemcpyDeviceToHost));
  DF_CUDA_OK(
      cudaMemcpy(out->row_token.data(), b.routing.row_token, kRows * 4, cudaMemcpyDeviceToHost));
  DeviceBuffer<bf16> xs(kRows * kHidden), gu(kRows * 2 * kInter), act(kRows * kInter),
      yc(kRows * kHidden);
  DF_CUDA_OK(
      MoeGatherRows(dx.get(), kHidden, b.routing.row_token, kRows, kHidden, xs.get(), nullptr));
  CublasGroupedGemm gemm_gu, gemm_d;
  ASSERT_EQ(gemm_gu.Init(kExperts), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(gemm_d.Init(kExperts), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(gemm_gu.Plan(out->offsets.data(), kExperts, xs.get(), kHidden, dgu.get(), 2 * kInter,
                         kHidden, gu.get(), 2 * kInter, nullptr),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(gemm_gu.Run(nullptr), CUBLAS_STATUS_SUCCESS);
  DF_CUDA_OK(SwiGlu(gu.get(), kRows, kInter, act.get(), nullptr));
  ASSERT_EQ(gemm_d.Plan(out->offsets.data(), kExperts, dact.get(), kInter, dd.get(), kHidden,
                        kInter, yc.get(), kHidden, nullptr),
            CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(gemm_d.Run(nullptr), CUBLAS_STATUS_SUCCESS);
  DF_CUDA_OK(cudaDeviceSynchronize());
  out->groups = gemm_gu.groups();

  std::vector<bf16> act_ours(kRows * kInter);
  DF_CUDA_OK(cudaMemcpy(act_ours.data(), b.act, act_ours.size() * 2, cudaMemcpyDeviceToHost));
  out->act_ours = act_ours;
  out->act_cublas = act.Download();
  out->gate_up_cublas = gu.Download();
  out->y_ours = y.Download();
  out->y_cublas = yc.Download();
}

int ExpertOfRow(const std::vector<int32_t>& offsets, int64_t r) {
  return static_cast<int>(std::upper_bound(offsets.begin(), offsets.end(), r) - offsets.begin()) -
         1;
}

// Σ_k a[k]·w[k] and Σ_k |a[k]·w[k]| in double.
void Dot(const float* a, const float* w, int64_t k, double* sum, double* abs_sum) {
  *sum = *abs_sum = 0;
  for (int64_t i = 0; i < k; ++i) {
    *sum += static_cast<double>(a[i]) * w[i];
    *abs_sum += std::abs(static_cast<double>(a[i]) * w[i]);
  }
}

TEST(MoeCublasCudaTest, RoutingAsDesigned) {
  DF_REQUIRE_GPU();
  Outputs o;
  RunBoth(std::vector<float>(kTokens * kHidden),
          std::vector<float>(kExperts * 2 * kInter * kHidden),
          std::vector<float>(kExperts * kHidden * kInter), std::vector<float>(kRows * kInter), &o);
  ASSERT_EQ(o.offsets.size(), kExperts + 1u);
  EXPECT_EQ(o.offsets[1] - o.offsets[0], 200);  // two tiles, the second partial
  EXPECT_EQ(o.offsets[4] - o.offsets[3], 0);    // idle: no cuBLAS group
  EXPECT_EQ(o.offsets[kExperts], kRows);
  EXPECT_EQ(o.groups, kExperts - 1);
}

// Exact sums: whatever order either side accumulates in, the results are the same bits.
TEST(MoeCublasCudaTest, ExactIntegersGiveIdenticalBits) {
  DF_REQUIRE_GPU();
  const std::vector<float> x = SmallIntegers(kTokens * kHidden, 1, 1);
  const std::vector<float> gu = SmallIntegers(kExperts * 2 * kInter * kHidden, 1, 2);
  const std::vector<float> d = SmallIntegers(kExperts * kHidden * kInter, 1, 3);
  const std::vector<float> a = SmallIntegers(kRows * kInter, 2, 4);
  Outputs o;
  RunBoth(x, gu, d, a, &o);
  ASSERT_FALSE(HasFailure());

  // cuBLAS's grouped GEMM did the intended product: row r of expert e is token row_token[r]
  // through W_e, value for value.
  const std::vector<float> gu_c = ToF32(o.gate_up_cublas);
  for (int64_t r = 0; r < kRows; ++r) {
    const int e = ExpertOfRow(o.offsets, r);
    const float* xr = &x[o.row_token[r] * kHidden];
    for (int64_t n = 0; n < 2 * kInter; ++n) {
      double s, abs_s;
      Dot(xr, &gu[(e * 2 * kInter + n) * kHidden], kHidden, &s, &abs_s);
      ASSERT_EQ(gu_c[r * 2 * kInter + n], s) << "row " << r << " expert " << e << " col " << n;
    }
  }
  // The gate and up sums are exact bf16 values, so rounding them before the SwiGLU changes
  // nothing, and both SwiGLUs evaluate SiLU(g)·u in fp32 the same way.
  int64_t nonzero = 0;
  for (int64_t i = 0; i < kRows * kInter; ++i) {
    ASSERT_EQ(Bits(o.act_ours[i]), Bits(o.act_cublas[i])) << "act element " << i;
    nonzero += __bfloat162float(o.act_ours[i]) != 0.0f;
  }
  EXPECT_GT(nonzero, kRows * kInter / 2);
  for (int64_t r = 0; r < kRows; ++r) {
    const int e = ExpertOfRow(o.offsets, r);
    for (int64_t n = 0; n < kHidden; ++n) {
      const int64_t i = r * kHidden + n;
      ASSERT_EQ(Bits(o.y_ours[i]), Bits(o.y_cublas[i])) << "y row " << r << " col " << n;
      double s, abs_s;
      Dot(&a[r * kInter], &d[(e * kHidden + n) * kInter], kInter, &s, &abs_s);
      ASSERT_EQ(__bfloat162float(o.y_ours[i]), s) << "y row " << r << " col " << n;
    }
  }
}

// Random bf16 values: the two sides agree within what their different summation orders and
// roundings allow, element by element. Each fp32 sum of K products (exact in fp32: 8-bit by
// 8-bit significands) is within (K-1)·u·Σ|a·w| of the exact one; u = 2^-22, four times fp32's
// unit roundoff, since tensor-core accumulation is not specified as round-to-nearest. Two such
// sums differ by at most 2·K·u·Σ|a·w|, and rounding each to bf16 adds at most one bf16 ulp
// between them. A wrong row, expert or column is off by O(1), far outside.
constexpr double kAccumUnit = 1.0 / (1 << 22);

TEST(MoeCublasCudaTest, RandomValuesAgreeWithinRounding) {
  DF_REQUIRE_GPU();
  const std::vector<float> x = RandomBf16Values(kTokens * kHidden, 1.0f, 11);
  const std::vector<float> gu =
      RandomBf16Values(kExperts * 2 * kInter * kHidden, 1.0f / std::sqrt(136.0f), 12);
  const std::vector<float> d =
      RandomBf16Values(kExperts * kHidden * kInter, 1.0f / std::sqrt(72.0f), 13);
  const std::vector<float> a = RandomBf16Values(kRows * kInter, 1.0f, 14);
  Outputs o;
  RunBoth(x, gu, d, a, &o);
  ASSERT_FALSE(HasFailure());

  // down: the same GEMM on the same bf16 input.
  for (int64_t r = 0; r < kRows; ++r) {
    const int e = ExpertOfRow(o.offsets, r);
    for (int64_t n = 0; n < kHidden; ++n) {
      const int64_t i = r * kHidden + n;
      const double ours = __bfloat162float(o.y_ours[i]), theirs = __bfloat162float(o.y_cublas[i]);
      double s, abs_s;
      Dot(&a[r * kInter], &d[(e * kHidden + n) * kInter], kInter, &s, &abs_s);
      const double tol =
          2.0 * kInter * kAccumUnit * abs_s + UlpBf16(std::max(std::abs(ours), std::abs(theirs)));
      ASSERT_LE(std::abs(ours - theirs), tol) << "y row " << r << " col " << n;
    }
  }
  // gate_up: cuBLAS's route rounds gate G and up U to bf16 before its SwiGLU (half an ulp,
  // at most 2^-8 relative, beside the summation-order bound), ours applies it to the fp32
  // sums. SiLU's slope lies in (-0.1, 1.1), so
  //   |SiLU(G)·U − SiLU(g)·u| <= |SiLU(G)|·e_u + (|U| + e_u)·1.1·e_g,
  // plus one bf16 ulp between the two final roundings and a few fp32 ulps of evaluation.
  const std::vector<float> gu_c = ToF32(o.gate_up_cublas);
  for (int64_t r = 0; r < kRows; ++r) {
    const int e = ExpertOfRow(o.offsets, r);
    const float* xr = &x[o.row_token[r] * kHidden];
    for (int64_t i = 0; i < kInter; ++i) {
      const double g = gu_c[r * 2 * kInter + i], u = gu_c[r * 2 * kInter + kInter + i];
      double s, abs_g, abs_u;
      Dot(xr, &gu[(e * 2 * kInter + i) * kHidden], kHidden, &s, &abs_g);
      Dot(xr, &gu[(e * 2 * kInter + kInter + i) * kHidden], kHidden, &s, &abs_u);
      const double e_g = 1.01 * std::ldexp(std::abs(g), -8) + 2.0 * kHidden * kAccumUnit * abs_g;
      const double e_u = 1.01 * std::ldexp(std::abs(u), -8) + 2.0 * kHidden * kAccumUnit * abs_u;
      const double silu = g / (1.0 + std::exp(-g));
      const double ours = __bfloat162float(o.act_ours[r * kInter + i]);
      const double theirs = __bfloat162float(o.act_cublas[r * kInter + i]);
      const double big = std::max(std::abs(ours), std::abs(theirs));
      const double tol =
          std::abs(silu) * e_u + (std::abs(u) + e_u) * 1.1 * e_g + UlpBf16(big) + 1e-6 * big;
      ASSERT_LE(std::abs(ours - theirs), tol) << "act row " << r << " col " << i;
    }
  }
}

}  // namespace
}  // namespace draftfeed::cuda
