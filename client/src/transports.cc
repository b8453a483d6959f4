// The one place the feed's transport is chosen (FeedOptions::transport).
#include <cmath>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "client/src/transport.h"
#include "client/src/transports/grpc/grpc_transport.h"
#include "common/nccl_hosts.h"
#if DRAFTFEED_HAVE_NCCL
#include "client/src/transports/nccl/nccl_transport.h"
#endif

namespace draftfeed {

namespace {

// The NCCL options, in every build (a build without NCCL refuses the
// transport itself below): INVALID_ARGUMENT naming the field.
absl::Status CheckNcclOptions(const FeedOptions& options) {
  for (auto [name, value] :
       {std::pair<absl::string_view, double>{"nccl_timeout_s", options.nccl_timeout_s},
        {"nccl_setup_timeout_s", options.nccl_setup_timeout_s}}) {
    if (!(value > 0 && std::isfinite(value))) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FeedOptions.", name, " must be a finite number of seconds > 0, got ", value));
    }
  }
  if (options.transport == Transport::kGrpc) {
    // Set with gRPC, they mean the trainer thinks NCCL carries its results.
    if (options.nccl_across_hosts) {
      return absl::InvalidArgumentError(
          "FeedOptions.nccl_across_hosts is set but FeedOptions.transport is grpc: it lets "
          "transport auto use NCCL with targets on other hosts (transport nccl crosses hosts "
          "unasked)");
    }
    if (!options.nccl_socket_ifname.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FeedOptions.nccl_socket_ifname=", options.nccl_socket_ifname,
          " is set but FeedOptions.transport is grpc: it picks NCCL's network interface"));
    }
  }
  return CheckNcclSocketIfname(options.nccl_socket_ifname, "FeedOptions.nccl_socket_ifname");
}

}  // namespace

absl::StatusOr<std::unique_ptr<ClientTransports>> MakeClientTransports(const FeedOptions& options,
                                                                       HostBufferPool* host_pool) {
  if (absl::Status s = CheckNcclOptions(options); !s.ok()) return s;
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
