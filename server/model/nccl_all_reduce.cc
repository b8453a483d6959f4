// NCCL's all-reduce for a tensor-parallel group in one process: one
// communicator per rank (ncclCommInitAll), each used by its rank's thread on
// its compute stream, so the sums run on NVLink (or PCIe) at NCCL's speed.
#include <nccl.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/model/device_all_reduce.h"

namespace draftfeed {
namespace {

absl::Status NcclStatus(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

class NcclAllReduce final : public DeviceAllReduce {
 public:
  explicit NcclAllReduce(std::vector<ncclComm_t> comms) : comms_(std::move(comms)) {}
  ~NcclAllReduce() override {
    for (ncclComm_t c : comms_) ncclCommDestroy(c);
  }
  absl::Status Sum(int rank, void* buffer, int64_t count, bool bf16_elements,
                   cudaStream_t stream) override {
    return NcclStatus(ncclAllReduce(buffer, buffer, static_cast<size_t>(count),
                                    bf16_elements ? ncclBfloat16 : ncclFloat32, ncclSum,
                                    comms_[static_cast<size_t>(rank)], stream),
                      "ncclAllReduce");
  }
  int ranks() const override { return static_cast<int>(comms_.size()); }
  const char* kind() const override { return "nccl"; }

 private:
  std::vector<ncclComm_t> comms_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceAllReduce>> MakeNcclAllReduce(
    const std::vector<int>& devices) {
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  const ncclResult_t r =
      ncclCommInitAll(comms.data(), static_cast<int>(devices.size()), devices.data());
  if (r != ncclSuccess) {
    return absl::InternalError(
        absl::StrCat("NCCL communicators over cuda:", absl::StrJoin(devices, ","),
                     " failed: ", ncclGetErrorString(r)));
  }
  return std::unique_ptr<DeviceAllReduce>(new NcclAllReduce(std::move(comms)));
}

}  // namespace draftfeed
