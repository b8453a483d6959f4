// The one place the feed's transport is chosen (FeedOptions::transport).
#include "absl/status/status.h"
#include "client/src/grpc_transport.h"
#include "client/src/transport.h"
#if DRAFTFEED_HAVE_NCCL
#include "client/src/nccl_transport.h"
#endif

namespace draftfeed {

absl::StatusOr<std::unique_ptr<ClientTransports>> MakeClientTransports(const FeedOptions& options,
                                                                       HostBufferPool* host_pool) {
  switch (options.transport) {
    case Transport::kGrpc:
      return MakeGrpcTransports(host_pool);
    case Transport::kNccl:
    case Transport::kAuto:
#if DRAFTFEED_HAVE_NCCL
      return MakeNcclTransports(options, host_pool);
#else
      return absl::UnimplementedError(
          "this client was built without NCCL (DRAFTFEED_ENABLE_NCCL=OFF): use transport grpc");
#endif
  }
  return absl::InvalidArgumentError("FeedOptions.transport is not a Transport");
}

}  // namespace draftfeed
