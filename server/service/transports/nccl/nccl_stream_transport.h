// TRANSPORT_NCCL: the trainer's GPU receives each capture straight from the
// target's GPU over a 2-rank NCCL communicator set up from the ncclUniqueId
// in Open; the stream carries only an announcement per batch (a HiddenChunk
// without data) and its BatchDone. Built only with NCCL (DRAFTFEED_HAVE_NCCL);
// transport_registry.cc is the one caller.
#pragma once

#include <memory>
#include <string>

#include "draftfeed/v1/draftfeed.pb.h"
#include "server/service/stream_transport.h"

namespace draftfeed {

// Empty when this target can carry `open`'s stream by NCCL; otherwise why
// not. With `open` null: whether it offers NCCL at all (TargetInfo).
std::string NcclUnavailableReason(const TransportEnv& env, const v1::Open* open);

// Joins the trainer's communicator on a thread of its own once started.
// `fallback` (transport=auto) carries the stream instead when that fails;
// without one (transport=nccl) the failure ends the stream.
std::unique_ptr<StreamTransport> MakeNcclStreamTransport(const TransportEnv& env,
                                                         const v1::Open& open,
                                                         std::shared_ptr<StreamLink> link,
                                                         std::unique_ptr<StreamTransport> fallback);

}  // namespace draftfeed
