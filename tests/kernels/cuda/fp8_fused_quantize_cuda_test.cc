// The producers that write an FP8 GEMM's operand as they store their bf16
// output (the residual norms, the attention's output gate; the MoE gate_up
// epilogue's is in moe_fp8_cuda_test) against the unfused pair
// "producer, then QuantizeActivationsFp8", bit for bit: the bf16 output, the
// e4m3 bytes, the scales and the zeroed padding rows. And the quantizer's
// division through the group's reciprocal against the IEEE quotient, for
// every pair of bf16 values it can meet.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/elementwise.cuh"
#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/random_init.cuh"
#include "kernels/rmsnorm.cuh"
#include "tests/kernels/cuda/fp8_division_check.h"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed {
namespace {

using cuda::bf16;
using cuda::Fp8Activations;
using cuda::NormKind;
using testing::DeviceBuffer;

constexpr float kEps = 1e-6f;

TEST(Fp8FusedQuantizeCudaTest, ReciprocalDivisionEqualsIeeeDivisionForEveryBf16) {
  DF_REQUIRE_GPU();
  testing::DivisionCheck check;
  DF_CUDA_OK(testing::CheckReciprocalDivisionForEveryBf16(&check));
  // The pairs: for each amax, the bf16 x (both signs) with |x| <= amax.
  uint64_t want_pairs = 0;
  for (uint32_t a = 0; a < 0x7F80; ++a) want_pairs += 2 * (a + 1);
  EXPECT_EQ(check.pairs, want_pairs);
  EXPECT_EQ(check.mismatches, 0u) << "first at amax bits 0x" << std::hex << check.first_amax_bits
                                  << ", x bits 0x" << check.first_x_bits;
}

// An FP8 operand of `tokens` x k, pre-filled with bytes a kernel must overwrite.
struct Operand {
  Operand(int64_t tokens, int64_t k)
      : m_pad(cuda::Fp8RowsPadded(tokens)), q(m_pad * k), s(m_pad * (k / 128)) {
    cudaMemset(q.get(), 0xAB, q.size());
    cudaMemset(s.get(), 0x7F, s.size() * 4);
  }
  Fp8Activations fp8() const { return {q.get(), s.get()}; }
  int64_t m_pad;
  DeviceBuffer<uint8_t> q;
  DeviceBuffer<float> s;
};

void ExpectSameOperand(const Operand& got, const Operand& want, const std::string& what) {
  EXPECT_EQ(got.q.Download(), want.q.Download()) << what << ": e4m3 bytes";
  EXPECT_EQ(got.s.Download(), want.s.Download()) << what << ": scales";
}

template <typename T>
void ExpectSame(const DeviceBuffer<T>& got, const DeviceBuffer<T>& want, const std::string& what) {
  const std::vector<T> a = got.Download(), b = want.Download();
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)), 0) << what;
}

// Widths of the models' hidden sizes and the norm paths they take: 1024
// (a warp a row), 2048, 2560 (a block of 96 threads, 80 live), 4096, 5120;
// and 256 (16 lanes a row) and 128 (8 lanes: the norm, then the quantizer).
TEST(Fp8FusedQuantizeCudaTest, ResidualNormsQuantizeAsTheQuantizerWould) {
  DF_REQUIRE_GPU();
  for (int64_t width : {128, 256, 1024, 2048, 2560, 4096, 5120}) {
    for (int64_t tokens : {1, 6, 37, 301}) {
      const std::string what =
          "width " + std::to_string(width) + ", " + std::to_string(tokens) + " tokens";
      const int64_t n = tokens * width;
      DeviceBuffer<float> x(n), res_a(n), res_b(n);
      DeviceBuffer<bf16> delta(n), w(width), out_a(n), out_b(n);
      DF_CUDA_OK(cuda::FillRandomF32(x.get(), n, 1 + width, 3.0f, 0.0f, nullptr));
      DF_CUDA_OK(cuda::FillRandomBf16(delta.get(), n, 2 + tokens, 1.0f, 0.0f, nullptr));
      DF_CUDA_OK(cuda::FillRandomBf16(w.get(), width, 3, 0.2f, 0.0f, nullptr));
      // One all-zero row and one outlier: the clamped scale and a saturating group.
      DF_CUDA_OK(cudaMemset(x.get(), 0, width * 4));
      const float big = 3e4f;
      if (tokens > 1) DF_CUDA_OK(cudaMemcpy(x.get() + width + 7, &big, 4, cudaMemcpyHostToDevice));

      Operand fused(tokens, width), separate(tokens, width);
      DF_CUDA_OK(cuda::RmsNormF32(x.get(), width, w.get(), tokens, width, kEps,
                                  NormKind::kZeroCentred, out_a.get(), width, nullptr,
                                  fused.fp8()));
      DF_CUDA_OK(cuda::RmsNormF32(x.get(), width, w.get(), tokens, width, kEps,
                                  NormKind::kZeroCentred, out_b.get(), width, nullptr));
      DF_CUDA_OK(cuda::QuantizeActivationsFp8(out_b.get(), width, tokens, width, separate.q.get(),
                                              separate.s.get(), nullptr));
      DF_CUDA_OK(cudaDeviceSynchronize());
      ExpectSame(out_a, out_b, "RmsNormF32 " + what + ": bf16 output");
      ExpectSameOperand(fused, separate, "RmsNormF32 " + what);

      Operand fused_add(tokens, width), separate_add(tokens, width);
      DF_CUDA_OK(cudaMemcpy(res_a.get(), x.get(), n * 4, cudaMemcpyDeviceToDevice));
      DF_CUDA_OK(cudaMemcpy(res_b.get(), x.get(), n * 4, cudaMemcpyDeviceToDevice));
      DF_CUDA_OK(cuda::AddRmsNormF32(res_a.get(), delta.get(), w.get(), tokens, width, kEps,
                                     NormKind::kMultiplicative, out_a.get(), nullptr,
                                     fused_add.fp8()));
      DF_CUDA_OK(cuda::AddRmsNormF32(res_b.get(), delta.get(), w.get(), tokens, width, kEps,
                                     NormKind::kMultiplicative, out_b.get(), nullptr));
      DF_CUDA_OK(cuda::QuantizeActivationsFp8(out_b.get(), width, tokens, width,
                                              separate_add.q.get(), separate_add.s.get(), nullptr));
      DF_CUDA_OK(cudaDeviceSynchronize());
      ExpectSame(res_a, res_b, "AddRmsNormF32 " + what + ": residual");
      ExpectSame(out_a, out_b, "AddRmsNormF32 " + what + ": bf16 output");
      ExpectSameOperand(fused_add, separate_add, "AddRmsNormF32 " + what);
    }
  }
}

// A bf16 output the vector path cannot take (16-byte misaligned, strided):
// the norm, then the quantizer, with the same result.
TEST(Fp8FusedQuantizeCudaTest, MisalignedOutputFallsBackToTheQuantizer) {
  DF_REQUIRE_GPU();
  constexpr int64_t kWidth = 2048, kTokens = 19, kStride = kWidth + 4;
  DeviceBuffer<float> x(kTokens * kWidth);
  DeviceBuffer<bf16> w(kWidth), out(kTokens * kStride + 8), out_dense(kTokens * kWidth);
  DF_CUDA_OK(cuda::FillRandomF32(x.get(), x.size(), 5, 2.0f, 0.0f, nullptr));
  DF_CUDA_OK(cuda::FillRandomBf16(w.get(), kWidth, 6, 0.2f, 0.0f, nullptr));
  Operand fused(kTokens, kWidth), separate(kTokens, kWidth);
  DF_CUDA_OK(cuda::RmsNormF32(x.get(), kWidth, w.get(), kTokens, kWidth, kEps,
                              NormKind::kZeroCentred, out.get() + 4, kStride, nullptr,
                              fused.fp8()));
  DF_CUDA_OK(cuda::RmsNormF32(x.get(), kWidth, w.get(), kTokens, kWidth, kEps,
                              NormKind::kZeroCentred, out_dense.get(), kWidth, nullptr));
  DF_CUDA_OK(cuda::QuantizeActivationsFp8(out_dense.get(), kWidth, kTokens, kWidth,
                                          separate.q.get(), separate.s.get(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  ExpectSameOperand(fused, separate, "misaligned RmsNormF32");
}

// The gated attention's output gate, Qwen3.6-27B's shape (24 heads of 256,
// the gate interleaved with q per head) and a 128-wide head.
TEST(Fp8FusedQuantizeCudaTest, OutputGateQuantizesAsTheQuantizerWould) {
  DF_REQUIRE_GPU();
  struct Shape {
    int64_t heads, head_dim;
  };
  for (const Shape& shape : {Shape{24, 256}, Shape{16, 128}, Shape{6, 64}}) {
    for (int64_t tokens : {1, 5, 133}) {
      const std::string what = std::to_string(shape.heads) + " heads of " +
                               std::to_string(shape.head_dim) + ", " + std::to_string(tokens) +
                               " tokens";
      const int64_t row = shape.heads * shape.head_dim;
      const int64_t head_stride = 2 * shape.head_dim, token_stride = shape.heads * head_stride + 64;
      DeviceBuffer<bf16> o_a(tokens * row), o_b(tokens * row), qg(tokens * token_stride);
      DF_CUDA_OK(cuda::FillRandomBf16(o_a.get(), o_a.size(), 10 + tokens, 1.0f, 0.0f, nullptr));
      DF_CUDA_OK(cudaMemcpy(o_b.get(), o_a.get(), o_a.size() * 2, cudaMemcpyDeviceToDevice));
      DF_CUDA_OK(cuda::FillRandomBf16(qg.get(), qg.size(), 11, 3.0f, 0.0f, nullptr));
      const bf16* gate = qg.get() + shape.head_dim;
      Operand fused(tokens, row), separate(tokens, row);
      DF_CUDA_OK(cuda::SigmoidGateMulQuantizeFp8(o_a.get(), gate, tokens, shape.heads,
                                                 shape.head_dim, token_stride, head_stride,
                                                 fused.fp8(), nullptr));
      DF_CUDA_OK(cuda::SigmoidGateMul(o_b.get(), gate, tokens, shape.heads, shape.head_dim,
                                      token_stride, head_stride, nullptr));
      DF_CUDA_OK(cuda::QuantizeActivationsFp8(o_b.get(), row, tokens, row, separate.q.get(),
                                              separate.s.get(), nullptr));
      DF_CUDA_OK(cudaDeviceSynchronize());
      ExpectSame(o_a, o_b, "SigmoidGateMulQuantizeFp8 " + what + ": bf16 output");
      ExpectSameOperand(fused, separate, "SigmoidGateMulQuantizeFp8 " + what);
    }
  }
}

TEST(Fp8FusedQuantizeCudaTest, RowsThatAreNotWholeGroupsAreRefused) {
  DF_REQUIRE_GPU();
  DeviceBuffer<float> x(4 * 200);
  DeviceBuffer<bf16> w(200), out(4 * 200), o(4 * 3 * 40), gate(4 * 3 * 80);
  Operand op(4, 256);
  EXPECT_EQ(cuda::RmsNormF32(x.get(), 200, w.get(), 4, 200, kEps, NormKind::kZeroCentred, out.get(),
                             200, nullptr, op.fp8()),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      cuda::SigmoidGateMulQuantizeFp8(o.get(), gate.get(), 4, 3, 40, 240, 80, op.fp8(), nullptr),
      cudaErrorInvalidValue);
  DF_CUDA_OK(cudaGetLastError());
}

}  // namespace
}  // namespace draftfeed
