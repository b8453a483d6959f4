// The NCCL transport: the target announces each batch with an empty chunk once
// its capture is ready and its ncclSend is waiting; the trainer posts the
// matching receive straight into GPU memory of FeedOptions::cuda_device.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "client/src/transport.h"

namespace draftfeed {

class HostBufferPool;

// NCCL (FeedOptions::Transport::kNccl), or NCCL with the targets where it
// works and gRPC (into `host_pool`) with the others (kAuto).
absl::StatusOr<std::unique_ptr<ClientTransports>> MakeNcclTransports(const FeedOptions& options,
                                                                     HostBufferPool* host_pool);

}  // namespace draftfeed
