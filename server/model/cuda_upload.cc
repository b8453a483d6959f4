#include "server/model/cuda_upload.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "common/cuda_status.h"

namespace draftfeed {
namespace {

// Pinned chunks, one stream per reader and one event per chunk.
class CudaStagingSink final : public StagingSink {
 public:
  explicit CudaStagingSink(int device) : device_(device) {}
  ~CudaStagingSink() override {
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    for (cudaStream_t s : streams_) {
      if (s != nullptr) cudaStreamDestroy(s);
    }
    if (pinned_ != nullptr) cudaFreeHost(pinned_);
  }

  absl::Status Prepare(int workers, int slots, size_t chunk_bytes) override {
    // The streams and events belong to device_; the caller's current device is left as it was.
    int caller = 0;
    DF_CUDA(cudaGetDevice(&caller));
    DF_CUDA(cudaSetDevice(device_));
    absl::Status s = Allocate(workers, slots, chunk_bytes);
    DF_CUDA(cudaSetDevice(caller));
    return s;
  }
  absl::Status StartWorker(int) override { return CudaStatus(cudaSetDevice(device_), "upload"); }
  std::byte* Buffer(int worker, int slot) override {
    return static_cast<std::byte*>(pinned_) +
           static_cast<size_t>(Index(worker, slot)) * chunk_bytes_;
  }
  absl::Status Reuse(int worker, int slot) override {
    const int i = Index(worker, slot);
    if (used_[static_cast<size_t>(i)] == 0) return absl::OkStatus();
    return CudaStatus(cudaEventSynchronize(events_[static_cast<size_t>(i)]),
                      "weight upload (waiting for a staged chunk's copy)");
  }
  absl::Status Consume(const StagedChunk& c) override {
    const int i = Index(c.worker, c.slot);
    cudaStream_t s = streams_[static_cast<size_t>(c.worker)];
    DF_CUDA(cudaMemcpyAsync(c.dst, c.staged, c.bytes, cudaMemcpyHostToDevice, s));
    DF_CUDA(cudaEventRecord(events_[static_cast<size_t>(i)], s));
    used_[static_cast<size_t>(i)] = 1;
    return absl::OkStatus();
  }
  absl::Status Finish(int worker) override {
    if (streams_.empty()) return absl::OkStatus();
    return CudaStatus(cudaStreamSynchronize(streams_[static_cast<size_t>(worker)]),
                      "weight upload");
  }

 private:
  absl::Status Allocate(int workers, int slots, size_t chunk_bytes) {
    slots_ = slots;
    chunk_bytes_ = chunk_bytes;
    DF_CUDA(cudaHostAlloc(&pinned_, static_cast<size_t>(workers * slots) * chunk_bytes,
                          cudaHostAllocPortable));
    streams_.assign(static_cast<size_t>(workers), nullptr);
    events_.assign(static_cast<size_t>(workers * slots), nullptr);
    used_.assign(static_cast<size_t>(workers * slots), 0);
    for (cudaStream_t& s : streams_) DF_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    for (cudaEvent_t& e : events_) DF_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return absl::OkStatus();
  }
  int Index(int worker, int slot) const { return worker * slots_ + slot; }

  int device_;
  int slots_ = 1;
  size_t chunk_bytes_ = 0;
  void* pinned_ = nullptr;
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> events_;
  std::vector<char>
      used_;  // per buffer: a copy out of it was enqueued (each written by its worker only)
};

constexpr double kGB = 1e9;
constexpr uint64_t kReportBytes = uint64_t{1} << 30;

}  // namespace

StagedCopy Bf16Copy(const Tensor& t, void* dst) {
  const size_t bytes = static_cast<size_t>(t.numel()) * 2;
  if (t.dtype == DType::kBF16) return {.src = t.data, .bytes = bytes, .dst = dst};
  return ComputedCopy(bytes, dst, [&t] {
    const std::vector<float> f = ToFloat(t);
    std::vector<std::byte> h(f.size() * 2);
    for (size_t i = 0; i < f.size(); ++i) {
      const uint16_t v = FloatToBf16(f[i]);
      std::memcpy(h.data() + 2 * i, &v, 2);
    }
    return h;
  });
}

absl::StatusOr<StagedReadStats> UploadToDevice(
    std::span<const StagedCopy> copies, std::span<const std::shared_ptr<const MappedFile>> files,
    int device, StagedReadOptions options, const std::string& what) {
  if (!options.progress) {
    options.progress = [what](const StagedReadProgress& p) {
      std::fprintf(stderr, "draftfeed: %s: weights %.2f of %.2f GB on the device (%.2f GB/s)\n",
                   what.c_str(), p.bytes_done / kGB, p.bytes_total / kGB,
                   p.seconds > 0 ? p.bytes_done / kGB / p.seconds : 0.0);
    };
  }
  CudaStagingSink sink(device);
  absl::StatusOr<StagedReadStats> stats = StageParallel(copies, files, options, sink);
  if (stats.ok() && stats->bytes >= kReportBytes) {
    std::fprintf(stderr,
                 "draftfeed: %s: weights %.2f GB uploaded in %.2f s (%.2f GB/s; %.2f GB read "
                 "from the checkpoint files with %d threads, %zu chunks)\n",
                 what.c_str(), stats->bytes / kGB, stats->seconds,
                 stats->seconds > 0 ? stats->bytes / kGB / stats->seconds : 0.0,
                 stats->file_bytes / kGB, stats->threads, stats->chunks);
  }
  return stats;
}

}  // namespace draftfeed
