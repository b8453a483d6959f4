// Loopback integration: a real TargetService on a CPU engine, reached through
// gRPC by the client library and by a raw stub (for malformed input).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <thread>

#include "common/host_buffer_pool.h"
#include "common/payload_checksum.h"
#include "draftfeed/client.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "server/model/cpu_engine.h"
#if DRAFTFEED_HAVE_CUDA
#include "server/model/cuda_engine.h"
#endif
#include "server/service/target_service.h"
#include "tests/server/service/loopback_target.h"
#include "tests/server/service/test_tokens.h"

namespace draftfeed {
namespace {

using Server = testing::LoopbackTarget;
using testing::OpenFor;
using testing::OpenSendAndVanish;

std::vector<uint16_t> Values(const HiddenBatch& b) {
  return std::vector<uint16_t>(b.bf16().begin(), b.bf16().end());
}

using testing::RandomTokens;

std::vector<uint16_t> Direct(CpuEngine& e, const std::vector<int32_t>& tokens,
                             const std::vector<int32_t>& lens, const std::vector<int32_t>& layers) {
  std::vector<uint16_t> out(tokens.size() * layers.size() * e.model().config.hidden_size);
  absl::Status s =
      e.Forward(ForwardInput{tokens, lens, layers}, std::as_writable_bytes(std::span(out)));
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

TEST(ServiceTest, TargetInfoDescribesTheModel) {
  Server server;
  auto d = DescribeTarget(server.address());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->model_id, "tiny-random:0");
  EXPECT_EQ(d->architecture, "qwen3_5");
  EXPECT_EQ(d->num_layers, server.model().config.num_layers);
  EXPECT_EQ(d->hidden_size, server.model().config.hidden_size);
  EXPECT_EQ(d->vocab_size, server.model().config.vocab_size);
  EXPECT_EQ(d->fingerprint, server.model().fingerprint);
  EXPECT_EQ(d->devices, std::vector<std::string>{"cpu"});
  ASSERT_EQ(d->layer_types.size(), static_cast<size_t>(d->num_layers));
}

// The client's two receive paths: one thread reading and copying, or a
// reader handing each message to a copying thread (FeedOptions.read_handoff,
// on by default only where there are 4 or more cores, so CI would otherwise
// see one path).
class FeedPaths : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(ReadHandoff, FeedPaths, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "On" : "Off"; });

TEST_P(FeedPaths, ClientReceivesExactlyWhatTheEngineComputes) {
  // Chunks of 8 tokens, so most batches arrive in many pieces (the checksum
  // is taken piece by piece as they are copied).
  ServiceOptions options;
  options.chunk_bytes = 8 * 3 * 128 * 2;
  Server server(options);
  const std::vector<int32_t> layers = {2, 0, -1};
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = layers;
  opt.prefetch = 4;
  opt.read_handoff = GetParam();
  auto feed = Feed::Open(opt);
  ASSERT_TRUE(feed.ok()) << feed.status();
  const int vocab = static_cast<int>(server.model().config.vocab_size);
  std::vector<std::vector<int32_t>> lens = {{1}, {5, 17, 9}, {64, 1, 2}, {130}};
  std::vector<std::vector<int32_t>> toks;
  for (size_t i = 0; i < lens.size(); ++i) {
    int n = 0;
    for (int32_t l : lens[i]) n += l;
    toks.push_back(RandomTokens(n, vocab, 100 + i));
    auto id = (*feed)->Submit(toks.back(), lens[i]);
    ASSERT_TRUE(id.ok()) << id.status();
    EXPECT_EQ(*id, i + 1);
  }
  for (size_t i = 0; i < lens.size(); ++i) {
    auto b = (*feed)->Next();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->batch_id, i + 1);
    EXPECT_EQ(b->token_ids, toks[i]);
    EXPECT_EQ(b->seq_lens, lens[i]);
    EXPECT_EQ(b->num_layers, 3);
    EXPECT_EQ(Values(*b), Direct(server.engine(), toks[i], lens[i], layers)) << "batch " << i;
    EXPECT_EQ(b->checksum, v1::PayloadChecksum(b->bf16().data(), b->bf16().size() * 2));
  }
  EXPECT_TRUE((*feed)->Close().ok());
  FeedStats st = (*feed)->Stats();
  EXPECT_EQ(st.delivered, 4);
  EXPECT_EQ(st.outstanding, 0);
}

TEST(ServiceTest, PackedBatchEqualsEachSequenceAlone) {
  Server server;
  const std::vector<int32_t> layers = {0, 1, 2, 3, -1};
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = layers;
  auto feed = *Feed::Open(opt);
  const std::vector<int32_t> lens = {3, 70, 1, 65};
  const std::vector<int32_t> tokens = RandomTokens(139, 4096, 7);
  ASSERT_TRUE(feed->Submit(tokens, lens).ok());
  int offset = 0;
  for (int32_t l : lens) {
    std::vector<int32_t> part(tokens.begin() + offset, tokens.begin() + offset + l);
    ASSERT_TRUE(feed->Submit(part, {l}).ok());
    offset += l;
  }
  HiddenBatch packed = *feed->Next();
  const int64_t stride = packed.num_layers * packed.hidden_size;
  offset = 0;
  for (int32_t l : lens) {
    HiddenBatch alone = *feed->Next();
    std::vector<uint16_t> slice(packed.bf16().begin() + offset * stride,
                                packed.bf16().begin() + (offset + l) * stride);
    EXPECT_EQ(slice, Values(alone)) << "sequence at offset " << offset;
    offset += l;
  }
}

TEST(ServiceTest, TwoStreamsAtOnce) {
  Server server;
  auto run = [&](uint64_t seed, std::vector<int32_t> layers, bool* ok) {
    FeedOptions opt;
    opt.targets = {server.address()};
    opt.layers = layers;
    opt.prefetch = 3;
    auto feed = *Feed::Open(opt);
    std::vector<std::vector<int32_t>> toks;
    for (int i = 0; i < 8; ++i) {
      toks.push_back(RandomTokens(40 + i * 7, 4096, seed + i));
      if (i >= 3) {
        HiddenBatch b = *feed->Next();
        *ok &= Values(b) == Direct(server.engine(), toks[i - 3],
                                   {static_cast<int32_t>(toks[i - 3].size())}, layers);
      }
      ASSERT_TRUE(feed->Submit(toks.back(), {static_cast<int32_t>(toks.back().size())}).ok());
    }
    for (int i = 5; i < 8; ++i) {
      HiddenBatch b = *feed->Next();
      *ok &= Values(b) ==
             Direct(server.engine(), toks[i], {static_cast<int32_t>(toks[i].size())}, layers);
    }
  };
  bool ok1 = true, ok2 = true;
  std::thread a(run, 1000, std::vector<int32_t>{1, -1}, &ok1);
  std::thread b(run, 2000, std::vector<int32_t>{3}, &ok2);
  a.join();
  b.join();
  EXPECT_TRUE(ok1);
  EXPECT_TRUE(ok2);
}

// A raw stream for input no well-behaved client would send.
class RawStream {
 public:
  RawStream(const std::string& address, v1::Open open) {
    stub_ = v1::TargetService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    stream_ = stub_->StreamHiddenStates(&ctx_);
    v1::StreamRequest req;
    *req.mutable_open() = std::move(open);
    stream_->Write(req);
  }
  bool ReadOpened() {
    v1::StreamResponse r;
    return stream_->Read(&r) && r.has_opened();
  }
  void Send(uint64_t id, std::vector<int32_t> tokens, std::vector<int32_t> lens,
            std::vector<int32_t> layers = {}) {
    v1::StreamRequest req;
    v1::Batch* b = req.mutable_batch();
    b->set_batch_id(id);
    b->mutable_token_ids()->Add(tokens.begin(), tokens.end());
    b->mutable_seq_lens()->Add(lens.begin(), lens.end());
    b->mutable_layers()->Add(layers.begin(), layers.end());
    ASSERT_TRUE(stream_->Write(req));
  }
  // Reads until the batch's BatchDone or BatchError; returns the payload or the error.
  absl::StatusOr<std::vector<uint16_t>> Receive(uint64_t id, int* chunks = nullptr) {
    std::string payload;
    v1::StreamResponse r;
    while (stream_->Read(&r)) {
      if (r.has_chunk()) {
        EXPECT_EQ(r.chunk().batch_id(), id);
        if (chunks) ++*chunks;
        payload += r.chunk().data();
      } else if (r.has_error()) {
        EXPECT_EQ(r.error().batch_id(), id);
        return absl::Status(static_cast<absl::StatusCode>(r.error().code()), r.error().message());
      } else if (r.has_done()) {
        EXPECT_EQ(r.done().batch_id(), id);
        EXPECT_EQ(r.done().checksum(), v1::PayloadChecksum(payload.data(), payload.size()));
        std::vector<uint16_t> out(payload.size() / 2);
        std::memcpy(out.data(), payload.data(), payload.size());
        return out;
      }
    }
    return absl::InternalError("stream ended");
  }
  grpc::Status Finish() {
    stream_->WritesDone();
    v1::StreamResponse r;
    while (stream_->Read(&r)) {
    }
    return stream_->Finish();
  }

 private:
  std::unique_ptr<v1::TargetService::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream_;
};

TEST(ServiceTest, BadBatchesFailAloneAndTheStreamKeepsServing) {
  ServiceOptions options;
  options.max_batch_tokens = 100;
  Server server(options);
  RawStream s(server.address(), OpenFor({1, -1}));
  ASSERT_TRUE(s.ReadOpened());
  const std::vector<int32_t> good = RandomTokens(10, 4096, 3);
  const auto expected = Direct(server.engine(), good, {4, 6}, {1, -1});

  struct Case {
    std::vector<int32_t> tokens, lens, layers;
    absl::StatusCode code;
    std::string text;
  };
  std::vector<int32_t> big_vocab = good;
  big_vocab[7] = 4096;
  std::vector<int32_t> negative = good;
  negative[2] = -5;
  const std::vector<Case> cases = {
      {big_vocab, {10}, {}, absl::StatusCode::kInvalidArgument, "token_ids[7] = 4096"},
      {negative, {10}, {}, absl::StatusCode::kInvalidArgument, "token_ids[2] = -5"},
      {good, {4, -6}, {}, absl::StatusCode::kInvalidArgument, "seq_lens[1]"},
      {good, {4, 5}, {}, absl::StatusCode::kInvalidArgument, "9"},
      {RandomTokens(101, 4096, 1), {101}, {}, absl::StatusCode::kInvalidArgument, "101"},
      {good, {10}, {7}, absl::StatusCode::kInvalidArgument, "layer"},
      {{}, {}, {}, absl::StatusCode::kInvalidArgument, "empty"},
  };
  uint64_t id = 1;
  for (const Case& c : cases) {
    s.Send(id, c.tokens, c.lens, c.layers);
    auto r = s.Receive(id);
    ASSERT_FALSE(r.ok()) << "case " << id;
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_NE(r.status().message().find(c.text), std::string::npos) << r.status();
    EXPECT_NE(r.status().message().find("batch " + std::to_string(id)), std::string::npos)
        << r.status();
    // The same stream then serves a good batch, bit-exact.
    s.Send(id + 1000, good, {4, 6});
    auto ok = s.Receive(id + 1000);
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_EQ(*ok, expected);
    ++id;
  }
  EXPECT_TRUE(s.Finish().ok());
}

TEST(ServiceTest, StreamLevelRefusals) {
  Server server;
  struct Case {
    v1::Open open;
    grpc::StatusCode code;
    std::string text;
  };
  std::vector<Case> cases;
  {
    v1::Open o = OpenFor({1});
    o.set_expected_fingerprint("0123456789abcdef");
    cases.push_back({o, grpc::StatusCode::FAILED_PRECONDITION, "fingerprint mismatch"});
  }
  {
    v1::Open o = OpenFor({1});
    // A number the proto does not name (3, once bf16_zstd): refused by
    // number, the offered ones listed.
    o.set_encoding(static_cast<v1::Encoding>(3));
    cases.push_back({o, grpc::StatusCode::INVALID_ARGUMENT,
                     "encoding unknown (3) is not served by this target; offered: bf16, fp8_e4m3"});
  }
  {
    v1::Open o = OpenFor({1});
    o.set_transport(v1::TRANSPORT_NCCL);
    cases.push_back({o, grpc::StatusCode::FAILED_PRECONDITION, "transport nccl refused"});
  }
  cases.push_back({OpenFor({4}), grpc::StatusCode::INVALID_ARGUMENT, "layer"});
  cases.push_back({OpenFor({}), grpc::StatusCode::INVALID_ARGUMENT, "layer"});
  for (const Case& c : cases) {
    RawStream s(server.address(), c.open);
    grpc::Status st = s.Finish();
    EXPECT_EQ(st.error_code(), c.code) << st.error_message();
    EXPECT_NE(st.error_message().find(c.text), std::string::npos) << st.error_message();
  }
  // The server still serves afterwards.
  RawStream s(server.address(), OpenFor({-1}));
  ASSERT_TRUE(s.ReadOpened());
  s.Send(1, {1, 2, 3}, {3});
  EXPECT_TRUE(s.Receive(1).ok());
}

// A CPU engine with capture slots, as a GPU engine started with
// --max_capture_layers=2 has.
class TwoSlotEngine final : public Engine {
 public:
  explicit TwoSlotEngine(Engine* inner) : inner_(inner) {}
  const Model& model() const override { return inner_->model(); }
  std::string device_name() const override { return inner_->device_name(); }
  absl::Status Forward(const ForwardInput& in, std::span<std::byte> out) override {
    return inner_->Forward(in, out);
  }
  int64_t max_capture_layers() const override { return 2; }

 private:
  Engine* inner_;
};

TEST(ServiceTest, CaptureLayerLimitIsAdvertisedAndEnforced) {
  auto model = *OpenModel("tiny-random:0");
  auto cpu = *CpuEngine::Create(model.get(), 2);
  TwoSlotEngine engine(cpu.get());
  TargetService service({&engine}, ServiceOptions{});
  auto [server, address] = ServeOnLoopback(&service);
  EXPECT_EQ(service.Info().max_capture_layers(), 2);

  RawStream refused(address, OpenFor({0, 1, -1}));
  grpc::Status st = refused.Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("at most 2"), std::string::npos) << st.error_message();

  RawStream s(address, OpenFor({1, -1}));
  ASSERT_TRUE(s.ReadOpened());
  s.Send(1, {1, 2, 3}, {3}, {0, 1, 2});  // this batch alone asks for three
  absl::StatusOr<std::vector<uint16_t>> r = s.Receive(1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("batch 1: 3 capture layers"), std::string::npos)
      << r.status();
  s.Send(2, {1, 2, 3}, {3});
  EXPECT_TRUE(s.Receive(2).ok());
  EXPECT_TRUE(s.Finish().ok());
  service.BeginDrain();
  server->Shutdown();
  service.StopScheduler();
}

TEST(ServiceTest, ClientRefusesTargetWithAnotherModel) {
  Server a;
  Server b({}, "tiny-random:1");
  FeedOptions opt;
  opt.targets = {a.address(), b.address()};
  opt.layers = {0};
  // The first target fixes the model; b is left out, refused, and a serves.
  auto feed = Feed::Open(opt);
  ASSERT_TRUE(feed.ok()) << feed.status();
  FeedStats stats = (*feed)->Stats();
  ASSERT_EQ(stats.targets.size(), 2u);
  EXPECT_EQ(stats.targets[0].state, "live");
  EXPECT_EQ(stats.targets[1].state, "refused");
  EXPECT_NE(stats.targets[1].last_error.find("tiny-random:1"), std::string::npos);
  EXPECT_NE(stats.targets[1].last_error.find("tiny-random:0"), std::string::npos);
  for (uint64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE((*feed)->Submit(RandomTokens(9, 4096, i), {9}).ok());
    auto r = (*feed)->Next();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->target, a.address());
  }
  // Only when no target serves the model does opening fail, naming both.
  FeedOptions only_b = opt;
  only_b.targets = {b.address()};
  only_b.expected_fingerprint = (*feed)->target().fingerprint;
  auto refused = Feed::Open(only_b);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("tiny-random:1"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find(b.address()), std::string::npos) << refused.status();
}

// Chunking edges: one token, exactly one chunk, one byte over a chunk.
TEST(ServiceTest, ChunkEdgesAreBitExact) {
  const int64_t bytes_per_token = 2 * 128 * 2;  // K=2 layers, H=128, bf16
  ServiceOptions options;
  options.chunk_bytes = 8 * bytes_per_token;
  Server server(options);
  RawStream s(server.address(), OpenFor({0, -1}));
  ASSERT_TRUE(s.ReadOpened());
  struct Case {
    int tokens;
    int chunks;
  };
  uint64_t id = 1;
  for (Case c : {Case{1, 1}, Case{8, 1}, Case{9, 2}, Case{16, 2}, Case{17, 3}}) {
    const auto tokens = RandomTokens(c.tokens, 4096, id);
    s.Send(id, tokens, {c.tokens});
    int chunks = 0;
    auto r = s.Receive(id, &chunks);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(*r, Direct(server.engine(), tokens, {c.tokens}, {0, -1}));
    EXPECT_EQ(chunks, c.chunks) << c.tokens << " tokens";
    ++id;
  }
}

TEST(FeedOptionsTest, OutOfRangeCountsAreRefusedNamingTheOption) {
  FeedOptions opt;
  opt.targets = {"127.0.0.1:1"};
  opt.layers = {0};
  opt.connections_per_target = 0;
  auto feed = Feed::Open(opt);
  ASSERT_FALSE(feed.ok());
  EXPECT_EQ(feed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(feed.status().message().find("connections_per_target"), std::string::npos)
      << feed.status();
}

// A batch larger than prefetch_bytes is let through alone. The feed's pool
// keeps two such buffers (one arriving, one in the trainer's hands), so a
// stream of them allocates twice, not once per batch (a fresh buffer costs
// page faults on the host, or a device-synchronising cudaFree on the GPU).
TEST(FeedBuffers, BatchesLargerThanThePrefetchWindowReuseTheirBuffers) {
  Server server;
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = {0, -1};
  opt.prefetch_bytes = 4096;  // each batch below is 200 x 2 x H x 2 bytes, far more
  auto feed = *Feed::Open(opt);
  const int vocab = static_cast<int>(server.model().config.vocab_size);
  std::optional<HiddenBatch> held;  // the trainer holds one batch while the next arrives
  for (int i = 0; i < 8; ++i) {
    const std::vector<int32_t> toks = RandomTokens(200, vocab, 300 + i);
    ASSERT_TRUE(feed->Submit(toks, {200}).ok());
    auto b = feed->Next();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(Values(*b), Direct(server.engine(), toks, {200}, {0, -1})) << "batch " << i;
    held = *std::move(b);
  }
  EXPECT_LE(feed->Stats().buffer_allocations, 2);
  EXPECT_TRUE(feed->Close().ok());
}

TEST_P(FeedPaths, DrainFinishesAcceptedBatchesThenEndsStreams) {
  Server server;
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = {-1};
  opt.prefetch = 4;
  opt.read_handoff = GetParam();
  opt.unavailable_timeout_s = 1.0;  // the only target is gone: fail fast
  auto feed = *Feed::Open(opt);
  std::vector<std::vector<int32_t>> toks;
  for (int i = 0; i < 4; ++i) {
    toks.push_back(RandomTokens(200, 4096, 50 + i));
    ASSERT_TRUE(feed->Submit(toks.back(), {200}).ok());
  }
  // Wait until the target holds all four, then drain.
  for (int i = 0;
       i < 200 && server.service().scheduler().queued() + server.service().scheduler().running() +
                          server.service().scheduler().completed_batches() <
                      4;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::thread stopper([&] { server.Stop(); });
  for (int i = 0; i < 4; ++i) {
    auto b = feed->Next();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(Values(*b), Direct(server.engine(), toks[i], {200}, {-1}));
  }
  stopper.join();
  auto after = feed->Submit(toks[0], {200});
  if (after.ok()) {
    auto b = feed->Next();
    EXPECT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable) << b.status();
  } else {
    EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
  }
}

TEST(ServiceTest, VanishingClientDoesNotDisturbOthers) {
  Server server;
  OpenSendAndVanish(server.address(), /*batches=*/3, /*tokens=*/300, /*reads=*/1);
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = {2};
  auto feed = *Feed::Open(opt);
  const auto tokens = RandomTokens(33, 4096, 9);
  ASSERT_TRUE(feed->Submit(tokens, {33}).ok());
  auto b = feed->Next();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Values(*b), Direct(server.engine(), tokens, {33}, {2}));
  for (int i = 0; i < 500 && server.service().open_streams() > 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(server.service().open_streams(), 1);
}

}  // namespace
}  // namespace draftfeed

#if DRAFTFEED_HAVE_CUDA
namespace draftfeed {
namespace {

// The target path on the GPU: CUDA engine -> scheduler -> gRPC -> client,
// bit-identical to calling the engine directly (skips without a GPU).
TEST(CudaServiceTest, ClientReceivesExactlyWhatTheCudaEngineComputes) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  auto model = OpenModel("small-random");
  ASSERT_TRUE(model.ok());
  CudaEngineOptions copt;
  copt.max_tokens = 2048;
  auto engine = CudaEngine::Create(model->get(), copt);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ServiceOptions options;
  options.max_batch_tokens = 2048;
  TargetService service({engine->get()}, options);
  auto [server, address] = ServeOnLoopback(&service);
  FeedOptions opt;
  opt.targets = {address};
  opt.layers = {1, 3, -1};
  auto feed = Feed::Open(opt);
  ASSERT_TRUE(feed.ok()) << feed.status();
  EXPECT_EQ((*feed)->target().devices, std::vector<std::string>{"cuda:0"});
  std::vector<std::vector<int32_t>> toks, lens = {{1}, {300, 17}, {1024}};
  for (size_t i = 0; i < lens.size(); ++i) {
    int n = 0;
    for (int32_t l : lens[i]) n += l;
    toks.push_back(RandomTokens(n, 4096, 70 + i));
    ASSERT_TRUE((*feed)->Submit(toks.back(), lens[i]).ok());
  }
  std::vector<std::vector<uint16_t>> got;
  for (size_t i = 0; i < lens.size(); ++i) {
    auto b = (*feed)->Next();
    ASSERT_TRUE(b.ok()) << b.status();
    got.push_back(Values(*b));
  }
  // The engine is idle now (every batch returned): compare with direct calls.
  for (size_t i = 0; i < lens.size(); ++i) {
    std::vector<uint16_t> direct(toks[i].size() * 3 * 512);
    ASSERT_TRUE(
        (*engine)
            ->Forward({toks[i], lens[i], opt.layers}, std::as_writable_bytes(std::span(direct)))
            .ok());
    EXPECT_EQ(got[i], direct) << "batch " << i;
  }
  EXPECT_TRUE((*feed)->Close().ok());
  service.BeginDrain();
  server->Shutdown();
  service.StopScheduler();
}

}  // namespace
}  // namespace draftfeed
#endif  // DRAFTFEED_HAVE_CUDA
