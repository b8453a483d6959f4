// CUDA Gated DeltaNet kernels against the fp32 CPU references of
// kernels/cpu/gdn.h, on packed sequences that straddle chunk boundaries
// (inputs, reference and tolerances: gdn_test_data.h).
#include "kernels/gdn.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/cpu/gdn.h"
#include "tests/kernels/cuda/gdn_test_data.h"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda::gdn_test {
namespace {

// Every length class around the 64-token chunk: 1, one short, exact, one
// over, several chunks with a short tail, and a short sequence after them.
const std::vector<int32_t> kMixedLens = {1, 63, 64, 65, 200, 7};

// ---------------------------------------------------------------------------
// Causal conv + SiLU.

struct ConvCase {
  int64_t channels, x_stride, kernel;
};

class CausalConvCudaTest : public ::testing::TestWithParam<ConvCase> {};

TEST_P(CausalConvCudaTest, MatchesCpuReference) {
  DF_REQUIRE_GPU();
  const ConvCase cc = GetParam();
  const std::vector<int32_t> cu = Offsets(kMixedLens);
  const int64_t T = cu.back(), C = cc.channels;
  const std::vector<float> x = RandomBf16Values(T * cc.x_stride, 1.0f, 11 + C);
  const std::vector<float> w = RandomBf16Values(C * cc.kernel, 0.5f, 12 + cc.kernel);

  std::vector<float> x_dense(T * C), ref(T * C);
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(&x[t * cc.x_stride], C, &x_dense[t * C]);
  }
  cpu::CausalConv1dSilu(x_dense.data(), w.data(), cu.data(), kMixedLens.size(), C, cc.kernel,
                        ref.data());

  DeviceBuffer<bf16> d_x(ToBf16(x)), d_w(ToBf16(w)), d_y(T * C);
  DeviceBuffer<int32_t> d_cu(cu);
  DF_CUDA_OK(cudaMemset(d_y.get(), 0xff, T * C * sizeof(bf16)));  // NaN poison
  DF_CUDA_OK(CausalConv1dSilu(d_x.get(), cc.x_stride, d_w.get(), T, C, cc.kernel, d_cu.get(),
                              static_cast<int32_t>(kMixedLens.size()), d_y.get(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> y = ToF32(d_y.Download());

  // One bf16 rounding of the result (≤ 2^-8 relative) over fp32 sums of ≤ 8
  // products whose order may differ (~1e-6 relative).
  double max_err = 0;
  for (int64_t i = 0; i < T * C; ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << "unwritten or non-finite at " << i;
    const double err = std::fabs(y[i] - ref[i]);
    max_err = std::max(max_err, err / (std::fabs(ref[i]) + 1e-3));
    ASSERT_LE(err, std::ldexp(1.0, -8) * std::fabs(ref[i]) + 1e-5)
        << "t=" << i / C << " c=" << i % C << " gpu=" << y[i] << " ref=" << ref[i];
  }
  std::printf("conv C=%lld stride=%lld K=%lld: max |Δ|/(|ref|+1e-3) = %.3g\n",
              static_cast<long long>(C), static_cast<long long>(cc.x_stride),
              static_cast<long long>(cc.kernel), max_err);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CausalConvCudaTest,
    ::testing::Values(ConvCase{13, 20, 4},      // odd channels: scalar path, strided rows
                      ConvCase{40, 56, 4},      // 16-byte path, strided rows
                      ConvCase{1032, 1032, 4},  // several channel blocks
                      ConvCase{24, 24, 3}, ConvCase{16, 24, 8}, ConvCase{9, 9, 1}));

// ---------------------------------------------------------------------------
// Gated delta rule.

void CheckGdn(const GdnShape& shape, const std::vector<int32_t>& lens, uint64_t seed) {
  const GdnInputs in = MakeInputs(shape, lens, seed);
  GdnDevice dev(in);
  const size_t n_out = in.T * shape.nv * shape.dv;
  ASSERT_EQ(cudaMemset(dev.out.get(), 0xff, n_out * sizeof(bf16)), cudaSuccess);  // NaN poison
  DF_CUDA_OK(dev.Run());
  DF_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<bf16> first = dev.out.Download();
  const std::vector<float> got = ToF32(first);
  const std::vector<float> ref = Reference(in);
  const ErrorStats e = Compare(got, ref);
  std::printf(
      "gdn Nk=%lld Nv=%lld dk=%lld dv=%lld T=%lld seqs=%zu: max|Δ|=%.3g max|ref|=%.3g "
      "(ratio %.3g) relL2=%.3g\n",
      static_cast<long long>(shape.nk), static_cast<long long>(shape.nv),
      static_cast<long long>(shape.dk), static_cast<long long>(shape.dv),
      static_cast<long long>(in.T), lens.size(), e.max_err, e.max_ref, e.max_err / e.max_ref,
      e.rel_l2);
  EXPECT_EQ(e.non_finite, 0) << "unwritten or non-finite outputs";
  if (e.worst >= 0) {
    const int64_t per_tok = shape.nv * shape.dv;
    const int64_t t = e.worst / per_tok;
    const int64_t seq = std::upper_bound(in.cu.begin(), in.cu.end(), t) - in.cu.begin() - 1;
    EXPECT_LE(e.max_err, kMaxErrVsMaxRef * e.max_ref)
        << "worst at token " << t << " (seq " << seq << ", row " << t - in.cu[seq] << ") head "
        << (e.worst % per_tok) / shape.dv << " dim " << e.worst % shape.dv << ": gpu "
        << got[e.worst] << " ref " << ref[e.worst];
  }
  EXPECT_LE(e.rel_l2, kRelL2);
  if (e.non_finite > 0 || e.max_err > kMaxErrVsMaxRef * e.max_ref) {
    // Where the error lives: by 16-row block inside a chunk, by chunk index
    // inside a sequence (0, 1, 2+), and by value head.
    std::vector<double> by_rows(4), by_chunk(3), by_head(shape.nv);
    for (size_t seq = 0; seq + 1 < in.cu.size(); ++seq) {
      for (int64_t t = in.cu[seq]; t < in.cu[seq + 1]; ++t) {
        const int64_t pos = t - in.cu[seq];
        for (int64_t h = 0; h < shape.nv; ++h) {
          for (int64_t d = 0; d < shape.dv; ++d) {
            const size_t i = (t * shape.nv + h) * shape.dv + d;
            const double err = std::isfinite(got[i]) ? std::fabs(got[i] - ref[i]) : INFINITY;
            by_rows[(pos % 64) / 16] = std::max(by_rows[(pos % 64) / 16], err);
            by_chunk[std::min<int64_t>(pos / 64, 2)] =
                std::max(by_chunk[std::min<int64_t>(pos / 64, 2)], err);
            by_head[h] = std::max(by_head[h], err);
          }
        }
      }
    }
    std::printf("  max err by chunk rows [0,16) [16,32) [32,48) [48,64): %.3g %.3g %.3g %.3g\n",
                by_rows[0], by_rows[1], by_rows[2], by_rows[3]);
    std::printf("  max err by chunk index 0, 1, 2+: %.3g %.3g %.3g\n", by_chunk[0], by_chunk[1],
                by_chunk[2]);
    std::printf("  max err by head:");
    for (double v : by_head) std::printf(" %.2g", v);
    std::printf("\n");
  }

  // Same inputs, same bits: a race would show up here.
  DF_CUDA_OK(dev.Run());
  DF_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<bf16> second = dev.out.Download();
  int64_t diff = 0;
  for (size_t i = 0; i < n_out; ++i) {
    diff += std::memcmp(&first[i], &second[i], sizeof(bf16)) != 0;
  }
  EXPECT_EQ(diff, 0) << "outputs differ between two identical runs";
}

TEST(GatedDeltaRuleCudaTest, TinyDk16Dv16) {
  DF_REQUIRE_GPU();
  CheckGdn({2, 4, 16, 16, 0, 0}, kMixedLens, 100);
}

TEST(GatedDeltaRuleCudaTest, TinyDk32Dv32GroupOf3PaddedRows) {
  DF_REQUIRE_GPU();
  CheckGdn({2, 6, 32, 32, 8, 3}, kMixedLens, 200);
}

TEST(GatedDeltaRuleCudaTest, Dk64Dv32) {
  DF_REQUIRE_GPU();
  CheckGdn({2, 4, 64, 32, 0, 0}, kMixedLens, 300);
}

TEST(GatedDeltaRuleCudaTest, Dk32Dv128SplitsStateColumns) {
  DF_REQUIRE_GPU();
  CheckGdn({1, 2, 32, 128, 16, 1}, kMixedLens, 400);
}

TEST(GatedDeltaRuleCudaTest, Dk128Dv64) {
  DF_REQUIRE_GPU();
  CheckGdn({2, 4, 128, 64, 0, 0}, kMixedLens, 500);
}

TEST(GatedDeltaRuleCudaTest, Qwen36_27BShape) {
  DF_REQUIRE_GPU();
  CheckGdn({16, 48, 128, 128, 0, 0}, {700, 1, 511, 64, 237}, 600);
}

TEST(GatedDeltaRuleCudaTest, RejectsUnsupportedHeadDim) {
  DF_REQUIRE_GPU();
  GdnInputs in = MakeInputs({2, 4, 16, 16, 0, 0}, {5}, 1);
  GdnDevice dev(in);
  dev.args.key_dim = 48;
  EXPECT_EQ(dev.Run(), cudaErrorInvalidValue);
  dev.args.key_dim = 16;
  dev.args.num_v_heads = 5;  // not a multiple of Nk
  EXPECT_EQ(dev.Run(), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace draftfeed::cuda::gdn_test
