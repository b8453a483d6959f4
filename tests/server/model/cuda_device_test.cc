// The CUDA engine's start-up messages about the GPU (server/model/cuda_device.h),
// checked without one: what an sm_100 or sm_120 GPU is told for an FP8 model,
// what a GPU the build does not cover is told, and a bad
// DRAFTFEED_PORTABLE_KERNELS value.
#include "server/model/cuda_device.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace draftfeed {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;

TEST(CudaDeviceTest, Fp8ModelsRunOnHopperOnly) {
  EXPECT_THAT(Fp8DeviceProblem({0, 9, 0, "NVIDIA H200"}), IsEmpty());
  const std::string b200 = Fp8DeviceProblem({0, 10, 0, "NVIDIA B200"});
  EXPECT_THAT(b200, HasSubstr("this FP8 model needs an sm_90 (Hopper) GPU"));
  EXPECT_THAT(b200, HasSubstr("cuda:0 (NVIDIA B200) is sm_100"));
  EXPECT_THAT(b200, HasSubstr("serve the bf16 checkpoint there, without --quantize fp8"));
  const std::string rtx =
      Fp8DeviceProblem({1, 12, 0, "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"});
  EXPECT_THAT(rtx, HasSubstr("cuda:1 (NVIDIA RTX PRO 6000 Blackwell Workstation Edition) is "
                             "sm_120 (serve"));
  EXPECT_THAT(Fp8DeviceProblem({0, 10, 3, "NVIDIA B300"}), HasSubstr("is sm_103"));
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
