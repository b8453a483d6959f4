// Start-up checks of the GPU a CUDA engine runs on: the kernels this build
// holds must load there, DRAFTFEED_PORTABLE_KERNELS must be a value the
// kernels know, and an FP8 model needs cuBLASLt's block-scaled FP8 GEMMs
// (sm_90). Also the line that says which kernel variants the GPU runs.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "server/model/config.h"

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

// An FP8 model on `device`: FailedPrecondition off sm_90 (Fp8DeviceProblem).
absl::Status CheckFp8Device(int device);

// The messages, apart so that they are tested without a GPU: empty where the
// device is fine.
std::string Fp8DeviceProblem(const CudaDeviceFacts& gpu);
std::string KernelImageProblem(const CudaDeviceFacts& gpu, const std::string& cuda_error);
std::string PortableKernelsProblem(const char* value);

// The CUDA architectures the kernels were built for ("90a-real 100a-real ...").
const char* BuiltCudaArchitectures();

}  // namespace draftfeed
