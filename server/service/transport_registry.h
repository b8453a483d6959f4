// The one place that knows which transports exist: what this build and this
// target offer (TargetInfo.transports), and which transport carries a stream
// by its Open (transport=grpc, nccl, or auto: NCCL when it can, else gRPC).
// A new transport is its own file pair behind StreamTransport plus its lines
// here.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "draftfeed/v1/draftfeed.pb.h"
#include "server/service/stream_transport.h"

namespace draftfeed {

std::vector<v1::Transport> OfferedTransports(const TransportEnv& env);
// TargetInfo.nccl_across_hosts: NCCL is offered, to trainers on other hosts too.
bool OffersNcclAcrossHosts(const TransportEnv& env);
// The serving line's transports: "transports grpc,nccl (nccl across hosts)",
// "… (nccl on this host only)" or "transport grpc".
std::string SummarizeTransports(const TransportEnv& env);
// The start-up line after it: NCCL offered (to which hosts, on which
// interface, with which timeouts) or why not.
std::string DescribeNcclTransport(const TransportEnv& env);

// UNIMPLEMENTED for a transport value this version does not know.
absl::Status CheckTransportKnown(v1::Transport transport);

// The transport for a stream opened with `open` (its value already known);
// FAILED_PRECONDITION when transport=nccl was asked and cannot be served.
absl::StatusOr<std::unique_ptr<StreamTransport>> OpenStreamTransport(
    const TransportEnv& env, const v1::Open& open, std::shared_ptr<StreamLink> link);

}  // namespace draftfeed
