// The CUDA engine on FP8 models (skips without a GPU that runs the case's
// GEMMs): it runs the projections through FP8 GEMMs and stays close to the
// CPU reference, which computes in fp32 on the dequantized weights (what the
// checkpoint means). Under a portable kernel set (DRAFTFEED_PORTABLE_KERNELS's
// modes) a Hopper runs what a B200 or an RTX PRO 6000 would: the portable
// dense FP8 GEMM and the experts' mma.sync FP8 GEMMs.
//
// The two differ by the GPU's run-time quantization of every FP8 GEMM input
// to e4m3 per 128-group: e4m3 keeps 3 mantissa bits, so each quantized
// element carries a relative rounding error of rms 2^-4/√3 ≈ 3.6%, and a GEMM
// output about the same relative error. Compounded over these models' few
// layers (plus bf16 roundings) the captured states stay within ~10% relative
// rms; the bound 0.15 leaves room, while a scale read from the wrong block,
// a misplaced bf16 tail or an unquantized input gives errors of order 1. MoE
// models add routing flips (FP8 noise moves near-tie tokens to other
// experts: errors of order 1 on those tokens), so they are judged by the
// median token's relative error, which flips of a minority cannot move. The
// exact fidelity bar (against transformers and a torch emulation of the FP8
// engine) is fp8_goldens_test's.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/fp8_gemm_portable.cuh"
#include "kernels/kernel_paths.cuh"
#include "server/model/cpu_engine.h"
#include "server/model/cuda_engine.h"
#include "server/model/tensor.h"

namespace draftfeed {
namespace {

bool HasHopper() {
  if (CudaDeviceCount() == 0) return false;
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  return major == 9;
}

// A model, the GEMM asked for behind the dense FP8 projections (cuBLASLt's,
// or draftfeed's own: kernels/hopper_gemm.cuh on Hopper, else
// kernels/fp8_gemm_portable.cuh) and the kernel set; all pass the same bar.
struct Case {
  const char* model;
  CudaEngineOptions::Fp8Gemm gemm;
  cuda::PortableKernels kernels = cuda::PortableKernels::kAuto;
};
class CudaFp8EngineTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaFp8EngineTest, RunsFp8GemmsCloseToTheDequantizedReference) {
  const bool portable = GetParam().kernels != cuda::PortableKernels::kAuto;
  if (portable && (CudaDeviceCount() == 0 || !cuda::PortableFp8GemmAvailable())) {
    GTEST_SKIP() << "needs an sm_89 or newer GPU (e4m3 mma.sync)";
  }
  if (!portable && !HasHopper()) GTEST_SKIP() << "needs an sm_90 GPU (cuBLASLt's FP8 GEMM)";
  cuda::ScopedPortableKernels kernels(GetParam().kernels);
  const char* name = GetParam().model;
  auto model = OpenModel(name);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config;
  auto cpu = CpuEngine::Create(model->get(), 0);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  CudaEngineOptions opt;
  opt.max_tokens = 1023;  // not a multiple of 4: the FP8 GEMM's row padding is exercised
  opt.max_seqs = 16;
  opt.fp8_gemm = GetParam().gemm;
  auto gpu = CudaEngine::Create(model->get(), opt);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const CudaEngine::Fp8Layout layout = (*gpu)->fp8_layout();
  EXPECT_GT(layout.gemm_buffers, 0) << "no projection ran through an FP8 GEMM";

  const std::vector<int32_t> lens = {1, 63, 130, 7};  // T = 201, not a multiple of 4
  int64_t T = 0;
  for (int32_t l : lens) T += l;
  std::vector<int32_t> ids(static_cast<size_t>(T));
  std::mt19937_64 rng(17);
  for (auto& t : ids) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(c.vocab_size));
  std::vector<int32_t> layers;
  for (int32_t i = 0; i < c.num_layers; ++i) layers.push_back(i);
  layers.push_back(kFinalLayerId);
  const int64_t K = static_cast<int64_t>(layers.size()), H = c.hidden_size;
  std::vector<float> ref(static_cast<size_t>(T * K * H));
  ASSERT_TRUE((*cpu)->ForwardFloat({ids, lens, layers}, ref).ok());
  std::vector<uint16_t> got(static_cast<size_t>(T * K * H));
  ASSERT_TRUE(
      (*gpu)->Forward({ids, lens, layers}, std::as_writable_bytes(std::span<uint16_t>(got))).ok());
  const bool moe = c.num_experts > 0;
  for (int64_t k = 0; k < K; ++k) {
    double num = 0, den = 0;
    std::vector<double> token_rel;
    for (int64_t t = 0; t < T; ++t) {
      double tn = 0, td = 0;
      for (int64_t i = 0; i < H; ++i) {
        const double r = ref[(t * K + k) * H + i];
        const double d = Bf16ToFloat(got[(t * K + k) * H + i]) - r;
        tn += d * d;
        td += r * r;
      }
      num += tn;
      den += td;
      token_rel.push_back(std::sqrt(tn / (td + 1e-30)));
    }
    std::nth_element(token_rel.begin(), token_rel.begin() + T / 2, token_rel.end());
    const double rel = moe ? token_rel[static_cast<size_t>(T / 2)] : std::sqrt(num / den);
    EXPECT_LT(rel, 0.15) << name << " capture slot " << k << (moe ? " (median token)" : "");
    // Activation quantization is real: the GPU is not silently running bf16.
    EXPECT_GT(rel, 1e-3) << name << " capture slot " << k;
  }
}

using Gemm = CudaEngineOptions::Fp8Gemm;
constexpr cuda::PortableKernels kSm100 = cuda::PortableKernels::kSm100;
constexpr cuda::PortableKernels kSm120 = cuda::PortableKernels::kSm120;
INSTANTIATE_TEST_SUITE_P(Fp8Models, CudaFp8EngineTest,
                         ::testing::Values(Case{"tiny-random-fp8", Gemm::kAuto},
                                           Case{"tiny-random-qwen3-fp8", Gemm::kAuto},
                                           Case{"tiny-random-moe-fp8", Gemm::kAuto},
                                           Case{"tiny-random-qwen3-moe-fp8", Gemm::kAuto},
                                           Case{"tiny-random-fp8", Gemm::kDraftfeed},
                                           Case{"tiny-random-qwen3-fp8", Gemm::kDraftfeed},
                                           Case{"tiny-random-qwen3-moe-fp8", Gemm::kDraftfeed},
                                           Case{"tiny-random-fp8", Gemm::kAuto, kSm120},
                                           Case{"tiny-random-qwen3-fp8", Gemm::kAuto, kSm120},
                                           Case{"tiny-random-moe-fp8", Gemm::kAuto, kSm120},
                                           Case{"tiny-random-qwen3-moe-fp8", Gemm::kAuto, kSm100}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const bool portable = info.param.kernels != cuda::PortableKernels::kAuto;
                           std::string n =
                               std::string(info.param.model) +
                               (portable ? std::string("_portable_") +
                                               cuda::PortableKernelsName(info.param.kernels)
                                : info.param.gemm == Gemm::kDraftfeed ? "_draftfeed_gemm"
                                                                      : "_cublaslt_gemm");
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// Asking for cuBLASLt's FP8 GEMM where it does not serve block scales (here:
// the kernels a B200 runs) is refused at creation, saying what to ask for
// instead; auto and draftfeed serve the model on the portable GEMM.
TEST(CudaFp8EngineRefusals, CublasLtGemmWhereItCannotRunIsRefused) {
  if (!HasHopper()) GTEST_SKIP() << "needs an sm_90 GPU (cuBLASLt's block-scaled FP8 GEMM)";
  auto model = OpenModel("tiny-random-qwen3-fp8");
  ASSERT_TRUE(model.ok()) << model.status();
  cuda::ScopedPortableKernels portable(cuda::PortableKernels::kSm100);
  CudaEngineOptions opt;
  opt.max_tokens = 256;
  opt.max_seqs = 4;
  opt.fp8_gemm = Gemm::kCublasLt;
  auto refused = CudaEngine::Create(model->get(), opt);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("ask for 'auto' or 'draftfeed'"), std::string::npos)
      << refused.status();
  for (const Gemm gemm : {Gemm::kAuto, Gemm::kDraftfeed}) {
    opt.fp8_gemm = gemm;
    auto served = CudaEngine::Create(model->get(), opt);
    EXPECT_TRUE(served.ok()) << served.status();
  }
}

}  // namespace
}  // namespace draftfeed
