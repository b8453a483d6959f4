// TRANSPORT_GRPC: captures travel on the stream itself, as HiddenChunk
// messages written from the host capture buffer (chunk_writer.h).
#pragma once

#include <memory>
#include <string>

#include "server/service/stream_transport.h"

namespace draftfeed {

// `note` goes out in Opened.transport_note (why transport=auto chose gRPC).
std::unique_ptr<StreamTransport> MakeGrpcStreamTransport(const TransportEnv& env, std::string note);

}  // namespace draftfeed
