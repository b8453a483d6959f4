// Batch invariance of the engine's GEMMs (skips without a GPU): the rows of
// 1,500 tokens computed alone against the same rows placed first, in the
// middle and last of a 5,200-row and a 49,152-row operand, bit for bit, at
// projection shapes of the real models. A GEMM whose algorithm (tile,
// split-K, stream-K) follows M would change a token's bits with its batch.
// Also: every single-pass algorithm cuBLASLt's heuristic offers for a shape
// (the bf16 wrapper times them and keeps the fastest, so a restart may pick
// another) must give the same bits.
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/hopper_gemm.cuh"
#include "kernels/random_init.cuh"
#include "server/model/cuda_fp8_gemm.h"
#include "server/model/cuda_gemm.h"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed {
namespace {

using testing::DeviceBuffer;

constexpr int64_t kRows = 1500;

struct Shape {
  const char* name;
  int64_t n, k;
};

// Projections of Qwen3.6-27B (hidden 5120, MLP 17408; the GDN gates' in_proj_ba
// is the bf16 tail an FP8 checkpoint leaves) and 35B-A3B (hidden 2048, 256
// experts: the router).
const Shape kShapes[] = {
    {"27b o_proj", 5120, 6144},
    {"27b in_proj_ba", 96, 5120},
    {"27b gate_up", 34816, 5120},
    {"27b down", 5120, 17408},
    {"35b router", 256, 2048},
    {"35b shared gate_up", 1024, 2048},
};

struct Batch {
  const char* name;
  int64_t m, offset;
};
const Batch kBatches[] = {
    {"first of 5200", 5200, 0},
    {"middle of 5200", 5200, 1804},
    {"last of 5200", 5200, 5200 - kRows},
    {"middle of 49152", 49152, 24000},
};

// Rows [offset, offset + kRows) of y (stride n) against `alone` (kRows x n):
// the number of differing rows.
int64_t DifferingRows(const DeviceBuffer<__nv_bfloat16>& y, int64_t offset, int64_t n,
                      const std::vector<__nv_bfloat16>& alone) {
  std::vector<__nv_bfloat16> got(static_cast<size_t>(kRows * n));
  cudaMemcpy(got.data(), y.get() + offset * n, got.size() * 2, cudaMemcpyDeviceToHost);
  int64_t rows = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    rows += std::memcmp(got.data() + r * n, alone.data() + r * n, static_cast<size_t>(n) * 2) != 0;
  }
  return rows;
}

// Big operand x [m, k] holding the sequence's rows (seed 1) at `offset`, the
// rest other tokens (seed 2).
void FillBatch(DeviceBuffer<__nv_bfloat16>& x, const DeviceBuffer<__nv_bfloat16>& seq, int64_t m,
               int64_t offset, int64_t k) {
  DF_CUDA_OK(cuda::FillRandomBf16(x.get(), m * k, 2, 1.0f, 0.0f, nullptr));
  DF_CUDA_OK(cudaMemcpy(x.get() + offset * k, seq.get(), kRows * k * 2, cudaMemcpyDeviceToDevice));
}

TEST(GemmBatchInvarianceCudaTest, CublasLtBf16RowsDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  DeviceBuffer<char> workspace(32 << 20);
  for (const Shape& s : kShapes) {
    SCOPED_TRACE(s.name);
    DeviceBuffer<__nv_bfloat16> w(s.n * s.k), seq(kRows * s.k), x(49152 * s.k), y(49152 * s.n);
    DF_CUDA_OK(cuda::FillRandomBf16(w.get(), s.n * s.k, 3, 0.02f, 0.0f, nullptr));
    DF_CUDA_OK(cuda::FillRandomBf16(seq.get(), kRows * s.k, 1, 1.0f, 0.0f, nullptr));
    CublasLtGemm gemm;
    ASSERT_TRUE(gemm.Init(workspace.get(), workspace.size()).ok());
    ASSERT_TRUE(gemm.Run(seq.get(), w.get(), y.get(), kRows, s.n, s.k, nullptr).ok());
    DF_CUDA_OK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> alone(static_cast<size_t>(kRows * s.n));
    DF_CUDA_OK(cudaMemcpy(alone.data(), y.get(), alone.size() * 2, cudaMemcpyDeviceToHost));
    for (const Batch& b : kBatches) {
      FillBatch(x, seq, b.m, b.offset, s.k);
      ASSERT_TRUE(gemm.Run(x.get(), w.get(), y.get(), b.m, s.n, s.k, nullptr).ok());
      DF_CUDA_OK(cudaDeviceSynchronize());
      const int64_t d = DifferingRows(y, b.offset, s.n, alone);
      std::printf("cuBLASLt bf16 %s, %s: %lld of %lld rows differ\n", s.name, b.name,
                  static_cast<long long>(d), static_cast<long long>(kRows));
      EXPECT_EQ(d, 0) << b.name;
    }
  }
}

// Every single-pass (split-K 1) heuristic candidate of one shape, against the
// first: the same bits, so the wrapper's timed choice cannot change them.
TEST(GemmBatchInvarianceCudaTest, CublasLtBf16CandidatesAgreeBitForBit) {
  DF_REQUIRE_GPU();
  cublasLtHandle_t handle;
  ASSERT_EQ(cublasLtCreate(&handle), CUBLAS_STATUS_SUCCESS);
  DeviceBuffer<char> workspace(32 << 20);
  size_t ws = workspace.size();
  cublasLtMatmulPreference_t pref;
  cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                       sizeof ws);
  for (const Shape& s : kShapes) {
    for (int64_t m : {kRows, int64_t{5200}}) {
      SCOPED_TRACE(::testing::Message() << s.name << " m=" << m);
      DeviceBuffer<__nv_bfloat16> w(s.n * s.k), x(m * s.k), y(m * s.n);
      DF_CUDA_OK(cuda::FillRandomBf16(w.get(), s.n * s.k, 3, 0.02f, 0.0f, nullptr));
      DF_CUDA_OK(cuda::FillRandomBf16(x.get(), m * s.k, 1, 1.0f, 0.0f, nullptr));
      cublasLtMatmulDesc_t desc;
      cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
      const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
      cublasLtMatrixLayout_t la, lb, lc;
      cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.k, s.n, s.k);
      cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.k, m, s.k);
      cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, s.n, m, s.n);
      cublasLtMatmulHeuristicResult_t results[8] = {};
      int found = 0;
      ASSERT_EQ(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, 8, results,
                                               &found),
                CUBLAS_STATUS_SUCCESS);
      std::vector<__nv_bfloat16> first;
      std::string table;
      int differing = 0;
      for (int i = 0; i < found; ++i) {
        const float alpha = 1, beta = 0;
        ASSERT_EQ(cublasLtMatmul(handle, desc, &alpha, w.get(), la, x.get(), lb, &beta, y.get(), lc,
                                 y.get(), lc, &results[i].algo, workspace.get(), ws, nullptr),
                  CUBLAS_STATUS_SUCCESS);
        DF_CUDA_OK(cudaDeviceSynchronize());
        std::vector<__nv_bfloat16> got = y.Download();
        int splitk = 0, tile = 0;
        size_t written = 0;
        cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                             &splitk, sizeof splitk, &written);
        cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile,
                                             sizeof tile, &written);
        // The wrapper takes single-pass algorithms only (split-K sums in
        // another order, and is offered by M): those must agree.
        bool same = true;
        if (splitk == 1 && first.empty()) {
          first = std::move(got);
        } else if (splitk == 1) {
          same = std::memcmp(first.data(), got.data(), first.size() * 2) == 0;
          differing += !same;
        }
        table += " [" + std::to_string(i) + ": tile " + std::to_string(tile) + " splitk " +
                 std::to_string(splitk) + (same ? "" : " differs") + "]";
      }
      std::printf("cuBLASLt bf16 %s m=%lld, %d candidates:%s\n", s.name,
                  static_cast<long long>(m), found, table.c_str());
      EXPECT_EQ(differing, 0) << table;
      cublasLtMatrixLayoutDestroy(la);
      cublasLtMatrixLayoutDestroy(lb);
      cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulDescDestroy(desc);
    }
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtDestroy(handle);
}

enum class Fp8Which { kCublasLt, kDraftfeed };

void ExpectFp8RowsDoNotDependOnTheBatch(Fp8Which which) {
  DeviceBuffer<char> workspace(32 << 20);
  for (const Shape& s : kShapes) {
    if (s.k % 128 != 0 || s.n % 128 != 0) continue;
    SCOPED_TRACE(s.name);
    const int64_t stride = cuda::Fp8ScaleStride(s.k), kb = s.k / 128;
    DeviceBuffer<__nv_bfloat16> w(s.n * s.k), seq(kRows * s.k), x(49152 * s.k), y(49152 * s.n);
    DeviceBuffer<uint8_t> wq(s.n * s.k), xq(49152 * s.k);
    DeviceBuffer<float> wsc((s.n / 128) * stride), xs(49152 * kb);
    DF_CUDA_OK(cuda::FillRandomBf16(w.get(), s.n * s.k, 3, 0.02f, 0.0f, nullptr));
    DF_CUDA_OK(cuda::FillRandomBf16(seq.get(), kRows * s.k, 1, 1.0f, 0.0f, nullptr));
    DF_CUDA_OK(cudaMemset(wsc.get(), 0, wsc.size() * 4));
    DF_CUDA_OK(
        cuda::QuantizeWeightBlocksFp8(w.get(), s.n, s.k, wq.get(), wsc.get(), stride, nullptr));
    CublasLtFp8Gemm gemm;
    ASSERT_TRUE(gemm.Init(workspace.get(), workspace.size()).ok());
    auto run = [&](const __nv_bfloat16* in, int64_t m) {
      const int64_t m_pad = cuda::Fp8RowsPadded(m);
      DF_CUDA_OK(cuda::QuantizeActivationsFp8(in, s.k, m, s.k, xq.get(), xs.get(), nullptr));
      if (which == Fp8Which::kCublasLt) {
        const absl::Status st =
            gemm.Run(xq.get(), xs.get(), wq.get(), wsc.get(), y.get(), m_pad, s.n, s.k, nullptr);
        ASSERT_TRUE(st.ok()) << st;
      } else {
        DF_CUDA_OK(cuda::Fp8BlockGemm(xq.get(), xs.get(), wq.get(), wsc.get(), stride, y.get(),
                                      s.n, m_pad, s.n, s.k, nullptr));
      }
      DF_CUDA_OK(cudaDeviceSynchronize());
    };
    run(seq.get(), kRows);
    std::vector<__nv_bfloat16> alone(static_cast<size_t>(kRows * s.n));
    DF_CUDA_OK(cudaMemcpy(alone.data(), y.get(), alone.size() * 2, cudaMemcpyDeviceToHost));
    for (const Batch& b : kBatches) {
      FillBatch(x, seq, b.m, b.offset, s.k);
      run(x.get(), b.m);
      const int64_t d = DifferingRows(y, b.offset, s.n, alone);
      std::printf("%s FP8 %s, %s: %lld of %lld rows differ\n",
                  which == Fp8Which::kCublasLt ? "cuBLASLt" : "draftfeed", s.name, b.name,
                  static_cast<long long>(d), static_cast<long long>(kRows));
      EXPECT_EQ(d, 0) << b.name;
    }
  }
}

TEST(GemmBatchInvarianceCudaTest, CublasLtFp8RowsDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major != 9) GTEST_SKIP() << "cuBLASLt serves 128x128-block FP8 scales on sm_90 only";
  ExpectFp8RowsDoNotDependOnTheBatch(Fp8Which::kCublasLt);
}

TEST(GemmBatchInvarianceCudaTest, DraftfeedFp8RowsDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  if (!cuda::HopperGemmsAvailable()) GTEST_SKIP() << "draftfeed's FP8 GEMM is sm_90a code";
  ExpectFp8RowsDoNotDependOnTheBatch(Fp8Which::kDraftfeed);
}

}  // namespace
}  // namespace draftfeed
