// The CUDA engine's start-up messages about the GPU (server/model/cuda_device.h),
// checked without one: which GPUs serve an FP8 model and on which GEMM, what
// a GPU the build does not cover is told, and a bad DRAFTFEED_PORTABLE_KERNELS
// value.
#include "server/model/cuda_device.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace draftfeed {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST(CudaDeviceTest, Fp8ModelsRunFromSm89) {
  for (const CudaDeviceFacts& ok :
       std::vector<CudaDeviceFacts>{{0, 9, 0, "NVIDIA H200"},
                                    {0, 10, 0, "NVIDIA B200"},
                                    {0, 10, 3, "NVIDIA B300"},
                                    {1, 12, 0, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"},
                                    {0, 8, 9, "NVIDIA L40S"}}) {
    EXPECT_THAT(Fp8DeviceProblem(ok), IsEmpty()) << ok.name;
  }
  const std::string a6000 = Fp8DeviceProblem({2, 8, 6, "NVIDIA RTX A6000"});
  EXPECT_THAT(a6000, HasSubstr("this FP8 model needs an sm_89 or newer GPU"));
  EXPECT_THAT(a6000, HasSubstr("cuda:2 (NVIDIA RTX A6000) is sm_86"));
  EXPECT_THAT(a6000, HasSubstr("serve the bf16 checkpoint there, without --quantize fp8"));
}

// The dense FP8 projections' GEMM: cuBLASLt's only on sm_90 outside the
// portable-kernel mode (where it serves 128x128-block scales), draftfeed's
// Hopper one where it runs and is asked for, the portable one elsewhere; an
// explicit 'cublaslt' where cuBLASLt cannot serve is refused, naming the GPU.
TEST(CudaDeviceTest, Fp8GemmChoice) {
  using Gemm = CudaEngineOptions::Fp8Gemm;
  const CudaDeviceFacts h200{0, 9, 0, "NVIDIA H200"};
  const CudaDeviceFacts rtx{1, 12, 0, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"};
  const CudaDeviceFacts b200{0, 10, 0, "NVIDIA B200"};
  auto choice = [](const CudaDeviceFacts& gpu, bool portable, bool hopper, Gemm asked) {
    const absl::StatusOr<Fp8GemmPath> path = Fp8GemmChoice(gpu, portable, hopper, asked);
    return path.ok() ? std::string(Fp8GemmPathName(*path)) : std::string(path.status().message());
  };
  const std::string cublaslt = Fp8GemmPathName(Fp8GemmPath::kCublasLt);
  const std::string hopper = Fp8GemmPathName(Fp8GemmPath::kHopper);
  const std::string portable = Fp8GemmPathName(Fp8GemmPath::kPortable);
  EXPECT_EQ(choice(h200, false, true, Gemm::kAuto), hopper);
  // An sm_90 binary without sm_90a code runs no wgmma kernel: cuBLASLt's.
  EXPECT_EQ(choice(h200, false, false, Gemm::kAuto), cublaslt);
  EXPECT_EQ(choice(h200, false, true, Gemm::kCublasLt), cublaslt);
  EXPECT_EQ(choice(h200, false, true, Gemm::kDraftfeed), hopper);
  // DRAFTFEED_PORTABLE_KERNELS on the H200: what the B200 or RTX PRO 6000 runs.
  EXPECT_EQ(choice(h200, true, false, Gemm::kAuto), portable);
  EXPECT_EQ(choice(h200, true, false, Gemm::kDraftfeed), portable);
  for (const CudaDeviceFacts& gpu : {rtx, b200}) {
    EXPECT_EQ(choice(gpu, false, false, Gemm::kAuto), portable) << gpu.name;
    EXPECT_EQ(choice(gpu, false, false, Gemm::kDraftfeed), portable) << gpu.name;
  }
  const std::string refused = choice(rtx, false, false, Gemm::kCublasLt);
  EXPECT_THAT(refused, HasSubstr("FP8 GEMM 'cublaslt' asked for, but cuBLASLt serves 128x128-block "
                                 "FP8 scales on sm_90 only"));
  EXPECT_THAT(refused, HasSubstr("is sm_120; ask for 'auto' or 'draftfeed'"));
  EXPECT_THAT(choice(h200, true, false, Gemm::kCublasLt),
              HasSubstr("is sm_90 running another GPU's kernels (DRAFTFEED_PORTABLE_KERNELS)"));
  EXPECT_EQ(Fp8GemmChoice(b200, false, false, Gemm::kCublasLt).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(CudaDeviceTest, AGpuTheBuildDoesNotCoverIsNamedWithTheBuiltArchitectures) {
  const std::string archs = BuiltCudaArchitectures();
  EXPECT_THAT(archs, HasSubstr("-real"));  // recorded from DRAFTFEED_CUDA_ARCHS
  const std::string ampere =
      KernelImageProblem({2, 8, 6, "NVIDIA RTX A6000"}, "no kernel image is available");
  EXPECT_THAT(ampere, HasSubstr("cuda:2 (NVIDIA RTX A6000) is sm_86 and this build's CUDA "
                                "kernels do not load there (no kernel image is available)"));
  EXPECT_THAT(ampere, HasSubstr("built for " + archs + " (CMake's DRAFTFEED_CUDA_ARCHS)"));
  EXPECT_THAT(ampere, HasSubstr("they need an sm_90 or newer GPU"));
  EXPECT_THAT(KernelImageProblem({0, 12, 0, "NVIDIA GeForce RTX 5090"}, "x"),
              HasSubstr("add this GPU's architecture there and rebuild"));
}

TEST(CudaDeviceTest, PortableKernelsValues) {
  for (const char* ok : {static_cast<const char*>(nullptr), "", "0", "1", "sm100", "sm120"}) {
    EXPECT_THAT(PortableKernelsProblem(ok), IsEmpty()) << (ok ? ok : "(unset)");
  }
  EXPECT_EQ(PortableKernelsProblem("yes"),
            "DRAFTFEED_PORTABLE_KERNELS=yes is not a kernel set: use sm100 (the kernels of an "
            "sm_100 GPU), 1 or sm120 (those of an sm_120 GPU), or 0 (this GPU's own)");
}

}  // namespace
}  // namespace draftfeed
