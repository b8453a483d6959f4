#include "server/service/transport_registry.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/service/transports/grpc/grpc_stream_transport.h"
#include "server/service/transports/nccl/nccl_hosts_rule.h"
#if DRAFTFEED_HAVE_NCCL
#include "server/service/transports/nccl/nccl_stream_transport.h"
#endif

namespace draftfeed {

namespace {

// Empty when NCCL can carry `open`'s stream (with `open` null: when this
// target offers NCCL); otherwise why not.
std::string WhyNotNccl(const TransportEnv& env, const v1::Open* open) {
#if DRAFTFEED_HAVE_NCCL
  return NcclUnavailableReason(env, open);
#else
  return "this target was built without NCCL";
#endif
}

}  // namespace

std::vector<v1::Transport> OfferedTransports(const TransportEnv& env) {
  std::vector<v1::Transport> offered = {v1::TRANSPORT_GRPC};
  if (WhyNotNccl(env, nullptr).empty()) offered.push_back(v1::TRANSPORT_NCCL);
  return offered;
}

bool OffersNcclAcrossHosts(const TransportEnv& env) {
  return env.nccl_across_hosts && WhyNotNccl(env, nullptr).empty();
}

std::string SummarizeTransports(const TransportEnv& env) {
  if (!WhyNotNccl(env, nullptr).empty()) return "transport grpc";
  return env.nccl_across_hosts ? "transports grpc,nccl (nccl across hosts)"
                               : "transports grpc,nccl (nccl on this host only)";
}

std::string DescribeNcclTransport(const TransportEnv& env) {
  return DescribeNcclOffer(env, WhyNotNccl(env, nullptr));
}

absl::Status CheckTransportKnown(v1::Transport transport) {
  switch (transport) {
    case v1::TRANSPORT_UNSPECIFIED:
    case v1::TRANSPORT_GRPC:
    case v1::TRANSPORT_AUTO:
    case v1::TRANSPORT_NCCL:
      return absl::OkStatus();
    default:
      return absl::UnimplementedError(
          absl::StrCat("unknown transport value ", static_cast<int>(transport)));
  }
}

absl::StatusOr<std::unique_ptr<StreamTransport>> OpenStreamTransport(
    const TransportEnv& env, const v1::Open& open,
    [[maybe_unused]] std::shared_ptr<StreamLink> link) {  // unused without NCCL
  if (open.transport() != v1::TRANSPORT_NCCL && open.transport() != v1::TRANSPORT_AUTO) {
    return MakeGrpcStreamTransport(env, "");
  }
  const bool asked_nccl = open.transport() == v1::TRANSPORT_NCCL;
  const std::string why_not = WhyNotNccl(env, &open);
#if DRAFTFEED_HAVE_NCCL
  if (why_not.empty()) {
    return MakeNcclStreamTransport(env, open, std::move(link),
                                   asked_nccl ? nullptr : MakeGrpcStreamTransport(env, ""));
  }
#endif
  if (asked_nccl) {
    return absl::FailedPreconditionError(absl::StrCat(
        "transport nccl refused: ", why_not, ". Use transport=auto to fall back to grpc."));
  }
  return MakeGrpcStreamTransport(env, absl::StrCat("auto chose grpc: ", why_not));
}

}  // namespace draftfeed
