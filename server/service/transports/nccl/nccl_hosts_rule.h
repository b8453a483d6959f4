// Whether the NCCL transport may carry a stream as far as hosts go: the one
// rule both the NCCL build and the tests of every build run. A trainer on
// this target's host may always use NCCL (the GPU checks are elsewhere); one
// on another host may when this target accepts cross-host NCCL
// (--nccl_across_hosts) and the trainer asked for NCCL by name, or asked for
// auto with Open.nccl_across_hosts.
#pragma once

#include <string>

#include "draftfeed/v1/draftfeed.pb.h"
#include "server/service/stream_transport.h"

namespace draftfeed {

// Whether `open`'s trainer runs on another host than the target of `env`
// (true too for a trainer that did not say which: an older client).
bool NcclAcrossHosts(const TransportEnv& env, const v1::Open& open);

// Empty when NCCL may carry `open`'s stream (transport NCCL or AUTO) as far
// as hosts go; otherwise why not, naming both hosts and what would allow it.
std::string NcclHostsRefusal(const TransportEnv& env, const v1::Open& open);

// What Opened.transport_note says of an NCCL stream: that it crosses hosts
// (and which), or nothing on one host.
std::string NcclHostsNote(const TransportEnv& env, const v1::Open& open);

// The start-up line's and the docs' account of this target's NCCL offer:
// `why_not` empty when it offers NCCL at all.
std::string DescribeNcclOffer(const TransportEnv& env, const std::string& why_not);

}  // namespace draftfeed
