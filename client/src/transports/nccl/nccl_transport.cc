#include "client/src/transports/nccl/nccl_transport.h"

#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/src/transports/grpc/grpc_transport.h"
#include "common/host_buffer_pool.h"
#include "common/nccl/nccl_peer.h"
#include "common/nccl_hosts.h"
#include "common/status_macros.h"
#include "common/thread_name.h"

namespace draftfeed {
namespace {

using Clock = std::chrono::steady_clock;

class NcclStreamTransport final : public StreamTransport {
 public:
  NcclStreamTransport(StreamSlot slot, std::unique_ptr<NcclPeer> peer, cudaStream_t stream,
                      HostBufferPool* device_pool, double timeout_s)
      : slot_(std::move(slot)),
        peer_(std::move(peer)),
        cuda_stream_(stream),
        device_pool_(device_pool),
        timeout_s_(timeout_s) {
    waiter_ = std::thread([this] {
      NameThisThread("df-nccl-recv");
      WaitLoop();
    });
  }
  ~NcclStreamTransport() override {
    Abort();
    peer_.reset();
    cudaStreamDestroy(cuda_stream_);
  }

  std::string_view name() const override { return "nccl"; }
  bool payload_in_stream() const override { return false; }

  // The target announced a batch whose capture is ready and whose send is
  // waiting: post the matching receive now (for every announcement, even of
  // a batch no longer wanted, or the two sides' operation order would part).
  bool OnChunk(const Chunk& c) override {
    cudaSetDevice(peer_->device());
    const ChunkHeader& h = c.header;
    if (h.token_offset != 0 || h.token_count < 1 || c.payload_bytes != 0) {
      slot_.sink->StreamBroken(slot_.stream,
                               absl::StrCat("malformed nccl announcement for batch ", h.batch_id),
                               /*cancel=*/false);
      return false;
    }
    const size_t bytes = static_cast<size_t>(h.token_count * slot_.bytes_per_token);
    absl::Status why;
    Posted posted{h, bytes, DeviceBufferFor(h.batch_id, bytes, &why), {}, std::nullopt};
    absl::StatusOr<NcclPeer::Op> op =
        posted.buffer == nullptr
            ? absl::StatusOr<NcclPeer::Op>(why)
            : peer_->PostRecv(posted.buffer.get(), bytes, cuda_stream_, timeout_s_,
                              [this] { return slot_.sink->Closing(); });
    if (!op.ok()) {
      slot_.sink->StreamBroken(slot_.stream, absl::StrCat("nccl receive: ", op.status().message()),
                               /*cancel=*/false);
      // Re-sending the batch would only fail the same way: it fails, with
      // why, and the stream ends (the target's send has no match).
      if (posted.buffer == nullptr) slot_.sink->FailBatch(slot_.stream, h.batch_id, op.status());
      return false;
    }
    posted.op = *op;
    std::shared_ptr<std::byte> buffer = posted.buffer;
    posted.landing = slot_.sink->Claim(slot_.stream, h, bytes, peer_->device(),
                                       [&buffer](size_t) { return buffer; });
    {
      std::lock_guard<std::mutex> lock(mu_);
      posted_.push_back(std::move(posted));
    }
    cv_.notify_one();
    return true;
  }

  void Abort() override {
    if (aborted_) return;
    aborted_ = true;
    // The stream is over: whatever was posted will never be matched.
    peer_->Abort();
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
    if (waiter_.joinable()) waiter_.join();
  }

 private:
  struct Posted {
    ChunkHeader header;
    size_t bytes = 0;
    std::shared_ptr<std::byte> buffer;
    NcclPeer::Op op;
    std::optional<BatchSink::Landing> landing;  // nullopt: a batch no longer wanted
  };

  // A GPU buffer for an announced batch. When the GPU is full (the drafter
  // fills it), it waits while the trainer still holds results, up to the
  // NCCL timeout; null, with why, when no memory came.
  std::shared_ptr<std::byte> DeviceBufferFor(uint64_t batch_id, size_t bytes, absl::Status* why) {
    std::shared_ptr<std::byte> buffer = device_pool_->Acquire(bytes);
    const auto give_up =
        Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000));
    while (buffer == nullptr && !slot_.sink->Closing() && device_pool_->live_bytes() > 0 &&
           Clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      buffer = device_pool_->Acquire(bytes);
    }
    if (buffer == nullptr) {
      *why = absl::ResourceExhaustedError(
          absl::StrCat("cannot allocate ", bytes, " bytes on cuda:", peer_->device(),
                       " to receive batch ", batch_id, " (the GPU is full; ",
                       device_pool_->live_bytes(), " bytes of earlier results are still held)"));
    }
    return buffer;
  }

  // Completes posted receives in order and lands each in its batch, so the
  // reader keeps reading BatchDone meanwhile.
  void WaitLoop() {
    cudaSetDevice(peer_->device());
    for (;;) {
      Posted r;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return closed_ || !posted_.empty(); });
        if (closed_) return;
        r = std::move(posted_.front());
        posted_.pop_front();
      }
      double recv_ms = 0;
      absl::StatusOr<uint64_t> sum = peer_->WaitOp(
          r.op, timeout_s_, [this] { return slot_.sink->Closing(); }, &recv_ms);
      if (!sum.ok()) {
        // The stream ends; its batches go elsewhere.
        slot_.sink->StreamBroken(slot_.stream,
                                 absl::StrCat("nccl receive: ", sum.status().message()),
                                 /*cancel=*/true);
        return;
      }
      slot_.sink->Landed(slot_.stream, r.header, r.bytes,
                         r.landing.has_value() ? &*r.landing : nullptr, /*ok=*/true, *sum, recv_ms);
    }
  }

  const StreamSlot slot_;
  std::unique_ptr<NcclPeer> peer_;
  cudaStream_t cuda_stream_;
  HostBufferPool* const device_pool_;
  const double timeout_s_;
  bool aborted_ = false;  // the reader thread's
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Posted> posted_;
  bool closed_ = false;
  std::thread waiter_;
};

class NcclOffer final : public TransportOffer {
 public:
  NcclOffer(std::string unique_id, int device, double timeout_s, double setup_timeout_s,
            HostBufferPool* host_pool, HostBufferPool* device_pool)
      : unique_id_(std::move(unique_id)),
        device_(device),
        timeout_s_(timeout_s),
        setup_timeout_s_(setup_timeout_s),
        host_pool_(host_pool),
        device_pool_(device_pool) {}

  // Join as rank 1 now: the target joins as rank 0 before it answers Opened.
  // Whether it is on this host is known from Opened; until then nothing
  // here waits.
  absl::Status Sent() override {
    auto started = NcclPeer::Start(unique_id_, NcclPeer::kReceiverRank, device_,
                                   NcclSetupHint(/*across_hosts=*/false, ""));
    if (!started.ok()) return started.status();
    peer_ = *std::move(started);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<StreamTransport>> Accept(const v1::Opened& opened,
                                                          StreamSlot slot) override {
    if (opened.transport() != v1::TRANSPORT_NCCL) {
      peer_->Abort();  // the target chose gRPC: leave the half-made communicator
      v1::Open unused;
      return MakeGrpcOffer(host_pool_, &unused)->Accept(opened, std::move(slot));
    }
    if (opened.nccl_across_hosts()) {
      peer_->SetTimeoutHint(NcclSetupHint(/*across_hosts=*/true, NcclUniqueIdAddress(unique_id_)));
    }
    absl::Status joined = peer_->Wait(setup_timeout_s_);
    if (joined.ok()) joined = peer_->Handshake(setup_timeout_s_);
    if (!joined.ok()) {
      return absl::UnavailableError(absl::StrCat("target ", slot.address, ": nccl setup",
                                                 opened.nccl_across_hosts() ? " across hosts" : "",
                                                 ": ", joined.message()));
    }
    // Receives are posted when the target's capture is ready, so the
    // trainer's GPU never holds one through a forward; the highest priority
    // gets the receive onto the GPU at once, beside the drafter's kernels.
    int lowest_priority = 0, highest_priority = 0;
    cudaDeviceGetStreamPriorityRange(&lowest_priority, &highest_priority);
    cudaStream_t stream = nullptr;
    if (cudaError_t e =
            cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, highest_priority);
        e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("cudaStreamCreate: ", cudaGetErrorString(e)));
    }
    return std::make_unique<NcclStreamTransport>(std::move(slot), std::move(peer_), stream,
                                                 device_pool_, timeout_s_);
  }

 private:
  const std::string unique_id_;
  const int device_;
  const double timeout_s_;
  const double setup_timeout_s_;
  HostBufferPool* const host_pool_;
  HostBufferPool* const device_pool_;
  std::unique_ptr<NcclPeer> peer_;
};

class NcclTransports final : public ClientTransports {
 public:
  NcclTransports(const FeedOptions& options, HostBufferPool* host_pool,
                 std::unique_ptr<HostBufferPool> device_pool)
      : required_(options.transport == Transport::kNccl),
        across_hosts_(options.nccl_across_hosts),
        device_(options.cuda_device),
        timeout_s_(options.nccl_timeout_s),
        setup_timeout_s_(options.nccl_setup_timeout_s),
        host_(LocalHost()),
        host_pool_(host_pool),
        device_pool_(std::move(device_pool)) {}

  absl::StatusOr<std::unique_ptr<TransportOffer>> Offer(const std::string& address,
                                                        v1::Open* open) override {
    auto id = NcclPeer::NewUniqueId();
    if (!id.ok()) {
      if (required_) return id.status();
      return MakeGrpcOffer(host_pool_, open);
    }
    open->set_transport(required_ ? v1::TRANSPORT_NCCL : v1::TRANSPORT_AUTO);
    open->set_nccl_unique_id(*id);
    open->set_nccl_across_hosts(across_hosts_);
    open->set_host_id(host_.id);
    open->set_host_name(host_.name);
    open->set_gpu_uuid(CudaDeviceUuid(device_));
    return std::make_unique<NcclOffer>(*std::move(id), device_, timeout_s_, setup_timeout_s_,
                                       host_pool_, device_pool_.get());
  }

  int64_t allocations() const override { return device_pool_->allocations(); }

 private:
  const bool required_;
  const bool across_hosts_;
  const int device_;
  const double timeout_s_;
  const double setup_timeout_s_;
  const HostIdentity host_;  // this trainer's, in every Open
  HostBufferPool* const host_pool_;
  std::unique_ptr<HostBufferPool> device_pool_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ClientTransports>> MakeNcclTransports(const FeedOptions& options,
                                                                     HostBufferPool* host_pool) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (options.cuda_device < 0 || options.cuda_device >= devices) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport ", options.transport == Transport::kNccl ? "nccl" : "auto",
                     " needs FeedOptions.cuda_device, the GPU that receives: got ",
                     options.cuda_device, "; this process sees ", devices, " CUDA device(s)"));
  }
  // Before this process's first NCCL call, which reads it.
  DF_RETURN_IF_ERROR(
      UseNcclSocketIfname(options.nccl_socket_ifname, "FeedOptions.nccl_socket_ifname"));
  const int device = options.cuda_device;
  HostAllocator on_gpu;
  // Buffers are released on whichever thread drops the last reference (the
  // trainer's): leave that thread's current device as it was.
  on_gpu.allocate = [device](size_t bytes) -> void* {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    void* p = nullptr;
    if (cudaMalloc(&p, bytes) != cudaSuccess) p = nullptr;
    cudaSetDevice(prev);
    return p;
  };
  on_gpu.release = [device](void* p) {
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device);
    cudaFree(p);
    cudaSetDevice(prev);
  };
  // Exact sizes on the GPU, and one buffer kept, since the drafter needs
  // that memory (on a full H200, two 49,152-token results fit exactly and
  // two size classes did not); the pool drops idle buffers when an
  // allocation fails.
  auto device_pool = std::make_unique<HostBufferPool>(
      2 * options.prefetch_bytes, on_gpu,
      HostBufferPool::Reuse{.size_classes = false, .keep_buffers = 1});
  return std::make_unique<NcclTransports>(options, host_pool, std::move(device_pool));
}

}  // namespace draftfeed
