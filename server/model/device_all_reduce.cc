#include "server/model/device_all_reduce.h"

#include <algorithm>
#include <barrier>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/cuda_status.h"
#include "kernels/rank_sum.cuh"

namespace draftfeed {
namespace {

// Ranks that share one GPU, each on its own stream. Per Sum: every rank
// records `ready` after its partial; once all have (a host barrier orders
// the records before the waits), rank q's stream waits for every rank's
// partial and sums the q-th part of the elements of all buffers in rank
// order, writing the result into every buffer; `done` and a second barrier
// then make every rank's stream wait for all parts before it reads its
// buffer. Each element has one writer and a fixed order of addition, so the
// result does not depend on timing. The events are reused Sum after Sum:
// the barriers keep a record from overtaking waits on its previous record.
class OneDeviceAllReduce final : public DeviceAllReduce {
 public:
  explicit OneDeviceAllReduce(int ranks)
      : ranks_(ranks),
        barrier_(ranks),
        buffers_(static_cast<size_t>(ranks)),
        ready_(static_cast<size_t>(ranks)),
        done_(static_cast<size_t>(ranks)) {}
  ~OneDeviceAllReduce() override {
    for (cudaEvent_t e : ready_) {
      if (e) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : done_) {
      if (e) cudaEventDestroy(e);
    }
  }
  absl::Status Init() {
    for (size_t r = 0; r < ready_.size(); ++r) {
      DF_CUDA(cudaEventCreateWithFlags(&ready_[r], cudaEventDisableTiming));
      DF_CUDA(cudaEventCreateWithFlags(&done_[r], cudaEventDisableTiming));
    }
    return absl::OkStatus();
  }

  absl::Status Sum(int rank, void* buffer, int64_t count, bool bf16_elements,
                   cudaStream_t stream) override {
    const size_t me = static_cast<size_t>(rank);
    buffers_[me] = buffer;
    cudaError_t e = cudaEventRecord(ready_[me], stream);
    barrier_.arrive_and_wait();
    for (int q = 0; q < ranks_ && e == cudaSuccess; ++q) {
      if (q != rank) e = cudaStreamWaitEvent(stream, ready_[static_cast<size_t>(q)], 0);
    }
    if (e == cudaSuccess) {
      e = cuda::SumRanks(buffers_.data(), ranks_, bf16_elements, count * rank / ranks_,
                         count * (rank + 1) / ranks_, stream);
    }
    if (e == cudaSuccess) e = cudaEventRecord(done_[me], stream);
    barrier_.arrive_and_wait();
    for (int q = 0; q < ranks_ && e == cudaSuccess; ++q) {
      if (q != rank) e = cudaStreamWaitEvent(stream, done_[static_cast<size_t>(q)], 0);
    }
    // Every rank passes both barriers even on an error, so none is left
    // waiting; the error surfaces from this rank's forward.
    return CudaStatus(e, "one-device all-reduce");
  }
  int ranks() const override { return ranks_; }
  const char* kind() const override { return "one-device kernel"; }

 private:
  const int ranks_;
  std::barrier<> barrier_;
  std::vector<void*> buffers_;
  std::vector<cudaEvent_t> ready_, done_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceAllReduce>> MakeDeviceAllReduce(
    const std::vector<int>& devices) {
  if (devices.empty()) return absl::InvalidArgumentError("a tensor-parallel group needs a device");
  if (devices.size() == 1) return std::unique_ptr<DeviceAllReduce>();
  const std::set<int> distinct(devices.begin(), devices.end());
  if (distinct.size() == 1) {
    if (devices.size() > static_cast<size_t>(cuda::kMaxRankSumRanks)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "at most ", cuda::kMaxRankSumRanks, " ranks may share one GPU; got ", devices.size()));
    }
    DF_CUDA(cudaSetDevice(devices.front()));
    auto reduce = std::make_unique<OneDeviceAllReduce>(static_cast<int>(devices.size()));
    if (absl::Status s = reduce->Init(); !s.ok()) return s;
    return std::unique_ptr<DeviceAllReduce>(std::move(reduce));
  }
  if (distinct.size() != devices.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor-parallel group on cuda:", absl::StrJoin(devices, ","),
        " lists a GPU twice beside others: NCCL takes one rank per GPU (all ranks on one GPU "
        "is allowed, for proving a plan)"));
  }
  return MakeNcclAllReduce(devices);
}

}  // namespace draftfeed
