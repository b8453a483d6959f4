// The FP8 GEMM's operands and cuBLASLt's block-scaled GEMM against host
// definitions: the quantisers bit for bit (the host e4m3 conversion of
// common/fp8_e4m3.h, fp32 division), the GEMM against an exact (double)
// evaluation of the block-scaled sum it must compute.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/fp8_e4m3.h"
#include "kernels/elementwise.cuh"
#include "kernels/fp8_gemm_operands.cuh"
#include "server/model/cuda_fp8_gemm.h"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed {
namespace {

using testing::DeviceBuffer;
using testing::RandomBf16Values;
using testing::ToBf16;

// The activation quantiser's definition on the host.
void HostQuantizeActivations(const std::vector<float>& x, int64_t m, int64_t k,
                             std::vector<uint8_t>& q, std::vector<float>& s) {
  const int64_t m_pad = cuda::Fp8RowsPadded(m), groups = k / 128;
  q.assign(static_cast<size_t>(m_pad * k), 0);
  s.assign(static_cast<size_t>(groups * m_pad), 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float amax = 0;
      for (int64_t j = 0; j < 128; ++j) amax = std::max(amax, std::fabs(x[r * k + g * 128 + j]));
      const float sc = std::max(amax, cuda::kFp8MinAmax) / 448.0f;
      s[g * m_pad + r] = sc;
      for (int64_t j = 0; j < 128; ++j) {
        q[r * k + g * 128 + j] = FloatToE4m3(x[r * k + g * 128 + j] / sc);
      }
    }
  }
}

TEST(Fp8OperandsCudaTest, ActivationQuantisationMatchesTheHostBitForBit) {
  DF_REQUIRE_GPU();
  for (int64_t m : {1, 5, 64, 257}) {
    const int64_t k = 384;
    std::vector<float> x = RandomBf16Values(static_cast<size_t>(m * k), 3.0f, 7 + m);
    for (int64_t j = 0; j < 128; ++j) x[j + 128] = 0.0f;  // an all-zero group of row 0
    x[5] = 1e6f;                                          // a large outlier
    x = testing::ToF32(ToBf16(x));
    const int64_t m_pad = cuda::Fp8RowsPadded(m);
    DeviceBuffer<__nv_bfloat16> dx(ToBf16(x));
    DeviceBuffer<uint8_t> dq(static_cast<size_t>(m_pad * k));
    DeviceBuffer<float> ds(static_cast<size_t>(m_pad * k / 128));
    DF_CUDA_OK(cuda::QuantizeActivationsFp8(dx.get(), k, m, k, dq.get(), ds.get(), nullptr));
    DF_CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint8_t> q;
    std::vector<float> s;
    HostQuantizeActivations(x, m, k, q, s);
    EXPECT_EQ(dq.Download(), q) << "m=" << m;
    EXPECT_EQ(ds.Download(), s) << "m=" << m;
  }
}

TEST(Fp8OperandsCudaTest, FusedSwiGluQuantisationEqualsSwiGluThenQuantise) {
  DF_REQUIRE_GPU();
  const int64_t m = 37, f = 256;
  DeviceBuffer<__nv_bfloat16> gate_up(ToBf16(RandomBf16Values(m * 2 * f, 2.0f, 11)));
  DeviceBuffer<__nv_bfloat16> act(static_cast<size_t>(m * f));
  const int64_t m_pad = cuda::Fp8RowsPadded(m);
  DeviceBuffer<uint8_t> q1(m_pad * f), q2(m_pad * f);
  DeviceBuffer<float> s1(m_pad * f / 128), s2(m_pad * f / 128);
  DF_CUDA_OK(cuda::SwiGlu(gate_up.get(), m, f, act.get(), nullptr));
  DF_CUDA_OK(cuda::QuantizeActivationsFp8(act.get(), f, m, f, q1.get(), s1.get(), nullptr));
  DF_CUDA_OK(cuda::SwiGluQuantizeFp8(gate_up.get(), m, f, q2.get(), s2.get(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(q1.Download(), q2.Download());
  EXPECT_EQ(s1.Download(), s2.Download());
}

TEST(Fp8OperandsCudaTest, WeightBlockQuantisationMatchesTheHostRule) {
  DF_REQUIRE_GPU();
  const int64_t n = 200, k = 300;  // partial blocks on both edges
  std::vector<float> w = RandomBf16Values(static_cast<size_t>(n * k), 0.05f, 3);
  for (int64_t r = 128; r < 200; ++r) {
    for (int64_t c = 256; c < 300; ++c) w[r * k + c] = 0.0f;  // an all-zero (partial) block
  }
  const int64_t stride = cuda::Fp8ScaleStride(k);
  DeviceBuffer<__nv_bfloat16> dw(ToBf16(w));
  DeviceBuffer<uint8_t> dq(static_cast<size_t>(n * k));
  DeviceBuffer<float> ds(static_cast<size_t>(2 * stride));
  DF_CUDA_OK(cudaMemset(ds.get(), 0, ds.size() * 4));
  DF_CUDA_OK(cuda::QuantizeWeightBlocksFp8(dw.get(), n, k, dq.get(), ds.get(), stride, nullptr));
  DeviceBuffer<__nv_bfloat16> back(static_cast<size_t>(n * k));
  DF_CUDA_OK(
      cuda::DequantizeWeightBlocksFp8(dq.get(), ds.get(), stride, n, k, back.get(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> q = dq.Download();
  const std::vector<float> s = ds.Download();
  const std::vector<float> deq = testing::ToF32(back.Download());
  for (int64_t nb = 0; nb < 2; ++nb) {
    for (int64_t kb = 0; kb < 3; ++kb) {
      float amax = 0;
      for (int64_t r = nb * 128; r < std::min<int64_t>(n, nb * 128 + 128); ++r) {
        for (int64_t c = kb * 128; c < std::min<int64_t>(k, kb * 128 + 128); ++c) {
          amax = std::max(amax, std::fabs(w[r * k + c]));
        }
      }
      const float sc = amax > 0 ? amax / 448.0f : 1.0f;
      ASSERT_EQ(s[nb * stride + kb], sc) << nb << "," << kb;
      for (int64_t r = nb * 128; r < std::min<int64_t>(n, nb * 128 + 128); ++r) {
        for (int64_t c = kb * 128; c < std::min<int64_t>(k, kb * 128 + 128); ++c) {
          ASSERT_EQ(q[r * k + c], FloatToE4m3(w[r * k + c] / sc)) << r << "," << c;
          const float want = __bfloat162float(__float2bfloat16(E4m3ToFloat(q[r * k + c]) * sc));
          ASSERT_EQ(deq[r * k + c], want) << r << "," << c;
        }
      }
    }
  }
}

// cuBLASLt's block-scaled GEMM against Σ_g (Σ_k q_x·q_w)·s_x·s_w in double.
// The only roundings it may add are its fp32 accumulation and the one bf16
// rounding of Y: relative rms error of bf16 rounding is ~2^-9/√3 ≈ 1.1e-3,
// so 3e-3 bounds it with room for the accumulation order, and 1e-2 catches
// any scale read from the wrong place (a wrong layout gives errors ~0.3-1).
TEST(Fp8GemmCudaTest, BlockScaledGemmMatchesTheExactSum) {
  DF_REQUIRE_GPU();
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major != 9) GTEST_SKIP() << "cuBLASLt serves 128x128-block FP8 scales on sm_90 only";
  const int64_t n = 640, k = 896;
  for (int64_t m : {4, 61, 1001}) {
    const int64_t m_pad = cuda::Fp8RowsPadded(m), kb = k / 128, stride = cuda::Fp8ScaleStride(k);
    std::vector<float> x = testing::ToF32(ToBf16(RandomBf16Values(m * k, 1.0f, 5 + m)));
    std::vector<float> w = RandomBf16Values(n * k, 0.03f, 9);
    for (int64_t c = 0; c < k; ++c) w[7 * k + c] *= 40.0f;  // one row's blocks scale differently
    DeviceBuffer<__nv_bfloat16> dx(ToBf16(x)), dw(ToBf16(w));
    DeviceBuffer<uint8_t> xq(m_pad * k), wq(n * k);
    DeviceBuffer<float> xs(m_pad * kb), ws(n / 128 * stride);
    DF_CUDA_OK(cudaMemset(ws.get(), 0, ws.size() * 4));
    DF_CUDA_OK(cuda::QuantizeActivationsFp8(dx.get(), k, m, k, xq.get(), xs.get(), nullptr));
    DF_CUDA_OK(cuda::QuantizeWeightBlocksFp8(dw.get(), n, k, wq.get(), ws.get(), stride, nullptr));
    DeviceBuffer<char> workspace(32 << 20);
    CublasLtFp8Gemm gemm;
    ASSERT_TRUE(gemm.Init(workspace.get(), workspace.size()).ok());
    DeviceBuffer<__nv_bfloat16> y(m_pad * n);
    absl::Status st =
        gemm.Run(xq.get(), xs.get(), wq.get(), ws.get(), y.get(), m_pad, n, k, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    DF_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> hq = xq.Download(), hw = wq.Download();
    const std::vector<float> hs = xs.Download(), hws = ws.Download();
    const std::vector<float> got = testing::ToF32(y.Download());
    double num = 0, den = 0;
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        double acc = 0;
        for (int64_t g = 0; g < kb; ++g) {
          double part = 0;
          for (int64_t j = g * 128; j < g * 128 + 128; ++j) {
            part += static_cast<double>(E4m3ToFloat(hq[r * k + j])) * E4m3ToFloat(hw[c * k + j]);
          }
          acc += part * hs[g * m_pad + r] * hws[(c / 128) * stride + g];
        }
        const double d = got[r * n + c] - acc;
        num += d * d;
        den += acc * acc;
      }
    }
    EXPECT_LT(std::sqrt(num / den), 3e-3) << "m=" << m;
  }
}

}  // namespace
}  // namespace draftfeed
