// The gRPC transport: the payload travels in the stream's HiddenChunks and is
// copied (and hashed, in the same pass) from gRPC's slices into the batch's
// buffer in host memory.
#pragma once

#include <memory>

#include "client/src/transport.h"

namespace draftfeed {

class HostBufferPool;

std::unique_ptr<ClientTransports> MakeGrpcTransports(HostBufferPool* host_pool);
// For an offer of another transport that the target turned down.
std::unique_ptr<TransportOffer> MakeGrpcOffer(HostBufferPool* host_pool, v1::Open* open);

}  // namespace draftfeed
