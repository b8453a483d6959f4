// The FP8 GEMM's operands and the block-scaled GEMMs (cuBLASLt's, our Hopper
// one, our portable one) against host definitions: the quantizers bit for bit
// (the host e4m3 conversion of common/fp8_e4m3.h, fp32 division), the GEMMs
// against an exact (double) evaluation of the block-scaled sum they must
// compute, against each other, and the portable one's batch invariance.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/fp8_e4m3.h"
#include "kernels/elementwise.cuh"
#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/fp8_gemm_portable.cuh"
#include "kernels/hopper_gemm.cuh"
#include "server/model/cuda_fp8_gemm.h"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed {
namespace {

using testing::DeviceBuffer;
using testing::RandomBf16Values;
using testing::ToBf16;

// The activation quantizer's definition on the host.
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

TEST(Fp8OperandsCudaTest, ActivationQuantizationMatchesTheHostBitForBit) {
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

TEST(Fp8OperandsCudaTest, FusedSwiGluQuantizationEqualsSwiGluThenQuantize) {
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

TEST(Fp8OperandsCudaTest, WeightBlockQuantizationMatchesTheHostRule) {
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

// Both block-scaled GEMMs (cuBLASLt's and draftfeed's own, hopper_gemm.cuh)
// against Σ_g (Σ_k q_x·q_w)·s_x·s_w in double. The only roundings either may
// add are its fp32 accumulation and the one bf16 rounding of Y: relative rms
// error of bf16 rounding is ~2^-9/√3 ≈ 1.1e-3, so 3e-3 bounds it with room for
// the accumulation order, and any scale read from the wrong place (a wrong
// layout gives errors ~0.3-1) fails it. Shapes: M not a multiple of a
// 128-row tile, several K blocks; for ours also N not a multiple of their
// 256- or 128-column tile (a last weight block of 64 or 16 rows) and Y
// written into a wider buffer (ldy > n) whose other columns must stay
// untouched.
enum class Which { kCublasLt, kDraftfeed, kPortable };

// Y = X·Wᵀ by the GEMM `which` (cuBLASLt's through `lt`, initialised here).
void RunGemm(Which which, CublasLtFp8Gemm& lt, void* workspace, size_t workspace_bytes,
             const uint8_t* xq, const float* xs, const uint8_t* wq, const float* ws,
             __nv_bfloat16* y, int64_t ldy, int64_t m_pad, int64_t n, int64_t k) {
  const int64_t stride = cuda::Fp8ScaleStride(k);
  switch (which) {
    case Which::kCublasLt: {
      ASSERT_TRUE(lt.Init(workspace, workspace_bytes).ok());
      const absl::Status st = lt.Run(xq, xs, wq, ws, y, m_pad, n, k, nullptr, ldy);
      ASSERT_TRUE(st.ok()) << st;
      break;
    }
    case Which::kDraftfeed:
      DF_CUDA_OK(cuda::Fp8BlockGemm(xq, xs, wq, ws, stride, y, ldy, m_pad, n, k, nullptr));
      break;
    case Which::kPortable:
      DF_CUDA_OK(cuda::Fp8BlockGemmPortable(xq, xs, wq, ws, stride, y, ldy, m_pad, n, k, nullptr));
      break;
  }
}

void ExpectBlockScaledGemmMatchesTheExactSum(Which which, int64_t n, int64_t ldy, int64_t k) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " k=" << k);
  for (int64_t m : {4, 61, 1001}) {
    const int64_t m_pad = cuda::Fp8RowsPadded(m), kb = k / 128, stride = cuda::Fp8ScaleStride(k);
    const int64_t w_blocks = (n + 127) / 128;
    std::vector<float> x = testing::ToF32(ToBf16(RandomBf16Values(m * k, 1.0f, 5 + m)));
    std::vector<float> w = RandomBf16Values(n * k, 0.03f, 9);
    for (int64_t c = 0; c < k; ++c) w[7 * k + c] *= 40.0f;  // one row's blocks scale differently
    for (int64_t c = 0; c < k; ++c) w[(n - 40) * k + c] *= 9.0f;     // and one in the last block
    if (2 * k + 384 <= m * k) {
      for (int64_t j = 0; j < 128; ++j) x[2 * k + 256 + j] *= 100.0f;  // one activation group too
    }
    DeviceBuffer<__nv_bfloat16> dx(ToBf16(x)), dw(ToBf16(w));
    DeviceBuffer<uint8_t> xq(m_pad * k), wq(n * k);
    DeviceBuffer<float> xs(m_pad * kb), ws(w_blocks * stride);
    DF_CUDA_OK(cudaMemset(ws.get(), 0, ws.size() * 4));
    DF_CUDA_OK(cuda::QuantizeActivationsFp8(dx.get(), k, m, k, xq.get(), xs.get(), nullptr));
    DF_CUDA_OK(cuda::QuantizeWeightBlocksFp8(dw.get(), n, k, wq.get(), ws.get(), stride, nullptr));
    DeviceBuffer<__nv_bfloat16> y(m_pad * ldy);
    const std::vector<__nv_bfloat16> sentinel(m_pad * ldy, __float2bfloat16(-7.0f));
    DF_CUDA_OK(cudaMemcpy(y.get(), sentinel.data(), sentinel.size() * 2, cudaMemcpyHostToDevice));
    DeviceBuffer<char> workspace(32 << 20);
    CublasLtFp8Gemm gemm;
    RunGemm(which, gemm, workspace.get(), workspace.size(), xq.get(), xs.get(), wq.get(), ws.get(),
            y.get(), ldy, m_pad, n, k);
    if (::testing::Test::HasFatalFailure()) return;
    DF_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> hq = xq.Download(), hw = wq.Download();
    const std::vector<float> hs = xs.Download(), hws = ws.Download();
    const std::vector<float> got = testing::ToF32(y.Download());
    double num = 0, den = 0, worst_block = 0;
    int64_t untouched = 0;
    for (int64_t r = 0; r < m_pad; ++r) {
      for (int64_t c = n; c < ldy; ++c) untouched += got[r * ldy + c] == -7.0f;
    }
    // Per 128 x 128 output block as well as overall: a mistake confined to an
    // edge tile (the partial last weight block, the rows past a 128-row tile)
    // would hide in the overall rms.
    for (int64_t rb = 0; rb * 128 < m; ++rb) {
      for (int64_t cb = 0; cb < w_blocks; ++cb) {
        double bnum = 0, bden = 0;
        for (int64_t r = rb * 128; r < std::min(m, rb * 128 + 128); ++r) {
          for (int64_t c = cb * 128; c < std::min(n, cb * 128 + 128); ++c) {
            double acc = 0;
            for (int64_t g = 0; g < kb; ++g) {
              double part = 0;
              for (int64_t j = g * 128; j < g * 128 + 128; ++j) {
                part +=
                    static_cast<double>(E4m3ToFloat(hq[r * k + j])) * E4m3ToFloat(hw[c * k + j]);
              }
              acc += part * hs[g * m_pad + r] * hws[(c / 128) * stride + g];
            }
            const double d = got[r * ldy + c] - acc;
            bnum += d * d;
            bden += acc * acc;
          }
        }
        num += bnum;
        den += bden;
        worst_block = std::max(worst_block, std::sqrt(bnum / bden));
      }
    }
    EXPECT_LT(std::sqrt(num / den), 3e-3) << "m=" << m;
    EXPECT_LT(worst_block, 4e-3) << "m=" << m;
    // Rows m..m_pad-1 have zero activations: Y is 0 there.
    for (int64_t r = m; r < m_pad; ++r) {
      for (int64_t c = 0; c < n; ++c) ASSERT_EQ(got[r * ldy + c], 0.0f) << r << "," << c;
    }
    EXPECT_EQ(untouched, m_pad * (ldy - n)) << "columns past n were written, m=" << m;
  }
}

TEST(Fp8GemmCudaTest, CublasLtBlockScaledGemmMatchesTheExactSum) {
  DF_REQUIRE_GPU();
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major != 9) GTEST_SKIP() << "cuBLASLt serves 128x128-block FP8 scales on sm_90 only";
  ExpectBlockScaledGemmMatchesTheExactSum(Which::kCublasLt, 640, 640, 896);
}

TEST(Fp8GemmCudaTest, DraftfeedBlockScaledGemmMatchesTheExactSum) {
  DF_REQUIRE_GPU();
  if (!cuda::HopperGemmsAvailable()) GTEST_SKIP() << "draftfeed's FP8 GEMM is sm_90a code";
  ExpectBlockScaledGemmMatchesTheExactSum(Which::kDraftfeed, 576, 600, 896);
  // Rows 16-byte aligned take the epilogue's 16-byte stores; ldy = 578
  // (rows 4-byte aligned) its 4-byte ones, here with a last tile of 144
  // columns (a partial 64-column block in the tile's second half).
  ExpectBlockScaledGemmMatchesTheExactSum(Which::kDraftfeed, 400, 578, 256);
  // One K block, the shortest K (its loop runs once, its scales one block).
  ExpectBlockScaledGemmMatchesTheExactSum(Which::kDraftfeed, 256, 256, 128);
}

TEST(Fp8GemmCudaTest, PortableBlockScaledGemmMatchesTheExactSum) {
  DF_REQUIRE_GPU();
  if (!cuda::PortableFp8GemmAvailable()) GTEST_SKIP() << "e4m3 mma.sync needs sm_89 or newer";
  // 7 K blocks (more than its 3 stages), a last weight block of 64 rows; and
  // 2 K blocks (fewer than the stages), a last weight block of 16 rows.
  ExpectBlockScaledGemmMatchesTheExactSum(Which::kPortable, 576, 600, 896);
  ExpectBlockScaledGemmMatchesTheExactSum(Which::kPortable, 400, 400, 256);
}

// Quantized random operands for Y[m, n] = X·Wᵀ (K = k), as the engine makes them.
struct Fp8Operands {
  Fp8Operands(int64_t m, int64_t n, int64_t k, uint64_t seed)
      : m_pad(cuda::Fp8RowsPadded(m)),
        xq(m_pad * k),
        wq(n * k),
        xs(m_pad * (k / 128)),
        ws((n + 127) / 128 * cuda::Fp8ScaleStride(k)) {
    DeviceBuffer<__nv_bfloat16> dx(ToBf16(RandomBf16Values(m * k, 1.0f, seed)));
    DeviceBuffer<__nv_bfloat16> dw(ToBf16(RandomBf16Values(n * k, 0.03f, seed + 1)));
    cudaMemset(ws.get(), 0, ws.size() * 4);
    status = cuda::QuantizeActivationsFp8(dx.get(), k, m, k, xq.get(), xs.get(), nullptr);
    if (status == cudaSuccess) {
      status = cuda::QuantizeWeightBlocksFp8(dw.get(), n, k, wq.get(), ws.get(),
                                             cuda::Fp8ScaleStride(k), nullptr);
    }
  }
  int64_t m_pad;
  DeviceBuffer<uint8_t> xq, wq;
  DeviceBuffer<float> xs, ws;
  cudaError_t status = cudaSuccess;
};

// Our GEMM `which` and cuBLASLt's on the same operands at a size where ours
// walks many tiles (several waves; for the Hopper one, row groups of the
// persistent raster; more K blocks than stages): within bf16 rounding of
// each other.
void ExpectAgreesWithCublasLtOverManyTiles(Which which) {
  const int64_t m = 4100, n = 2304, k = 1536;
  Fp8Operands o(m, n, k, 21);
  DF_CUDA_OK(o.status);
  DeviceBuffer<__nv_bfloat16> y_lt(o.m_pad * n), y_own(o.m_pad * n);
  DeviceBuffer<char> workspace(32 << 20);
  CublasLtFp8Gemm gemm;
  RunGemm(Which::kCublasLt, gemm, workspace.get(), workspace.size(), o.xq.get(), o.xs.get(),
          o.wq.get(), o.ws.get(), y_lt.get(), n, o.m_pad, n, k);
  RunGemm(which, gemm, workspace.get(), workspace.size(), o.xq.get(), o.xs.get(), o.wq.get(),
          o.ws.get(), y_own.get(), n, o.m_pad, n, k);
  if (::testing::Test::HasFatalFailure()) return;
  DF_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> a = testing::ToF32(y_lt.Download()),
                           b = testing::ToF32(y_own.Download());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * double(a[i] - b[i]);
    den += a[i] * double(a[i]);
  }
  // Two bf16 roundings of the same sum (each ≤ 2^-9 relative, rms ~1.1e-3) plus
  // fp32 order: 4e-3. A skipped or repeated K block would differ by ~1/12.
  EXPECT_LT(std::sqrt(num / den), 4e-3);
}

bool CublasLtServesBlockScales() {
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  return major == 9;
}

TEST(Fp8GemmCudaTest, DraftfeedGemmAgreesWithCublasLtOverManyTiles) {
  DF_REQUIRE_GPU();
  if (!cuda::HopperGemmsAvailable()) GTEST_SKIP() << "draftfeed's FP8 GEMM is sm_90a code";
  ExpectAgreesWithCublasLtOverManyTiles(Which::kDraftfeed);
}

TEST(Fp8GemmCudaTest, PortableGemmAgreesWithCublasLtOverManyTiles) {
  DF_REQUIRE_GPU();
  if (!CublasLtServesBlockScales()) GTEST_SKIP() << "cuBLASLt serves these scales on sm_90 only";
  if (!cuda::PortableFp8GemmAvailable()) GTEST_SKIP() << "e4m3 mma.sync needs sm_89 or newer";
  ExpectAgreesWithCublasLtOverManyTiles(Which::kPortable);
}

// A token's output row does not depend on the batch around it: the rows of
// a 1,500-row X, alone, give the same bits as inside a 5,200-row X, where
// they start at row 1,703 (not on a 128-row tile nor a 4-row pad, so every
// row sits at another place in its tile and its warp's fragments), and the
// tile grid, the row groups of the raster and the padding all differ.
TEST(Fp8GemmCudaTest, PortableGemmRowsAreBitIdenticalWhateverTheBatch) {
  DF_REQUIRE_GPU();
  if (!cuda::PortableFp8GemmAvailable()) GTEST_SKIP() << "e4m3 mma.sync needs sm_89 or newer";
  const int64_t big = 5200, small = 1500, at = 1703, n = 1152, k = 1024;
  const std::vector<float> x = RandomBf16Values(big * k, 1.0f, 31);
  const std::vector<float> x_small(x.begin() + at * k, x.begin() + (at + small) * k);
  const std::vector<float> w = RandomBf16Values(n * k, 0.03f, 32);
  const int64_t stride = cuda::Fp8ScaleStride(k);
  DeviceBuffer<__nv_bfloat16> dw(ToBf16(w));
  DeviceBuffer<uint8_t> wq(n * k);
  DeviceBuffer<float> ws(n / 128 * stride);
  DF_CUDA_OK(cudaMemset(ws.get(), 0, ws.size() * 4));
  DF_CUDA_OK(cuda::QuantizeWeightBlocksFp8(dw.get(), n, k, wq.get(), ws.get(), stride, nullptr));
  auto run = [&](const std::vector<float>& xs_host, int64_t m) {
    const int64_t m_pad = cuda::Fp8RowsPadded(m);
    DeviceBuffer<__nv_bfloat16> dx(ToBf16(xs_host));
    DeviceBuffer<uint8_t> xq(m_pad * k);
    DeviceBuffer<float> xs(m_pad * (k / 128));
    DeviceBuffer<__nv_bfloat16> y(m_pad * n);
    EXPECT_EQ(cuda::QuantizeActivationsFp8(dx.get(), k, m, k, xq.get(), xs.get(), nullptr),
              cudaSuccess);
    EXPECT_EQ(cuda::Fp8BlockGemmPortable(xq.get(), xs.get(), wq.get(), ws.get(), stride, y.get(), n,
                                         m_pad, n, k, nullptr),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint16_t> bits(static_cast<size_t>(m * n));
    const std::vector<__nv_bfloat16> got = y.Download();
    std::memcpy(bits.data(), got.data(), bits.size() * 2);
    return bits;
  };
  const std::vector<uint16_t> alone = run(x_small, small), inside = run(x, big);
  ASSERT_EQ(alone.size(), static_cast<size_t>(small * n));
  int64_t differ = 0, nonzero = 0;
  for (int64_t r = 0; r < small; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      const uint16_t a = alone[r * n + c];
      differ += a != inside[(at + r) * n + c];
      nonzero += (a & 0x7fff) != 0;
    }
  }
  EXPECT_EQ(differ, 0) << "of " << small * n << " outputs";
  EXPECT_GT(nonzero, small * n / 2) << "the GEMM wrote (almost) nothing";
}

// The dense MLP's fused gate_up (GEMM, SwiGLU, down's quantization in one
// kernel) against our dense GEMM into [m_pad, 2f] bf16 and then
// SwiGluQuantizeFp8: bit for bit, bytes, scales and padding rows (the fused
// operand starts as garbage). Partial row tiles, one and several column tiles.
TEST(Fp8GemmCudaTest, FusedGateUpEqualsOurGemmThenSwiGluQuantize) {
  DF_REQUIRE_GPU();
  if (!cuda::HopperGemmsAvailable()) GTEST_SKIP() << "draftfeed's FP8 GEMM is sm_90a code";
  struct Shape {
    int64_t m, f, k;
  };
  for (const Shape& sh :
       {Shape{1, 128, 128}, Shape{37, 256, 384}, Shape{301, 384, 256}, Shape{260, 512, 1024}}) {
    SCOPED_TRACE(::testing::Message() << "m " << sh.m << " f " << sh.f << " k " << sh.k);
    const int64_t m_pad = cuda::Fp8RowsPadded(sh.m), n = 2 * sh.f, kb = sh.k / 128;
    const int64_t stride = cuda::Fp8ScaleStride(sh.k);
    DeviceBuffer<__nv_bfloat16> dx(ToBf16(RandomBf16Values(sh.m * sh.k, 1.0f, 21 + sh.m)));
    DeviceBuffer<__nv_bfloat16> dw(ToBf16(RandomBf16Values(n * sh.k, 0.05f, 22)));
    DeviceBuffer<uint8_t> xq(m_pad * sh.k), wq(n * sh.k);
    DeviceBuffer<float> xs(m_pad * kb), ws(n / 128 * stride);
    DF_CUDA_OK(cudaMemset(ws.get(), 0, ws.size() * 4));
    DF_CUDA_OK(
        cuda::QuantizeActivationsFp8(dx.get(), sh.k, sh.m, sh.k, xq.get(), xs.get(), nullptr));
    DF_CUDA_OK(
        cuda::QuantizeWeightBlocksFp8(dw.get(), n, sh.k, wq.get(), ws.get(), stride, nullptr));
    DeviceBuffer<__nv_bfloat16> gate_up(m_pad * n);
    DeviceBuffer<uint8_t> q_want(m_pad * sh.f), q_got(m_pad * sh.f);
    DeviceBuffer<float> s_want(m_pad * sh.f / 128), s_got(m_pad * sh.f / 128);
    DF_CUDA_OK(cuda::Fp8BlockGemm(xq.get(), xs.get(), wq.get(), ws.get(), stride, gate_up.get(), n,
                                  m_pad, n, sh.k, nullptr));
    DF_CUDA_OK(
        cuda::SwiGluQuantizeFp8(gate_up.get(), sh.m, sh.f, q_want.get(), s_want.get(), nullptr));
    DF_CUDA_OK(cudaMemset(q_got.get(), 0xAB, q_got.size()));
    DF_CUDA_OK(cudaMemset(s_got.get(), 0x7F, s_got.size() * 4));
    DF_CUDA_OK(cuda::Fp8GemmSwiGluQuantize(xq.get(), xs.get(), wq.get(), ws.get(), stride, sh.m,
                                           sh.f, sh.k, {q_got.get(), s_got.get()}, nullptr));
    DF_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> qw = q_want.Download(), qg = q_got.Download();
    int64_t nonzero = 0;
    for (uint8_t b : qw) nonzero += (b & 0x7F) != 0;
    EXPECT_GT(nonzero, sh.m * sh.f / 2) << "the reference wrote (almost) nothing";
    EXPECT_EQ(qg, qw) << "e4m3 bytes";
    EXPECT_EQ(s_got.Download(), s_want.Download()) << "scales";
  }
  DeviceBuffer<uint8_t> q(256 * 256);
  DeviceBuffer<float> sc(64);
  // f not a multiple of 128, no operand to write.
  EXPECT_EQ(cuda::Fp8GemmSwiGluQuantize(q.get(), sc.get(), q.get(), sc.get(), 4, 4, 100, 128,
                                        {q.get(), sc.get()}, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::Fp8GemmSwiGluQuantize(q.get(), sc.get(), q.get(), sc.get(), 4, 4, 128, 128, {},
                                        nullptr),
            cudaErrorInvalidValue);
}

// Both of our GEMMs refuse, before any device work, what their contract excludes.
TEST(Fp8GemmCudaTest, OurGemmsRefuseShapesTheyCannotTake) {
  DF_REQUIRE_GPU();
  DeviceBuffer<uint8_t> q(256 * 256);
  DeviceBuffer<float> s(64);
  DeviceBuffer<__nv_bfloat16> y(256 * 256);
  for (const auto gemm : {&cuda::Fp8BlockGemm, &cuda::Fp8BlockGemmPortable}) {
    // K not a multiple of 128, N not of 16, M not of 4, ldy < n, a weight
    // scale stride short of K's blocks, xq not 16-byte aligned.
    EXPECT_EQ(gemm(q.get(), s.get(), q.get(), s.get(), 4, y.get(), 128, 4, 128, 100, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(gemm(q.get(), s.get(), q.get(), s.get(), 4, y.get(), 128, 4, 120, 128, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(gemm(q.get(), s.get(), q.get(), s.get(), 4, y.get(), 128, 6, 128, 128, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(gemm(q.get(), s.get(), q.get(), s.get(), 4, y.get(), 64, 4, 128, 128, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(gemm(q.get(), s.get(), q.get(), s.get(), 1, y.get(), 128, 4, 128, 256, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(gemm(q.get() + 8, s.get(), q.get(), s.get(), 4, y.get(), 128, 4, 128, 128, nullptr),
              cudaErrorInvalidValue);
  }
}

}  // namespace
}  // namespace draftfeed
