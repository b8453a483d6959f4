// libFuzzer target: a target's decoding of what a client sends. The input is
// the raw bytes of one StreamRequest as gRPC hands them to the reactor; it is
// parsed the reactor's way (ProtoBufferReader over a ByteBuffer) and then
// checked by the functions the reactor calls: PlanStream for an Open,
// PlanBatch for a Batch (on the stream an Open in the same input planned, or
// on a stream of every layer). The service is real: tiny-random on a CPU
// engine, never started serving. What the checks accept must be what the
// engine can run: every token in the vocabulary, lengths that add up, within
// the token budget, layers that exist, each asked once.
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "draftfeed/v1/draftfeed.pb.h"
#include "google/protobuf/stubs/logging.h"
#include "server/model/cpu_engine.h"
#include "server/model/engine.h"
#include "server/model/model.h"
#include "server/service/stream_open.h"
#include "server/service/target_service.h"

namespace {

using draftfeed::ServiceOptions;
using draftfeed::TargetService;

void Require(bool ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "fuzz_stream_request: invariant broken: %s\n", what);
    abort();
  }
}

struct Fixture {
  std::unique_ptr<draftfeed::Model> model;
  std::unique_ptr<draftfeed::CpuEngine> engine;
  std::unique_ptr<TargetService> service;
};

// Built once and kept to exit (the fuzzer never returns from its loop).
Fixture& Get() {
  static Fixture* f = [] {
    auto* fx = new Fixture;
    fx->model = *draftfeed::OpenModel("tiny-random:0");
    fx->engine = *draftfeed::CpuEngine::Create(fx->model.get(), 1);
    ServiceOptions opt;
    opt.max_batch_tokens = 256;
    fx->service =
        std::make_unique<TargetService>(std::vector<draftfeed::Engine*>{fx->engine.get()}, opt);
    return fx;
  }();
  return *f;
}

// The layers a plan may hold: [0, L) and -1, each once.
void CheckLayers(const std::vector<int32_t>& layers, int64_t num_layers) {
  std::set<int32_t> seen;
  for (int32_t l : layers) {
    Require(l == -1 || (l >= 0 && l < num_layers), "a layer id the model has");
    Require(seen.insert(l).second, "each layer id once");
  }
}

void CheckBatch(const draftfeed::BatchPlan& b, const draftfeed::Model& model,
                const ServiceOptions& opt) {
  Require(!b.token_ids.empty(), "a batch with tokens");
  Require(static_cast<int64_t>(b.token_ids.size()) <= opt.max_batch_tokens,
          "a batch within the token budget");
  for (int32_t t : b.token_ids) {
    Require(t >= 0 && t < model.config.vocab_size, "tokens in the vocabulary");
  }
  int64_t sum = 0;
  for (int32_t n : b.seq_lens) {
    Require(n >= 1, "sequence lengths of at least one token");
    sum += n;
  }
  Require(sum == static_cast<int64_t>(b.token_ids.size()), "lengths that add up to the tokens");
  Require(!b.layers.empty() || (b.outputs != nullptr && !b.outputs->empty()),
          "at least one layer, or target outputs");
  if (b.outputs != nullptr) {
    Require(draftfeed::ValidateTargetOutputs(*b.outputs, model.config.vocab_size).ok(),
            "target outputs within their limits");
  }
  CheckLayers(b.layers, model.config.num_layers);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& fx = Get();
  // The input is one message, or an Open and a Batch: when the first byte is
  // 0xff, the next two bytes (little-endian) give the Open's length.
  std::vector<std::string> messages;
  if (size >= 3 && data[0] == 0xff) {
    const size_t open_len = std::min<size_t>(data[1] | (size_t{data[2]} << 8), size - 3);
    messages.emplace_back(reinterpret_cast<const char*>(data + 3), open_len);
    messages.emplace_back(reinterpret_cast<const char*>(data + 3 + open_len), size - 3 - open_len);
  } else {
    messages.emplace_back(reinterpret_cast<const char*>(data), size);
  }
  draftfeed::StreamPlan stream;
  stream.layers = {0, 1, 2, 3, -1};
  for (const std::string& bytes : messages) {
    grpc::Slice slice(bytes.data(), bytes.size());
    grpc::ByteBuffer raw(&slice, 1);
    grpc::ProtoBufferReader reader(&raw);
    draftfeed::v1::StreamRequest req;
    if (!req.ParseFromZeroCopyStream(&reader)) continue;  // the reactor fails the stream
    if (req.msg_case() == draftfeed::v1::StreamRequest::kOpen) {
      auto plan = draftfeed::PlanStream(fx.service->stream_context(), req.open());
      if (!plan.ok()) continue;
      const ServiceOptions& opt = fx.service->options();
      Require(plan->credits >= 1 && plan->credits <= opt.max_credits, "credits in range");
      CheckLayers(plan->layers, fx.model->config.num_layers);
      if (!plan->layers.empty() || plan->outputs != nullptr) stream = *std::move(plan);
    } else if (req.msg_case() == draftfeed::v1::StreamRequest::kBatch) {
      auto batch = draftfeed::PlanBatch(fx.service->stream_context(), stream, req.batch());
      if (!batch.ok()) {
        const std::string msg(batch.status().message());
        Require(msg.rfind("batch ", 0) == 0, "a batch error that names the batch");
        continue;
      }
      CheckBatch(*batch, *fx.model, fx.service->options());
    }
  }
  return 0;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  grpc_init();
  // The parser logs every invalid UTF-8 string it meets; mutated inputs are
  // full of them.
  google::protobuf::SetLogHandler(nullptr);
  Get();
  return 0;
}
