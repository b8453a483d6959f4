#include "common/nccl/nccl_peer.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/strings/str_cat.h"
#include "common/cuda_status.h"
#include "common/nccl_hosts.h"
#include "common/payload_checksum.h"
#include "common/status_macros.h"
#include "kernels/checksum.cuh"

namespace draftfeed {

namespace {

using Clock = std::chrono::steady_clock;

absl::Status NcclError(ncclResult_t r, const char* what) {
  return absl::InternalError(absl::StrCat("nccl ", what, ": ", ncclGetErrorString(r)));
}

// Poll's `done` for an event: true once it has completed.
std::function<absl::StatusOr<bool>()> EventDone(cudaEvent_t event, const char* waiting_for) {
  return [event, waiting_for]() -> absl::StatusOr<bool> {
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaErrorNotReady) return false;
    if (q != cudaSuccess) return CudaError(q, waiting_for);
    return true;
  };
}

}  // namespace

struct NcclPeer::Impl {
  // Set-up runs on `comm`, nonblocking, so every wait in it can time out and
  // abort. Once the peers have shaken hands, transfers run on `data`, a
  // blocking child of it: a nonblocking communicator hands each send or
  // receive to a thread it starts for the purpose, which cost a third of a
  // 64 MiB transfer (docs/performance.md, "Figures behind the code's choices").
  // After the handshake a post never waits for the other side, so blocking
  // costs nothing there, and the waits for completion still poll events.
  ncclComm_t comm = nullptr;
  ncclComm_t data = nullptr;
  int rank = 0;
  void* handshake = nullptr;  // device scratch of kHandshakeBytes
  mutable std::mutex mu;      // Abort may come from another thread
  bool aborted = false;
  std::string timeout_hint;  // under mu
  std::atomic<bool> handshaking{false};
  // One slot per op in flight: its completion event and checksum words.
  cudaEvent_t done[kMaxOps] = {};
  // A send's checksum runs on a stream of its own, beside the send (both
  // only read the payload, and NVLink leaves HBM bandwidth to spare), instead
  // of ahead of it: `ready` forks it off the caller's stream, `summed` joins.
  cudaStream_t sum_stream = nullptr;
  cudaEvent_t ready[kMaxOps] = {};
  cudaEvent_t summed[kMaxOps] = {};
  // The checksum's lane sums of each slot: [kMaxOps][kChecksumLanes].
  unsigned long long* d_sum = nullptr;  // device scratch
  uint64_t* h_sum = nullptr;            // pinned
  int next_slot = 0;
  int in_flight = 0;
  // DRAFTFEED_NCCL_TRACE=1: one stderr line per op with where its time went
  // (host: the NCCL call, the enqueue poll, the completion wait; GPU: the op
  // on its stream, from launch to end, including any wait for the peer).
  bool trace = false;
  cudaEvent_t op_begin[kMaxOps] = {};
  cudaEvent_t op_end[kMaxOps] = {};
  std::chrono::steady_clock::time_point entered[kMaxOps], called[kMaxOps], posted[kMaxOps];
  ~Impl();
};

absl::StatusOr<std::string> NcclPeer::NewUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return NcclError(r, absl::StrCat("ncclGetUniqueId (is there a network interface NCCL can use? ",
                                     DescribeNcclSocketIfname(), ")")
                            .c_str());
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclPeer>> NcclPeer::Start(const std::string& unique_id, int rank,
                                                          int device, std::string timeout_hint) {
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
  // `ready` and `done` bracket each op on its stream and are timed (WaitOp's gpu_ms).
  for (cudaEvent_t* events : {impl->done, impl->ready, impl->summed}) {
    for (int i = 0; i < kMaxOps; ++i) {
      const unsigned flags = events == impl->summed ? cudaEventDisableTiming : cudaEventDefault;
      if (cudaError_t e = cudaEventCreateWithFlags(&events[i], flags); e != cudaSuccess) {
        return CudaError(e, "cudaEventCreate");
      }
    }
  }
  impl->trace = std::getenv("DRAFTFEED_NCCL_TRACE") != nullptr;
  for (int i = 0; impl->trace && i < kMaxOps; ++i) {
    if (cudaEventCreate(&impl->op_begin[i]) != cudaSuccess ||
        cudaEventCreate(&impl->op_end[i]) != cudaSuccess) {
      return absl::InternalError("cudaEventCreate (trace)");
    }
  }
  if (cudaError_t e = cudaStreamCreateWithFlags(&impl->sum_stream, cudaStreamNonBlocking);
      e != cudaSuccess) {
    return CudaError(e, "cudaStreamCreate");
  }
  const size_t lanes = kMaxOps * v1::kChecksumLanes;
  if (cudaError_t e = cudaMalloc(&impl->d_sum, lanes * sizeof(*impl->d_sum)); e != cudaSuccess) {
    return CudaError(e, "cudaMalloc");
  }
  if (cudaError_t e = cudaMallocHost(&impl->h_sum, lanes * sizeof(*impl->h_sum));
      e != cudaSuccess) {
    return CudaError(e, "cudaMallocHost");
  }
  if (cudaError_t e = cudaMalloc(&impl->handshake, kHandshakeBytes); e != cudaSuccess) {
    return CudaError(e, "cudaMalloc");
  }
  impl->rank = rank;
  impl->timeout_hint = std::move(timeout_hint);
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
  if (!aborted) {
    if (data != nullptr) ncclCommAbort(data);
    if (comm != nullptr) ncclCommAbort(comm);
  }
  for (cudaEvent_t* events : {done, ready, summed, op_begin, op_end}) {
    for (int i = 0; i < kMaxOps; ++i) {
      if (events[i] != nullptr) cudaEventDestroy(events[i]);
    }
  }
  if (sum_stream != nullptr) cudaStreamDestroy(sum_stream);
  if (handshake != nullptr) cudaFree(handshake);
  if (d_sum != nullptr) cudaFree(d_sum);
  if (h_sum != nullptr) cudaFreeHost(h_sum);
}

void NcclPeer::Abort() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->aborted || impl_->comm == nullptr) return;
  impl_->aborted = true;
  if (impl_->data != nullptr) ncclCommAbort(impl_->data);
  ncclCommAbort(impl_->comm);
  impl_->data = nullptr;
  impl_->comm = nullptr;
}

void NcclPeer::SetTimeoutHint(std::string hint) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->timeout_hint = std::move(hint);
}

absl::Status NcclPeer::AbortWith(absl::Status why) {
  // A log line: a failed wait means the peer vanished, hung or broke.
  std::fprintf(stderr, "draftfeed: aborting the nccl communicator on cuda:%d: %s\n", device_,
               std::string(why.message()).c_str());
  Abort();
  return why;
}

absl::Status NcclPeer::Poll(const char* what, const std::function<absl::StatusOr<bool>()>& done,
                            double timeout_s, const Cancelled& cancelled) {
  // The handshake's waits (its transfers, the split) fail as the handshake.
  if (impl_->handshaking.load()) what = "handshake";
  const auto start = Clock::now();
  const auto deadline =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  for (;;) {
    if (done) {
      absl::StatusOr<bool> finished = done();
      if (!finished.ok()) return finished.status();
      if (*finished) return absl::OkStatus();
    }
    ncclResult_t async = ncclSuccess;
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      if (impl_->aborted) return absl::AbortedError("nccl communicator was aborted");
      if (ncclResult_t r = ncclCommGetAsyncError(impl_->comm, &async); r != ncclSuccess) async = r;
      if (impl_->data != nullptr && async == ncclSuccess) {
        if (ncclResult_t r = ncclCommGetAsyncError(impl_->data, &async); r != ncclSuccess) {
          async = r;
        }
      }
    }
    if (!done && async == ncclSuccess) return absl::OkStatus();
    if (async != ncclSuccess && async != ncclInProgress) return AbortWith(NcclError(async, what));
    if (cancelled && cancelled()) {
      return AbortWith(absl::CancelledError(
          absl::StrCat("nccl ", what, " cancelled: the other side went away")));
    }
    const auto now = Clock::now();
    if (now > deadline) {
      std::string hint;
      {
        std::lock_guard<std::mutex> lock(impl_->mu);
        hint = impl_->timeout_hint;
      }
      return AbortWith(absl::DeadlineExceededError(
          absl::StrCat("nccl ", what, " timed out after ", timeout_s,
                       " s: ", hint.empty() ? "the other process never joined or stopped" : hint,
                       "; the communicator was aborted")));
    }
    // Spin (yielding) for the first 2 ms: a transfer of tens of MiB takes a
    // fraction of that over NVLink, and a sleep's wake-up would dominate.
    if (now - start < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

absl::Status NcclPeer::Wait(double timeout_s, const Cancelled& cancelled) {
  return Poll("setup", nullptr, timeout_s, cancelled);
}

absl::Status NcclPeer::Exchange(double timeout_s, const Cancelled& cancelled) {
  cudaStream_t stream = impl_->sum_stream;
  const bool sender = impl_->rank == kSenderRank;
  cudaError_t e =
      cudaMemsetAsync(impl_->handshake, sender ? kHandshakeByte : 0, kHandshakeBytes, stream);
  if (e != cudaSuccess) return CudaError(e, "cudaMemsetAsync");
  absl::StatusOr<uint64_t> sum =
      sender ? Send(impl_->handshake, kHandshakeBytes, stream, timeout_s, cancelled)
             : Recv(impl_->handshake, kHandshakeBytes, stream, timeout_s, cancelled);
  if (!sum.ok()) return sum.status();
  unsigned char want[kHandshakeBytes];
  std::memset(want, kHandshakeByte, sizeof want);
  if (*sum != v1::PayloadChecksum(want, sizeof want)) {
    return AbortWith(absl::DataLossError(
        "nccl handshake: the bytes that arrived are not the bytes sent (checksum mismatch)"));
  }
  return absl::OkStatus();
}

absl::Status NcclPeer::Handshake(double timeout_s, const Cancelled& cancelled) {
  impl_->handshaking = true;
  absl::Status shook = ShakeHands(timeout_s, cancelled);
  impl_->handshaking = false;
  return shook;
}

absl::Status NcclPeer::ShakeHands(double timeout_s, const Cancelled& cancelled) {
  // First on the set-up communicator, where a peer that is gone or stuck
  // costs a timeout: after it, both sides are known to be here and talking.
  DF_RETURN_IF_ERROR(Exchange(timeout_s, cancelled));
  ncclResult_t split = ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->aborted) return absl::AbortedError("nccl communicator was aborted");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    config.splitShare = 1;  // the child reuses the parent's buffers: no more GPU memory
    split = ncclCommSplit(impl_->comm, 0, impl_->rank, &impl_->data, &config);
    if (split != ncclSuccess && split != ncclInProgress) impl_->data = nullptr;
  }
  // Outside the lock: AbortWith takes it.
  if (split != ncclSuccess && split != ncclInProgress) {
    return AbortWith(NcclError(split, "ncclCommSplit (the data communicator)"));
  }
  // The split is finished when neither communicator is busy any more.
  DF_RETURN_IF_ERROR(Poll("split", nullptr, timeout_s, cancelled));
  // Then the same on the data communicator, which connects its two GPUs (a
  // blocking post waits there for the other side's, which is right behind).
  return Exchange(timeout_s, cancelled);
}

absl::Status NcclPeer::WaitReady(const Op& op, double timeout_s, const Cancelled& cancelled) {
  return Poll("wait for the payload",
              EventDone(impl_->ready[op.slot], "waiting for the work before an nccl transfer"),
              timeout_s, cancelled);
}

absl::StatusOr<NcclPeer::Op> NcclPeer::Post(bool send, void* data, size_t bytes, void* stream_ptr,
                                            double timeout_s, const Cancelled& cancelled) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  Op op;
  bool blocking = false;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->aborted) return absl::AbortedError("nccl communicator was aborted");
    if (impl_->in_flight >= kMaxOps) {
      return absl::ResourceExhaustedError(
          absl::StrCat("more than ", kMaxOps, " nccl transfers in flight on one stream"));
    }
    op = Op{impl_->next_slot, bytes};
    if (impl_->trace) impl_->entered[op.slot] = std::chrono::steady_clock::now();
    // The sender checksums what it is about to send; the receiver what arrived.
    cudaError_t e = cudaEventRecord(impl_->ready[op.slot], stream);
    if (e != cudaSuccess) return CudaError(e, "cudaEventRecord");
    if (send) {
      e = cudaStreamWaitEvent(impl_->sum_stream, impl_->ready[op.slot], 0);
      if (e == cudaSuccess) {
        e = cuda::EnqueuePayloadLanes(data, bytes, impl_->d_sum + op.slot * v1::kChecksumLanes,
                                      impl_->h_sum + op.slot * v1::kChecksumLanes,
                                      impl_->sum_stream);
      }
      if (e == cudaSuccess) e = cudaEventRecord(impl_->summed[op.slot], impl_->sum_stream);
      if (e != cudaSuccess) return CudaError(e, "payload checksum");
    }
    const int peer = send ? kReceiverRank : kSenderRank;
    blocking = impl_->data != nullptr;
    ncclComm_t comm = blocking ? impl_->data : impl_->comm;
    if (impl_->trace) cudaEventRecord(impl_->op_begin[op.slot], stream);
    const ncclResult_t r = send ? ncclSend(data, bytes, ncclUint8, peer, comm, stream)
                                : ncclRecv(data, bytes, ncclUint8, peer, comm, stream);
    if (r != ncclSuccess && r != ncclInProgress) {
      return NcclError(r, send ? "ncclSend" : "ncclRecv");
    }
    if (impl_->trace) impl_->called[op.slot] = std::chrono::steady_clock::now();
  }
  // The set-up communicator may still be enqueueing (its first transfer also
  // connects the two GPUs, which needs the other side): poll, so that a peer
  // that never posts its half costs a timeout, not a stuck thread.
  if (!blocking) {
    DF_RETURN_IF_ERROR(Wait(timeout_s, cancelled));
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->aborted) return absl::AbortedError("nccl communicator was aborted");
  if (impl_->trace) {
    impl_->posted[op.slot] = std::chrono::steady_clock::now();
    cudaEventRecord(impl_->op_end[op.slot], stream);
  }
  if (!send) {
    if (cudaError_t e =
            cuda::EnqueuePayloadLanes(data, bytes, impl_->d_sum + op.slot * v1::kChecksumLanes,
                                      impl_->h_sum + op.slot * v1::kChecksumLanes, stream);
        e != cudaSuccess) {
      return CudaError(e, "payload checksum");
    }
  }
  if (send) {
    // The op is done when both the send and its checksum are.
    if (cudaError_t e = cudaStreamWaitEvent(stream, impl_->summed[op.slot], 0); e != cudaSuccess) {
      return CudaError(e, "cudaStreamWaitEvent");
    }
  }
  if (cudaError_t e = cudaEventRecord(impl_->done[op.slot], stream); e != cudaSuccess) {
    return CudaError(e, "cudaEventRecord");
  }
  impl_->next_slot = (impl_->next_slot + 1) % kMaxOps;
  ++impl_->in_flight;
  return op;
}

absl::StatusOr<NcclPeer::Op> NcclPeer::PostSend(const void* data, size_t bytes, void* stream,
                                                double timeout_s, const Cancelled& cancelled) {
  return Post(true, const_cast<void*>(data), bytes, stream, timeout_s, cancelled);
}

absl::StatusOr<NcclPeer::Op> NcclPeer::PostRecv(void* data, size_t bytes, void* stream,
                                                double timeout_s, const Cancelled& cancelled) {
  return Post(false, data, bytes, stream, timeout_s, cancelled);
}

absl::StatusOr<uint64_t> NcclPeer::WaitOp(const Op& op, double timeout_s,
                                          const Cancelled& cancelled, double* gpu_ms) {
  absl::Status s = Poll("transfer", EventDone(impl_->done[op.slot], "waiting for an nccl transfer"),
                        timeout_s, cancelled);
  if (!s.ok()) return s;
  std::lock_guard<std::mutex> lock(impl_->mu);
  --impl_->in_flight;
  if (gpu_ms != nullptr) {
    float ms = 0;
    *gpu_ms = cudaEventElapsedTime(&ms, impl_->ready[op.slot], impl_->done[op.slot]) == cudaSuccess
                  ? ms
                  : 0;
  }
  if (impl_->trace) {
    auto us = [](auto a, auto b) {
      return std::chrono::duration<double, std::micro>(b - a).count();
    };
    float gpu_ms = 0;
    cudaEventElapsedTime(&gpu_ms, impl_->op_begin[op.slot], impl_->op_end[op.slot]);
    const int i = op.slot;
    std::fprintf(stderr,
                 "draftfeed nccl trace cuda:%d %.1f MiB: call %.0f us, enqueue poll %.0f us, "
                 "completion wait %.0f us (host %.0f us); on the GPU %.0f us\n",
                 device_, op.bytes / 1048576.0, us(impl_->entered[i], impl_->called[i]),
                 us(impl_->called[i], impl_->posted[i]),
                 us(impl_->posted[i], std::chrono::steady_clock::now()),
                 us(impl_->entered[i], std::chrono::steady_clock::now()), gpu_ms * 1000);
  }
  return v1::FinishPayloadChecksum(impl_->h_sum + op.slot * v1::kChecksumLanes, op.bytes);
}

absl::StatusOr<uint64_t> NcclPeer::Send(const void* data, size_t bytes, void* stream,
                                        double timeout_s, const Cancelled& cancelled,
                                        double* gpu_ms) {
  auto op = PostSend(data, bytes, stream, timeout_s, cancelled);
  if (!op.ok()) return op.status();
  return WaitOp(*op, timeout_s, cancelled, gpu_ms);
}

absl::StatusOr<uint64_t> NcclPeer::Recv(void* data, size_t bytes, void* stream, double timeout_s,
                                        const Cancelled& cancelled, double* gpu_ms) {
  auto op = PostRecv(data, bytes, stream, timeout_s, cancelled);
  if (!op.ok()) return op.status();
  return WaitOp(*op, timeout_s, cancelled, gpu_ms);
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
