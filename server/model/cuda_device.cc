// Start-up checks of the GPU a CUDA engine runs on (cuda_device.h).
#include "server/model/cuda_device.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/attention.cuh"
#include "kernels/gdn.cuh"
#include "kernels/kernel_paths.cuh"

// Set by server/model/CMakeLists.txt from DRAFTFEED_CUDA_ARCHS.
#ifndef DRAFTFEED_CUDA_ARCHS
#define DRAFTFEED_CUDA_ARCHS "(not recorded)"
#endif

namespace draftfeed {
namespace {

absl::StatusOr<CudaDeviceFacts> Facts(int device) {
  cudaDeviceProp prop;
  const cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) {
    return absl::InternalError(
        absl::StrCat("cudaGetDeviceProperties(", device, "): ", cudaGetErrorString(err)));
  }
  return CudaDeviceFacts{device, prop.major, prop.minor, prop.name};
}

std::string Sm(const CudaDeviceFacts& gpu) { return absl::StrCat("sm_", gpu.major, gpu.minor); }

}  // namespace

const char* BuiltCudaArchitectures() { return DRAFTFEED_CUDA_ARCHS; }

std::string PortableKernelsProblem(const char* value) {
  cuda::PortableKernels mode;
  if (cuda::ParsePortableKernels(value, &mode)) return "";
  return absl::StrCat(cuda::kPortableKernelsEnv, "=", value,
                      " is not a kernel set: use sm100 (the kernels of an sm_100 GPU), 1 or "
                      "sm120 (those of an sm_120 GPU), or 0 (this GPU's own)");
}

std::string KernelImageProblem(const CudaDeviceFacts& gpu, const std::string& cuda_error) {
  return absl::StrCat("cuda:", gpu.device, " (", gpu.name, ") is ", Sm(gpu),
                      " and this build's CUDA kernels do not load there (", cuda_error,
                      "): they are built for ", BuiltCudaArchitectures(),
                      " (CMake's DRAFTFEED_CUDA_ARCHS)",
                      gpu.major < 9 ? "; they need an sm_90 or newer GPU (Hopper or Blackwell)"
                                    : "; add this GPU's architecture there and rebuild");
}

std::string Fp8DeviceProblem(const CudaDeviceFacts& gpu) {
  if (gpu.major == 9) return "";
  return absl::StrCat(
      "this FP8 model needs an sm_90 (Hopper) GPU: its GEMMs are cuBLASLt's FP8 GEMMs with "
      "128-wide block scales, which cuBLASLt runs on sm_90 only; cuda:",
      gpu.device, " (", gpu.name, ") is ", Sm(gpu),
      " (serve the bf16 checkpoint there, without --quantize fp8)");
}

absl::Status CheckCudaDevice(int device, const ModelConfig& config) {
  const char* env = std::getenv(cuda::kPortableKernelsEnv);
  if (std::string why = PortableKernelsProblem(env); !why.empty()) {
    return absl::InvalidArgumentError(why);
  }
  DF_ASSIGN_OR_RETURN(const CudaDeviceFacts gpu, Facts(device));
  // Loading attention's kernel says whether the binary has code for this
  // GPU at all (every kernel file is built for the same architectures).
  cuda::AttentionPath attention;
  const int64_t attention_dim =
      config.head_dim == 128 || config.head_dim == 256 ? config.head_dim : 128;
  if (const cudaError_t err = cuda::ChooseAttentionPath(attention_dim, &attention);
      err != cudaSuccess) {
    cudaGetLastError();  // a failed load is sticky only as the last error
    return absl::FailedPreconditionError(KernelImageProblem(gpu, cudaGetErrorString(err)));
  }
  int smem = 0;
  if (const cudaError_t err = cuda::SmemPerBlockLimit(&smem); err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cuda:", device, ": ", cudaGetErrorString(err)));
  }
  std::string line = absl::StrCat("draftfeed: cuda:", device, " ", gpu.name, " (", Sm(gpu), ", ",
                                  smem / 1024, " KB shared memory a block)");
  if (const cuda::PortableKernels mode = cuda::PortableKernelsMode();
      mode != cuda::PortableKernels::kAuto) {
    absl::StrAppend(&line, ", the kernels of an ", cuda::PortableKernelsName(mode), " GPU (",
                    cuda::kPortableKernelsEnv, ")");
  }
  if (config.head_dim == attention_dim) {
    absl::StrAppend(&line, "; attention ", attention.wgmma ? "wgmma" : "mma.sync", " ",
                    attention.kv_tile, "-key tiles");
  }
  if (config.features.linear_attention) {
    int stages = 0;
    if (cuda::GdnScanStages(config.linear_key_head_dim, config.linear_value_head_dim, &stages) ==
        cudaSuccess) {
      absl::StrAppend(&line, "; GDN scan ", stages, stages == 1 ? " stage" : " stages");
    }
  }
  std::fprintf(stderr, "%s\n", line.c_str());
  return absl::OkStatus();
}

absl::Status CheckFp8Device(int device) {
  DF_ASSIGN_OR_RETURN(const CudaDeviceFacts gpu, Facts(device));
  if (std::string why = Fp8DeviceProblem(gpu); !why.empty()) {
    return absl::FailedPreconditionError(why);
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
