// A real TargetService on a CPU engine, served on a loopback port for the
// service tests to reach through the client library or a raw stub.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "server/model/cpu_engine.h"
#include "server/service/target_service.h"

namespace draftfeed::testing {

class LoopbackTarget {
 public:
  explicit LoopbackTarget(ServiceOptions options = {}, const std::string& spec = "tiny-random:0") {
    model_ = *OpenModel(spec);
    engine_ = *CpuEngine::Create(model_.get(), 2);
    // As the target's start-up does for --max_sequence_tokens.
    if (options.max_sequence_tokens > options.max_batch_tokens) {
      (void)engine_->ReserveCarry(options.max_sequence_tokens);
    }
    service_ = std::make_unique<TargetService>(std::vector<Engine*>{engine_.get()}, options);
    LoopbackServer served = ServeOnLoopback(service_.get());
    server_ = std::move(served.server);
    address_ = std::move(served.address);
  }
  ~LoopbackTarget() { Stop(); }
  void Stop() {
    if (!server_) return;
    service_->BeginDrain();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    service_->StopScheduler();
    server_.reset();
  }
  const std::string& address() const { return address_; }
  CpuEngine& engine() { return *engine_; }
  const Model& model() const { return *model_; }
  TargetService& service() { return *service_; }

 private:
  std::unique_ptr<Model> model_;
  std::unique_ptr<CpuEngine> engine_;
  std::unique_ptr<TargetService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

// The Open message of a stream that captures `layers`.
inline v1::Open OpenFor(std::vector<int32_t> layers) {
  v1::Open o;
  o.mutable_layers()->Add(layers.begin(), layers.end());
  return o;
}

// A raw client that opens a stream (all layers), sends `batches` batches of
// `tokens` tokens, reads `reads` messages and then cancels the call.
inline void OpenSendAndVanish(const std::string& address, int batches, int tokens, int reads) {
  auto stub =
      v1::TargetService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = stub->StreamHiddenStates(&ctx);
  v1::StreamRequest req;
  *req.mutable_open() = OpenFor({0, 1, 2, 3, -1});
  stream->Write(req);
  for (int id = 1; id <= batches; ++id) {
    v1::StreamRequest b;
    b.mutable_batch()->set_batch_id(static_cast<uint64_t>(id));
    for (int i = 0; i < tokens; ++i) b.mutable_batch()->add_token_ids(i);
    b.mutable_batch()->add_seq_lens(tokens);
    stream->Write(b);
  }
  v1::StreamResponse r;
  for (int i = 0; i < reads; ++i) stream->Read(&r);
  ctx.TryCancel();
}

}  // namespace draftfeed::testing
