// CudaEngine's creation, teardown and accessors; its jobs live in the files
// cuda_engine_impl.h lists.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/thread_name.h"
#include "server/model/cuda_engine_impl.h"

namespace draftfeed {

CudaEngine::CudaEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudaEngine::~CudaEngine() {
  if (impl_) {
    impl_->StopCopier();  // every pending copy's callback runs first
    impl_->FreeTargetOutputs();
    impl_->FreeCarry();
    for (cudaEvent_t e : impl_->copied) {
      if (e) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : impl_->forwarded) {
      if (e) cudaEventDestroy(e);
    }
    if (impl_->send_stream) cudaStreamDestroy(impl_->send_stream);
    if (impl_->copy_stream) cudaStreamDestroy(impl_->copy_stream);
    if (impl_->d_lanes) cudaFree(impl_->d_lanes);
    for (uint8_t* p : impl_->fp8_captures) {
      if (p) cudaFree(p);
    }
    if (impl_->h_lanes) cudaFreeHost(impl_->h_lanes);
    if (impl_->h_ids) cudaFreeHost(impl_->h_ids);
    if (impl_->h_cu) cudaFreeHost(impl_->h_cu);
    if (impl_->stream) cudaStreamDestroy(impl_->stream);
  }
}

absl::StatusOr<std::unique_ptr<CudaEngine>> CudaEngine::Create(const Model* model,
                                                               const CudaEngineOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("CudaEngine::Create: model is null");
  if (options.max_tokens < 1) return absl::InvalidArgumentError("max_tokens must be >= 1");
  auto impl = std::make_unique<Impl>();
  DF_RETURN_IF_ERROR(impl->Init(model, options));
  cudaDeviceProp prop{};
  impl->numerics = cudaGetDeviceProperties(&prop, options.device) == cudaSuccess
                       ? absl::StrCat("cuda ", prop.name, " sm_", prop.major, prop.minor, " ",
                                      prop.multiProcessorCount, " SMs, FP8 GEMM ",
                                      Fp8GemmPathName(impl->fp8_gemm_path),
                                      impl->fused_gate_up ? ", FP8 gate_up fused" : "")
                       : absl::StrCat("cuda:", options.device);
  impl->copier = std::thread([p = impl.get()] {
    NameThisThread("df-gpu-copy");
    p->CopyLoop();
  });
  return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(impl)));
}

const Model& CudaEngine::model() const { return *impl_->model; }

std::string CudaEngine::device_name() const { return absl::StrCat("cuda:", impl_->options.device); }

std::string CudaEngine::numerics() const { return impl_->numerics; }

absl::Status CudaEngine::ForwardOnDevice(const ForwardInput& in) {
  impl_->TakeBuffer();
  return impl_->Run(in);
}

std::vector<CaptureEncoding> CudaEngine::encodings() const {
  return {CaptureEncoding::kBf16, CaptureEncoding::kFp8E4m3};
}

int64_t CudaEngine::max_capture_layers() const { return impl_->options.max_layers; }

bool CudaEngine::serves_target_outputs() const { return impl_->ServesTargetOutputs(); }

int64_t CudaEngine::max_carry_tokens() const { return impl_->carry_max; }
int64_t CudaEngine::CarryBytes(int64_t tokens) const {
  return static_cast<int64_t>(impl_->CarryBytes(tokens));
}
absl::Status CudaEngine::ReserveCarry(int64_t tokens) {
  return impl_->ReserveCarry(tokens);
}
void CudaEngine::DropCarry() { impl_->carry_tokens = 0; }

int64_t CudaEngine::weight_bytes() const { return static_cast<int64_t>(impl_->weights.used()); }
int64_t CudaEngine::workspace_bytes() const { return static_cast<int64_t>(impl_->workspace_total); }
CudaEngine::Fp8Layout CudaEngine::fp8_layout() const {
  return {impl_->fp8_gemm_buffers, impl_->fp8_dequantized_buffers};
}
const OpTimes& CudaEngine::last_op_times() const { return impl_->times; }
void CudaEngine::set_profile(bool on) { impl_->options.profile = on; }

int CudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

HostAllocator PinnedHostAllocator() {
  return HostAllocator{
      .allocate = [](size_t bytes) -> void* {
        void* p = nullptr;
        return cudaHostAlloc(&p, bytes, cudaHostAllocPortable) == cudaSuccess ? p : nullptr;
      },
      .release = [](void* p) { cudaFreeHost(p); }};
}

}  // namespace draftfeed
