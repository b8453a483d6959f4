// A build without NCCL: a tensor-parallel group over distinct GPUs has no
// all-reduce (ranks sharing one GPU still sum with a kernel).
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/model/device_all_reduce.h"

namespace draftfeed {

absl::StatusOr<std::unique_ptr<DeviceAllReduce>> MakeNcclAllReduce(
    const std::vector<int>& devices) {
  return absl::UnimplementedError(absl::StrCat(
      "tensor parallelism over cuda:", absl::StrJoin(devices, ","),
      " sums through NCCL, and this build has none (configure with DRAFTFEED_ENABLE_NCCL=ON)"));
}

}  // namespace draftfeed
