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
#include "kernels/hopper_gemm.cuh"
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
  if (gpu.major * 10 + gpu.minor >= 89) return "";
  return absl::StrCat(
      "this FP8 model needs an sm_89 or newer GPU: its GEMMs multiply e4m3 on the tensor cores "
      "(mma.sync e4m3, wgmma on Hopper), which sm_89 introduced; cuda:",
      gpu.device, " (", gpu.name, ") is ", Sm(gpu),
      " (serve the bf16 checkpoint there, without --quantize fp8)");
}

const char* Fp8GemmPathName(Fp8GemmPath path) {
  switch (path) {
    case Fp8GemmPath::kCublasLt:
      return "cuBLASLt's block-scaled FP8 GEMM";
    case Fp8GemmPath::kHopper:
      return "draftfeed's Hopper FP8 GEMM (wgmma)";
    case Fp8GemmPath::kPortable:
      return "draftfeed's portable FP8 GEMM (mma.sync e4m3)";
  }
  return "?";
}

absl::StatusOr<Fp8GemmPath> Fp8GemmChoice(const CudaDeviceFacts& gpu, bool portable_mode,
                                          bool hopper_runs, CudaEngineOptions::Fp8Gemm asked) {
  using Fp8Gemm = CudaEngineOptions::Fp8Gemm;
  const bool cublaslt_runs = gpu.major == 9 && !portable_mode;
  switch (asked) {
    case Fp8Gemm::kDraftfeed:
      return hopper_runs ? Fp8GemmPath::kHopper : Fp8GemmPath::kPortable;
    case Fp8Gemm::kCublasLt:
      if (cublaslt_runs) return Fp8GemmPath::kCublasLt;
      return absl::FailedPreconditionError(absl::StrCat(
          "FP8 GEMM 'cublaslt' asked for, but cuBLASLt serves 128x128-block FP8 scales on sm_90 "
          "only: cuda:",
          gpu.device, " (", gpu.name, ") is ", Sm(gpu),
          portable_mode
              ? absl::StrCat(" running another GPU's kernels (", cuda::kPortableKernelsEnv, ")")
              : "",
          "; ask for 'auto' or 'draftfeed' (draftfeed's portable FP8 GEMM)"));
    case Fp8Gemm::kAuto:
      break;
  }
  // Ours on Hopper is 1.04-1.09x cuBLASLt's at the 27B's projections
  // (docs/performance.md); cuBLASLt's where only sm_90's generic code loaded.
  if (hopper_runs) return Fp8GemmPath::kHopper;
  return cublaslt_runs ? Fp8GemmPath::kCublasLt : Fp8GemmPath::kPortable;
}

absl::StatusOr<Fp8GemmPath> ChooseFp8Gemm(int device, CudaEngineOptions::Fp8Gemm asked) {
  DF_ASSIGN_OR_RETURN(const CudaDeviceFacts gpu, Facts(device));
  DF_ASSIGN_OR_RETURN(
      const Fp8GemmPath path,
      Fp8GemmChoice(gpu, cuda::PortableKernelsMode() != cuda::PortableKernels::kAuto,
                    cuda::HopperGemmsAvailable(), asked));
  std::fprintf(stderr, "draftfeed: cuda:%d FP8 dense projections on %s\n", device,
               Fp8GemmPathName(path));
  return path;
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
    cuda::GdnScanPath scan;
    if (cuda::ChooseGdnScanPath(config.linear_key_head_dim, config.linear_value_head_dim, &scan) ==
        cudaSuccess) {
      absl::StrAppend(&line, "; GDN scan ", scan.wgmma ? "wgmma " : "mma.sync ", scan.stages,
                      scan.stages == 1 ? " stage" : " stages");
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
