#include "server/nccl/nccl_peer.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>

#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/strings/str_cat.h"
#include "kernels/checksum.cuh"

namespace draftfeed {

namespace {

using Clock = std::chrono::steady_clock;

absl::Status NcclError(ncclResult_t r, const char* what) {
  return absl::InternalError(absl::StrCat("nccl ", what, ": ", ncclGetErrorString(r)));
}

absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat("cuda ", what, ": ", cudaGetErrorString(e)));
}

}  // namespace

struct NcclPeer::Impl {
  ncclComm_t comm = nullptr;
  mutable std::mutex mu;  // Abort may come from another thread
  bool aborted = false;
  cudaEvent_t done = nullptr;
  unsigned long long* d_sum = nullptr;  // checksum scratch
  uint64_t* h_sum = nullptr;            // pinned
  ~Impl();
};

absl::StatusOr<std::string> NcclPeer::NewUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return NcclError(r, "ncclGetUniqueId (is there a network interface NCCL can use?)");
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclPeer>> NcclPeer::Start(const std::string& unique_id, int rank,
                                                         int device) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(absl::StrCat("nccl_unique_id has ", unique_id.size(),
                                                   " bytes; an ncclUniqueId has ",
                                                   sizeof(id.internal)));
  }
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return CudaError(e, absl::StrCat("cudaSetDevice(", device, ")").c_str());
  }
  auto impl = std::make_unique<Impl>();
  if (cudaError_t e = cudaEventCreateWithFlags(&impl->done, cudaEventDisableTiming);
      e != cudaSuccess) {
    return CudaError(e, "cudaEventCreate");
  }
  if (cudaError_t e = cudaMalloc(&impl->d_sum, sizeof(*impl->d_sum)); e != cudaSuccess) {
    return CudaError(e, "cudaMalloc");
  }
  if (cudaError_t e = cudaMallocHost(&impl->h_sum, sizeof(*impl->h_sum)); e != cudaSuccess) {
    return CudaError(e, "cudaMallocHost");
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every wait below polls, so it can time out and abort
  ncclResult_t r = ncclCommInitRankConfig(&impl->comm, 2, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    impl->comm = nullptr;
    return NcclError(r, "ncclCommInitRankConfig");
  }
  return std::unique_ptr<NcclPeer>(new NcclPeer(std::move(impl), device));
}

NcclPeer::NcclPeer(std::unique_ptr<Impl> impl, int device)
    : impl_(std::move(impl)), device_(device) {}

NcclPeer::~NcclPeer() { impl_.reset(); }

NcclPeer::Impl::~Impl() {
  // Abort rather than destroy: it never waits for the other rank, which may be
  // gone (and the device is set by the caller's thread or here).
  if (comm != nullptr && !aborted) ncclCommAbort(comm);
  if (done != nullptr) cudaEventDestroy(done);
  if (d_sum != nullptr) cudaFree(d_sum);
  if (h_sum != nullptr) cudaFreeHost(h_sum);
}

void NcclPeer::Abort() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->aborted || impl_->comm == nullptr) return;
  impl_->aborted = true;
  ncclCommAbort(impl_->comm);
  impl_->comm = nullptr;
}

bool NcclPeer::aborted() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->aborted;
}

absl::Status NcclPeer::Wait(double timeout_s, const Cancelled& cancelled) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  for (int spin = 0;; ++spin) {
    ncclResult_t async = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      if (impl_->aborted) return absl::AbortedError("nccl communicator was aborted");
      if (ncclResult_t r = ncclCommGetAsyncError(impl_->comm, &async); r != ncclSuccess) async = r;
    }
    if (async == ncclSuccess) return absl::OkStatus();
    if (async != ncclInProgress) {
      Abort();
      return NcclError(async, "communicator setup");
    }
    if (cancelled && cancelled()) {
      Abort();
      return absl::CancelledError("nccl setup cancelled: the other side went away");
    }
    if (Clock::now() > deadline) {
      Abort();
      return absl::DeadlineExceededError(absl::StrCat(
          "nccl setup did not finish in ", timeout_s,
          " s: the other process never joined (different hosts? firewall? NCCL_SOCKET_IFNAME?)"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(spin < 100 ? 50 : 1000));
  }
}

absl::Status NcclPeer::Transfer(bool send, void* data, size_t bytes, void* stream_ptr,
                                double timeout_s, const Cancelled& cancelled) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->aborted) return absl::AbortedError("nccl communicator was aborted");
    const int peer = send ? kReceiverRank : kSenderRank;
    ncclResult_t r = send ? ncclSend(data, bytes, ncclUint8, peer, impl_->comm, stream)
                          : ncclRecv(data, bytes, ncclUint8, peer, impl_->comm, stream);
    // Nonblocking communicators may answer ncclInProgress while enqueueing.
    while (r == ncclInProgress) {
      ncclCommGetAsyncError(impl_->comm, &r);
    }
    if (r != ncclSuccess) return NcclError(r, send ? "ncclSend" : "ncclRecv");
    if (cudaError_t e = cudaEventRecord(impl_->done, stream); e != cudaSuccess) {
      return CudaError(e, "cudaEventRecord");
    }
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  for (int spin = 0;; ++spin) {
    const cudaError_t q = cudaEventQuery(impl_->done);
    if (q == cudaSuccess) return absl::OkStatus();
    if (q != cudaErrorNotReady) return CudaError(q, "waiting for an nccl transfer");
    ncclResult_t async = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      if (impl_->aborted) return absl::AbortedError("nccl communicator was aborted");
      ncclCommGetAsyncError(impl_->comm, &async);
    }
    if (async != ncclSuccess && async != ncclInProgress) {
      Abort();
      return NcclError(async, send ? "ncclSend" : "ncclRecv");
    }
    if (cancelled && cancelled()) {
      Abort();
      return absl::CancelledError("nccl transfer cancelled: the other side went away");
    }
    if (Clock::now() > deadline) {
      Abort();
      return absl::DeadlineExceededError(absl::StrCat(
          "nccl ", send ? "send" : "receive", " of ", bytes, " bytes did not finish in ",
          timeout_s, " s; the communicator was aborted"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(spin < 200 ? 20 : 500));
  }
}

absl::StatusOr<uint64_t> NcclPeer::Checksum(const void* data, size_t bytes, void* stream) {
  if (cudaError_t e = cuda::PositionalChecksum(data, bytes, impl_->d_sum, impl_->h_sum,
                                               static_cast<cudaStream_t>(stream));
      e != cudaSuccess) {
    return CudaError(e, "payload checksum");
  }
  return *impl_->h_sum;
}

absl::Status NcclPeer::Send(const void* data, size_t bytes, void* stream, double timeout_s,
                            const Cancelled& cancelled) {
  return Transfer(true, const_cast<void*>(data), bytes, stream, timeout_s, cancelled);
}

absl::Status NcclPeer::Recv(void* data, size_t bytes, void* stream, double timeout_s,
                            const Cancelled& cancelled) {
  return Transfer(false, data, bytes, stream, timeout_s, cancelled);
}

std::string LocalHostId() {
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (f && std::getline(f, id) && !id.empty()) return absl::StrCat("boot:", id);
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return absl::StrCat("host:", host);
}

std::string CudaDeviceUuid(int device) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "";
  std::string out = "GPU-";
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    std::snprintf(hex, sizeof(hex), "%02x", static_cast<unsigned char>(prop.uuid.bytes[i]));
    out += hex;
  }
  return out;
}

}  // namespace draftfeed
