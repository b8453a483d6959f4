#include "server/service/transports/grpc/grpc_stream_transport.h"

#include <utility>

#include "server/service/transports/grpc/chunk_writer.h"

namespace draftfeed {

namespace {

class GrpcStreamTransport final : public StreamTransport {
 public:
  GrpcStreamTransport(int64_t chunk_bytes, std::string note)
      : chunk_bytes_(chunk_bytes), note_(std::move(note)) {}

  std::optional<TransportOpened> Start() override {
    return TransportOpened{.transport = v1::TRANSPORT_GRPC, .note = note_, .ready = true};
  }

  // The capture lands in a host buffer (the scheduler's default).
  void Post(uint64_t, WorkItem&) override {}

  std::unique_ptr<PayloadWriter> WritePayload(uint64_t batch_id,
                                              std::shared_ptr<ForwardResult> result) override {
    return std::make_unique<ChunkWriter>(batch_id, std::move(result), chunk_bytes_);
  }

 private:
  const int64_t chunk_bytes_;
  const std::string note_;
};

}  // namespace

std::unique_ptr<StreamTransport> MakeGrpcStreamTransport(const TransportEnv& env,
                                                         std::string note) {
  return std::make_unique<GrpcStreamTransport>(env.chunk_bytes, std::move(note));
}

}  // namespace draftfeed
