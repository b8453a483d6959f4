// Start-up checks of the GPU a CUDA engine runs on: the kernels this build
// holds must load there, DRAFTFEED_PORTABLE_KERNELS must be a value the
// kernels know, and an FP8 model needs e4m3 tensor cores (sm_89 or newer).
// Also the lines that say which kernel variants the GPU runs, and which GEMM
// an FP8 model's dense projections take.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/config.h"
#include "server/model/cuda_engine.h"

namespace draftfeed {

// What CheckCudaDevice and CheckFp8Device read of the GPU.
struct CudaDeviceFacts {
  int device = 0;
  int major = 0, minor = 0;  // compute capability
  std::string name;          // "NVIDIA H200"
};

// Whether `device` (already current) runs this build's kernels for `config`,
// under DRAFTFEED_PORTABLE_KERNELS; prints which variants to stderr. Fails
// naming the variable's value, or the GPU and the architectures built.
absl::Status CheckCudaDevice(int device, const ModelConfig& config);

// An FP8 model on `device`: FailedPrecondition before sm_89 (Fp8DeviceProblem).
absl::Status CheckFp8Device(int device);

// The GEMM behind an FP8 model's dense projections: cuBLASLt's block-scaled
// GEMM (server/model/cuda_fp8_gemm.h, sm_90 only), draftfeed's Hopper one
// (kernels/hopper_gemm.cuh, sm_90a) or its portable one
// (kernels/fp8_gemm_portable.cuh, every GPU from sm_89).
enum class Fp8GemmPath { kCublasLt, kHopper, kPortable };
const char* Fp8GemmPathName(Fp8GemmPath path);

// Which one serves `asked` on `device` (current) under
// DRAFTFEED_PORTABLE_KERNELS, printed to stderr; FailedPrecondition for
// 'cublaslt' where cuBLASLt does not serve these scales (Fp8GemmChoice).
absl::StatusOr<Fp8GemmPath> ChooseFp8Gemm(int device, CudaEngineOptions::Fp8Gemm asked);

// The rule, apart so that it is tested without a GPU. auto: the Hopper one
// where it runs, else cuBLASLt's on sm_90 outside the portable-kernel mode,
// else the portable one; draftfeed:
// the Hopper one where it runs (`hopper_runs`: cuda::HopperGemmsAvailable()),
// else the portable one; cublaslt: cuBLASLt's on sm_90 outside the portable
// mode, refused elsewhere (as the GPU the mode stands for would refuse it).
absl::StatusOr<Fp8GemmPath> Fp8GemmChoice(const CudaDeviceFacts& gpu, bool portable_mode,
                                          bool hopper_runs, CudaEngineOptions::Fp8Gemm asked);

// The messages, apart so that they are tested without a GPU: empty where the
// device is fine.
std::string Fp8DeviceProblem(const CudaDeviceFacts& gpu);
std::string KernelImageProblem(const CudaDeviceFacts& gpu, const std::string& cuda_error);
std::string PortableKernelsProblem(const char* value);

// The CUDA architectures the kernels were built for ("90a-real 100a-real ...").
const char* BuiltCudaArchitectures();

}  // namespace draftfeed
