// The FP8 grouped expert GEMMs against the block-scaled sums they define,
// evaluated on the host in double from the very operands the GPU read (its
// own quantized activations and weights, downloaded): gate_up + SwiGLU, then
// down on the GPU's re-quantized activations. Differences left: fp32
// accumulation order and the one bf16 rounding of each output.
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "common/fp8_e4m3.h"
#include "gtest/gtest.h"
#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/kernel_paths.cuh"
#include "kernels/moe.cuh"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda {
namespace {

using ::draftfeed::testing::DeviceBuffer;
using ::draftfeed::testing::RandomBf16Values;
using ::draftfeed::testing::ToBf16;
using ::draftfeed::testing::ToF32;

struct Shape {
  int64_t tokens, hidden, inter;
  int experts, k;
};

// Dequantized row r of an e4m3 [rows, cols] matrix with block scales.
std::vector<double> DequantRow(const std::vector<uint8_t>& q, const std::vector<float>& s,
                               int64_t stride, int64_t r, int64_t cols) {
  std::vector<double> out(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) {
    out[c] = double(E4m3ToFloat(q[r * cols + c])) * s[(r / 128) * stride + c / 128];
  }
  return out;
}

// Each output within 2^-8 of itself (the bf16 rounding, 2^-9, twice over)
// plus 2^-10 of its row's rms (fp32 accumulation of ~K products of mixed
// signs) plus `slack`, the tensor cores' own rounding: Hopper's FP8 MMA sums
// a K block's products keeping ~14 mantissa bits (DeepSeek-V3 measured this
// on the H800; it is why the format promotes to fp32 every 128 K), so a
// block's partial may be off by ~2^-14 of the sum of its products'
// magnitudes; slack allows 2^-12 of that sum. A wrong scale, row, expert or
// column is off by O(rms). Prints the worst error as a fraction of its bound.
void ExpectClose(const std::vector<float>& got, const std::vector<double>& want,
                 const std::vector<double>& slack, int64_t rows, int64_t cols, const char* what) {
  int bad = 0;
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t c = 0; c < cols; ++c) ss += want[r * cols + c] * want[r * cols + c];
    const double rms = std::sqrt(ss / cols);
    for (int64_t c = 0; c < cols; ++c) {
      const double w = want[r * cols + c], g = got[r * cols + c];
      const double bound =
          std::ldexp(std::fabs(w), -8) + std::ldexp(rms, -10) + slack[r * cols + c];
      worst = std::max(worst, std::fabs(g - w) / bound);
      if (!(std::fabs(g - w) <= bound) && ++bad <= 5) {
        ADD_FAILURE() << what << " row " << r << " col " << c << " got " << g << " want " << w;
      }
    }
  }
  std::printf("%s: worst error %.3f of its bound\n", what, worst);
  EXPECT_EQ(bad, 0) << what;
}

void RunFp8Experts(const Shape& s) {
  SCOPED_TRACE(::testing::Message() << "T " << s.tokens << " D " << s.hidden << " I " << s.inter
                                    << " E " << s.experts << " k " << s.k);
  const int64_t T = s.tokens, D = s.hidden, I = s.inter, E = s.experts, rows = T * s.k;
  const int64_t t_pad = Fp8RowsPadded(T), rows_pad = Fp8RowsPadded(rows);
  // Routing: token t's slot j to expert (t·7 + j·3) % E (distinct for k <= E/3).
  std::vector<int32_t> ids(static_cast<size_t>(rows));
  for (int64_t t = 0; t < T; ++t) {
    for (int j = 0; j < s.k; ++j) ids[t * s.k + j] = static_cast<int32_t>((t * 7 + j * 3) % E);
  }
  const size_t ws_bytes = MoeWorkspaceBytes(T, s.experts, s.k, D, I);
  DeviceBuffer<char> ws(ws_bytes);
  const MoeBuffers b = CarveMoeWorkspace(ws.get(), T, s.experts, s.k, D, I);
  DeviceBuffer<int32_t> d_ids(ids);
  DF_CUDA_OK(MoePermute(d_ids.get(), T, s.experts, s.k, b.routing, nullptr));

  DeviceBuffer<bf16> x(ToBf16(RandomBf16Values(T * D, 1.0f, 3)));
  DeviceBuffer<bf16> wgu(ToBf16(RandomBf16Values(E * 2 * I * D, 0.05f, 4)));
  DeviceBuffer<bf16> wd(ToBf16(RandomBf16Values(E * D * I, 0.05f, 5)));
  const int64_t sd = Fp8ScaleStride(D), si = Fp8ScaleStride(I);
  DeviceBuffer<uint8_t> xq(t_pad * D), gq(E * 2 * I * D), dq(E * D * I), aq(rows_pad * I);
  DeviceBuffer<float> xs(t_pad * D / 128), gs(E * 2 * I / 128 * sd), ds(E * D / 128 * si),
      as(rows_pad * I / 128);
  DF_CUDA_OK(QuantizeActivationsFp8(x.get(), D, T, D, xq.get(), xs.get(), nullptr));
  DF_CUDA_OK(QuantizeWeightBlocksFp8(wgu.get(), E * 2 * I, D, gq.get(), gs.get(), sd, nullptr));
  DF_CUDA_OK(QuantizeWeightBlocksFp8(wd.get(), E * D, I, dq.get(), ds.get(), si, nullptr));
  DF_CUDA_OK(MoeGateUpSwiGluFp8(xq.get(), xs.get(), t_pad, gq.get(), gs.get(), D, I, s.experts,
                                rows, b.routing, b.act, nullptr));
  DF_CUDA_OK(QuantizeActivationsFp8(b.act, I, rows, I, aq.get(), as.get(), nullptr));
  {
    // gate_up quantizing its own output (the engine's path): bit for bit the
    // quantizer's, padding rows included (the buffers start as garbage).
    DeviceBuffer<uint8_t> aq_fused(rows_pad * I);
    DeviceBuffer<float> as_fused(rows_pad * I / 128);
    DF_CUDA_OK(cudaMemset(aq_fused.get(), 0xAB, aq_fused.size()));
    DF_CUDA_OK(cudaMemset(as_fused.get(), 0x7F, as_fused.size() * 4));
    DF_CUDA_OK(MoeGateUpSwiGluFp8(xq.get(), xs.get(), t_pad, gq.get(), gs.get(), D, I, s.experts,
                                  rows, b.routing, b.act, nullptr,
                                  {aq_fused.get(), as_fused.get()}));
    DF_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(aq_fused.Download(), aq.Download()) << "fused act quantization: e4m3 bytes";
    EXPECT_EQ(as_fused.Download(), as.Download()) << "fused act quantization: scales";
  }
  DF_CUDA_OK(MoeDownFp8(aq.get(), as.get(), rows_pad, dq.get(), ds.get(), D, I, s.experts, rows,
                        b.routing, b.y, nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());

  std::vector<int32_t> row_token(static_cast<size_t>(rows)), offsets(static_cast<size_t>(E + 1));
  DF_CUDA_OK(cudaMemcpy(row_token.data(), b.routing.row_token, rows * 4, cudaMemcpyDeviceToHost));
  DF_CUDA_OK(cudaMemcpy(offsets.data(), b.routing.offsets, (E + 1) * 4, cudaMemcpyDeviceToHost));
  std::vector<bf16> act_raw(static_cast<size_t>(rows * I)), y_raw(static_cast<size_t>(rows * D));
  DF_CUDA_OK(cudaMemcpy(act_raw.data(), b.act, rows * I * 2, cudaMemcpyDeviceToHost));
  DF_CUDA_OK(cudaMemcpy(y_raw.data(), b.y, rows * D * 2, cudaMemcpyDeviceToHost));
  const std::vector<float> act = ToF32(act_raw), y = ToF32(y_raw);
  const std::vector<uint8_t> hxq = xq.Download(), hgq = gq.Download(), hdq = dq.Download(),
                             haq = aq.Download();
  const std::vector<float> hxs = xs.Download(), hgs = gs.Download(), hds = ds.Download(),
                           has = as.Download();

  std::vector<double> want_act(static_cast<size_t>(rows * I)),
      want_y(static_cast<size_t>(rows * D)), slack_act(static_cast<size_t>(rows * I)),
      slack_y(static_cast<size_t>(rows * D));
  constexpr double kMmaEps = 1.0 / 4096;  // 2^-12 of Σ|products|, ExpectClose's slack
  for (int e = 0; e < s.experts; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      const int64_t t = row_token[r];
      std::vector<double> xt(static_cast<size_t>(D));
      for (int64_t c = 0; c < D; ++c) {
        xt[c] = double(E4m3ToFloat(hxq[t * D + c])) * hxs[(c / 128) * t_pad + t];
      }
      for (int64_t i = 0; i < I; ++i) {
        const std::vector<double> wg = DequantRow(hgq, hgs, sd, e * 2 * I + i, D);
        const std::vector<double> wu = DequantRow(hgq, hgs, sd, e * 2 * I + I + i, D);
        double gsum = 0, usum = 0, gabs = 0, uabs = 0;
        for (int64_t c = 0; c < D; ++c) {
          gsum += xt[c] * wg[c];
          usum += xt[c] * wu[c];
          gabs += std::fabs(xt[c] * wg[c]);
          uabs += std::fabs(xt[c] * wu[c]);
        }
        const double silu = gsum / (1.0 + std::exp(-gsum));
        want_act[r * I + i] = silu * usum;
        // Through SwiGLU: |d silu/dg| <= 1.1.
        slack_act[r * I + i] = kMmaEps * (1.1 * std::fabs(usum) * gabs + std::fabs(silu) * uabs);
      }
      std::vector<double> at(static_cast<size_t>(I));
      for (int64_t c = 0; c < I; ++c) {
        at[c] = double(E4m3ToFloat(haq[r * I + c])) * has[(c / 128) * rows_pad + r];
      }
      for (int64_t o = 0; o < D; ++o) {
        const std::vector<double> w = DequantRow(hdq, hds, si, e * D + o, I);
        double sum = 0, abs_sum = 0;
        for (int64_t c = 0; c < I; ++c) {
          sum += at[c] * w[c];
          abs_sum += std::fabs(at[c] * w[c]);
        }
        want_y[r * D + o] = sum;
        slack_y[r * D + o] = kMmaEps * abs_sum;
      }
    }
  }
  ExpectClose(act, want_act, slack_act, rows, I, "gate_up + SwiGLU");
  ExpectClose(y, want_y, slack_y, rows, D, "down");
}

TEST(MoeFp8ExpertsCudaTest, MatchBlockScaledSums) {
  DF_REQUIRE_GPU();
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major < 9) GTEST_SKIP() << "e4m3 mma.sync needs sm_89+ (built for sm_90)";
  // Partial row tiles, two K blocks and more, several column tiles (D = 384:
  // a half-empty last one), idle experts, and experts of several row tiles.
  // On Hopper these run hopper_gemm.cu's wgmma kernel; the mma.sync one
  // every other GPU runs is MmaSyncKernelsMatchBlockScaledSums.
  for (const Shape& s : {Shape{37, 256, 128, 8, 2}, Shape{301, 384, 256, 16, 4},
                         Shape{5, 128, 128, 32, 8}, Shape{700, 512, 256, 4, 2}}) {
    RunFp8Experts(s);
  }
}

TEST(MoeFp8ExpertsCudaTest, MmaSyncKernelsMatchBlockScaledSums) {
  DF_REQUIRE_GPU();
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major < 9) GTEST_SKIP() << "e4m3 mma.sync needs sm_89+ (built for sm_90)";
  ScopedPortableKernels portable(PortableKernels::kSm100);
  for (const Shape& s : {Shape{37, 256, 128, 8, 2}, Shape{301, 384, 256, 16, 4}}) {
    RunFp8Experts(s);
  }
}

TEST(MoeFp8ExpertsCudaTest, RejectsShapesOffTheBlockGrid) {
  DF_REQUIRE_GPU();
  const size_t ws_bytes = MoeWorkspaceBytes(16, 8, 2, 192, 128);
  DeviceBuffer<char> ws(ws_bytes);
  const MoeBuffers b = CarveMoeWorkspace(ws.get(), 16, 8, 2, 192, 128);
  DeviceBuffer<uint8_t> q(1 << 20);
  DeviceBuffer<float> sc(1 << 16);
  EXPECT_EQ(MoeGateUpSwiGluFp8(q.get(), sc.get(), 16, q.get(), sc.get(), 192, 128, 8, 32, b.routing,
                               b.act, nullptr),
            cudaErrorInvalidValue);  // D = 192 is not a multiple of 128
  EXPECT_EQ(
      MoeDownFp8(q.get(), sc.get(), 32, q.get(), sc.get(), 128, 96, 8, 32, b.routing, b.y, nullptr),
      cudaErrorInvalidValue);  // I = 96
}

}  // namespace
}  // namespace draftfeed::cuda
