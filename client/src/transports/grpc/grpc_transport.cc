#include "client/src/transports/grpc/grpc_transport.h"

#include "absl/strings/str_cat.h"
#include "common/host_buffer_pool.h"

namespace draftfeed {
namespace {

class GrpcStreamTransport final : public StreamTransport {
 public:
  GrpcStreamTransport(StreamSlot slot, HostBufferPool* pool)
      : slot_(std::move(slot)), pool_(pool) {}

  std::string_view name() const override { return "grpc"; }
  bool payload_in_stream() const override { return true; }

  bool OnChunk(const Chunk& chunk) override {
    std::optional<BatchSink::Landing> landing =
        slot_.sink->Claim(slot_.stream, chunk.header, chunk.payload_bytes, /*device=*/-1,
                          [this](size_t bytes) { return pool_->Acquire(bytes); });
    if (!landing.has_value()) return true;
    const bool ok = chunk.CopyTo(landing->dst, landing->hash ? &landing->hasher : nullptr);
    slot_.sink->Landed(slot_.stream, chunk.header, chunk.payload_bytes, &*landing, ok,
                       /*checksum=*/std::nullopt, /*recv_ms=*/0);
    return true;
  }

  void Abort() override {}  // every chunk landed as it was read

 private:
  const StreamSlot slot_;
  HostBufferPool* const pool_;
};

class GrpcOffer final : public TransportOffer {
 public:
  explicit GrpcOffer(HostBufferPool* pool) : pool_(pool) {}
  absl::Status Sent() override { return absl::OkStatus(); }
  absl::StatusOr<std::unique_ptr<StreamTransport>> Accept(const v1::Opened& opened,
                                                          StreamSlot slot) override {
    if (opened.transport() != v1::TRANSPORT_GRPC &&
        opened.transport() != v1::TRANSPORT_UNSPECIFIED) {
      return absl::InternalError(absl::StrCat("target ", slot.address, " chose ",
                                              v1::Transport_Name(opened.transport()),
                                              ", which this feed did not offer"));
    }
    return std::make_unique<GrpcStreamTransport>(std::move(slot), pool_);
  }

 private:
  HostBufferPool* const pool_;
};

class GrpcTransports final : public ClientTransports {
 public:
  explicit GrpcTransports(HostBufferPool* pool) : pool_(pool) {}
  absl::StatusOr<std::unique_ptr<TransportOffer>> Offer(const std::string& address,
                                                        v1::Open* open) override {
    return MakeGrpcOffer(pool_, open);
  }
  int64_t allocations() const override { return 0; }  // the feed's host pool counts them

 private:
  HostBufferPool* const pool_;
};

}  // namespace

std::unique_ptr<TransportOffer> MakeGrpcOffer(HostBufferPool* host_pool, v1::Open* open) {
  open->set_transport(v1::TRANSPORT_GRPC);
  return std::make_unique<GrpcOffer>(host_pool);
}

std::unique_ptr<ClientTransports> MakeGrpcTransports(HostBufferPool* host_pool) {
  return std::make_unique<GrpcTransports>(host_pool);
}

}  // namespace draftfeed
