// The NCCL transport: negotiation and refusals on any machine (CPU targets),
// and NCCL delivery against the
// gRPC path on GPUs (those tests skip cleanly without enough GPUs).
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/payload_checksum.h"
#include "draftfeed/client.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "server/model/cpu_engine.h"
#include "server/service/target_service.h"
#include "tests/server/service/test_tokens.h"
#if DRAFTFEED_HAVE_CUDA
#include <cuda_runtime.h>

#include "server/model/cuda_engine.h"
#include "server/model/sharding_plan.h"
#include "server/model/tensor_parallel_cuda_engine.h"
#if DRAFTFEED_HAVE_NCCL
#include "common/nccl/nccl_peer.h"
#endif
#endif

namespace draftfeed {
namespace {

int GpuCount() {
#if DRAFTFEED_HAVE_CUDA
  return CudaDeviceCount();
#else
  return 0;
#endif
}

// A TargetService on `engine`, served on a loopback port.
class Serving {
 public:
  Serving(Engine* engine, ServiceOptions options = {}) : service_({engine}, options) {
    LoopbackServer served = ServeOnLoopback(&service_);
    server_ = std::move(served.server);
    address_ = std::move(served.address);
  }
  ~Serving() {
    service_.BeginDrain();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
    service_.StopScheduler();
  }
  const std::string& address() const { return address_; }

 private:
  TargetService service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
};

using testing::RandomTokens;

// Opens a raw stream with `open` and returns the first response (or the
// status the stream ended with).
struct OpenResult {
  grpc::Status status;
  std::optional<v1::StreamResponse> first;
};
OpenResult RawOpen(const std::string& address, const v1::Open& open) {
  auto stub =
      v1::TargetService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = stub->StreamHiddenStates(&ctx);
  v1::StreamRequest req;
  *req.mutable_open() = open;
  stream->Write(req);
  OpenResult r;
  v1::StreamResponse resp;
  if (stream->Read(&resp)) {
    r.first = resp;
    ctx.TryCancel();
  }
  stream->WritesDone();
  r.status = stream->Finish();
  return r;
}

class CpuTarget : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = *OpenModel("tiny-random:0");
    engine_ = *CpuEngine::Create(model_.get(), 2);
    serving_ = std::make_unique<Serving>(engine_.get());
  }
  std::unique_ptr<Model> model_;
  std::unique_ptr<CpuEngine> engine_;
  std::unique_ptr<Serving> serving_;
};

TEST_F(CpuTarget, OffersOnlyGrpc) {
  auto stub = v1::TargetService::NewStub(
      grpc::CreateChannel(serving_->address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::TargetInfo info;
  ASSERT_TRUE(stub->GetTargetInfo(&ctx, {}, &info).ok());
  ASSERT_EQ(info.transports_size(), 1);
  EXPECT_EQ(info.transports(0), v1::TRANSPORT_GRPC);
}

TEST_F(CpuTarget, NcclIsRefusedNamingWhy) {
  v1::Open open;
  open.add_layers(0);
  open.set_transport(v1::TRANSPORT_NCCL);
  open.set_nccl_unique_id(std::string(128, '\x01'));
  OpenResult r = RawOpen(serving_->address(), open);
  EXPECT_FALSE(r.first.has_value());
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(r.status.error_message().find("transport nccl refused"), std::string::npos)
      << r.status.error_message();
  // The reason names the cause: a CPU target (or a build without NCCL).
  EXPECT_TRUE(r.status.error_message().find("cpu") != std::string::npos ||
              r.status.error_message().find("without NCCL") != std::string::npos)
      << r.status.error_message();
  EXPECT_NE(r.status.error_message().find("transport=auto"), std::string::npos);
}

TEST_F(CpuTarget, AutoFallsBackToGrpcAndSaysWhy) {
  v1::Open open;
  open.add_layers(0);
  open.set_transport(v1::TRANSPORT_AUTO);
  open.set_nccl_unique_id(std::string(128, '\x01'));
  OpenResult r = RawOpen(serving_->address(), open);
  ASSERT_TRUE(r.first.has_value()) << r.status.error_message();
  ASSERT_EQ(r.first->msg_case(), v1::StreamResponse::kOpened);
  EXPECT_EQ(r.first->opened().transport(), v1::TRANSPORT_GRPC);
  EXPECT_NE(r.first->opened().transport_note().find("auto chose grpc"), std::string::npos)
      << r.first->opened().transport_note();
}

TEST_F(CpuTarget, PlainGrpcOpenHasNoTransportNote) {
  v1::Open open;
  open.add_layers(0);
  OpenResult r = RawOpen(serving_->address(), open);
  ASSERT_TRUE(r.first.has_value());
  EXPECT_EQ(r.first->opened().transport(), v1::TRANSPORT_GRPC);
  EXPECT_TRUE(r.first->opened().transport_note().empty());
}

TEST_F(CpuTarget, FeedAskingForNcclWithoutAGpuFailsClearly) {
  FeedOptions opt;
  opt.targets = {serving_->address()};
  opt.layers = {0};
  opt.transport = Transport::kNccl;  // cuda_device left at -1
  auto feed = Feed::Open(opt);
  ASSERT_FALSE(feed.ok());
#if DRAFTFEED_HAVE_NCCL
  EXPECT_EQ(feed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(feed.status().message().find("cuda_device"), std::string::npos) << feed.status();
#else
  EXPECT_EQ(feed.status().code(), absl::StatusCode::kUnimplemented);
#endif
}

TEST_F(CpuTarget, SeveralConnectionsPerTargetShareTheWorkExactly) {
  FeedOptions opt;
  opt.targets = {serving_->address()};
  opt.layers = {0, -1};
  opt.connections_per_target = 3;
  opt.credits_per_target = 1;  // so that 6 batches in flight need every connection
  opt.prefetch = 6;
  auto feed = Feed::Open(opt);
  ASSERT_TRUE(feed.ok()) << feed.status();
  std::vector<std::vector<int32_t>> toks;
  for (int i = 0; i < 12; ++i) {
    toks.push_back(RandomTokens(20 + i, 4096, 40 + i));
    ASSERT_TRUE((*feed)->Submit(toks.back(), {20 + i}).ok());
    if (i >= 5) {
      auto b = (*feed)->Next();
      ASSERT_TRUE(b.ok()) << b.status();
    }
  }
  for (int i = 0; i < 5; ++i) ASSERT_TRUE((*feed)->Next().ok());
  FeedStats st = (*feed)->Stats();
  ASSERT_EQ(st.targets.size(), 3u);
  EXPECT_EQ(st.targets[0].address, serving_->address());
  EXPECT_EQ(st.targets[2].address, serving_->address() + " #3");
  int64_t delivered = 0;
  for (const TargetStats& t : st.targets) {
    EXPECT_EQ(t.state, "live");
    EXPECT_GT(t.delivered_batches, 0) << t.address;
    delivered += t.delivered_batches;
  }
  EXPECT_EQ(delivered, 12);
  // Same bytes as one connection gives.
  FeedOptions one = opt;
  one.connections_per_target = 1;
  auto single = *Feed::Open(one);
  auto multi = *Feed::Open(opt);
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(single->Submit(toks[i], {20 + i}).ok());
    ASSERT_TRUE(multi->Submit(toks[i], {20 + i}).ok());
  }
  for (int i = 0; i < 4; ++i) {
    auto a = single->Next();
    auto b = multi->Next();
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_TRUE(std::equal(a->bf16().begin(), a->bf16().end(), b->bf16().begin(), b->bf16().end()));
  }
  opt.connections_per_target = 0;
  EXPECT_EQ(Feed::Open(opt).status().code(), absl::StatusCode::kInvalidArgument);
}

#if DRAFTFEED_HAVE_CUDA
// ---- NCCL delivery on GPUs -----------------------------------------------------

class GpuTarget : public ::testing::Test {
 protected:
  // The target on cuda:0: `spec` on one GPU, or with `tp` > 1 a
  // tensor-parallel instance whose ranks all share cuda:0 (its captures
  // leave from rank 0, there).
  void Start(int min_gpus, const std::string& spec = "small-random", int tp = 1) {
    if (GpuCount() < min_gpus) GTEST_SKIP() << "needs " << min_gpus << " CUDA devices";
    model_ = *OpenModel(spec);
    CudaEngineOptions copt;
    copt.device = 0;
    copt.max_tokens = 4096;
    if (tp > 1) {
      auto plan = PlanTensorParallel(model_->config, tp);
      ASSERT_TRUE(plan.ok()) << plan.status();
      auto engine = TensorParallelCudaEngine::Create(model_.get(), *std::move(plan),
                                                     std::vector<int>(tp, 0), copt);
      ASSERT_TRUE(engine.ok()) << engine.status();
      engine_ = *std::move(engine);
    } else {
      auto engine = CudaEngine::Create(model_.get(), copt);
      ASSERT_TRUE(engine.ok()) << engine.status();
      engine_ = *std::move(engine);
    }
    ServiceOptions options;
    options.max_batch_tokens = 4096;
    options.nccl_timeout_s = 30;
    serving_ = std::make_unique<Serving>(engine_.get(), options);
  }

  // Runs the batches through a feed with `transport` and returns each result's
  // bytes in host memory, plus the per-target transport it used.
  std::vector<std::vector<uint8_t>> RunFeed(Transport transport, int cuda_device, std::string* used,
                                            std::string* note, Encoding encoding = Encoding::kBf16,
                                            bool fp8_raw = false) {
    FeedOptions opt;
    opt.targets = {serving_->address()};
    opt.layers = layers_;
    opt.transport = transport;
    opt.cuda_device = cuda_device;
    opt.nccl_timeout_s = 30;
    opt.encoding = encoding;
    opt.fp8_raw = fp8_raw;
    auto feed = Feed::Open(opt);
    EXPECT_TRUE(feed.ok()) << feed.status();
    if (!feed.ok()) return {};
    for (size_t i = 0; i < lens_.size(); ++i) EXPECT_TRUE((*feed)->Submit(toks_[i], lens_[i]).ok());
    std::vector<std::vector<uint8_t>> out;
    for (size_t i = 0; i < lens_.size(); ++i) {
      auto b = (*feed)->Next();
      EXPECT_TRUE(b.ok()) << b.status();
      if (!b.ok()) return {};
      std::vector<uint8_t> v(b->num_bytes);
      if (b->device >= 0) {
        EXPECT_EQ(b->device, cuda_device);
        EXPECT_TRUE(b->bytes().empty());
        EXPECT_EQ(cudaMemcpy(v.data(), b->buffer.get(), v.size(), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        EXPECT_EQ(b->checksum, v1::PayloadChecksum(v.data(), v.size()));
      } else {
        const auto bytes = reinterpret_cast<const uint8_t*>(b->bytes().data());
        v.assign(bytes, bytes + b->bytes().size());
      }
      out.push_back(std::move(v));
    }
    FeedStats st = (*feed)->Stats();
    *used = st.targets.at(0).transport;
    *note = st.targets.at(0).transport_note;
    EXPECT_TRUE((*feed)->Close().ok());
    return out;
  }

  std::unique_ptr<Model> model_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Serving> serving_;
  const std::vector<int32_t> layers_ = {1, 3, -1};
  // One token, a few sequences, and one whole-budget batch.
  const std::vector<std::vector<int32_t>> lens_ = {{1}, {300, 17, 5}, {4096}};
  std::vector<std::vector<int32_t>> toks_ = {RandomTokens(1, 4096, 1), RandomTokens(322, 4096, 2),
                                             RandomTokens(4096, 4096, 3)};
};

TEST_F(GpuTarget, NcclDeliversExactlyWhatGrpcDoes) {
  Start(2);
  if (IsSkipped()) return;
  std::string used, note;
  const auto by_grpc = RunFeed(Transport::kGrpc, -1, &used, &note);
  EXPECT_EQ(used, "grpc");
  const auto by_nccl = RunFeed(Transport::kNccl, 1, &used, &note);
  EXPECT_EQ(used, "nccl");
  ASSERT_EQ(by_nccl.size(), by_grpc.size());
  for (size_t i = 0; i < by_grpc.size(); ++i) EXPECT_EQ(by_nccl[i], by_grpc[i]) << "batch " << i;
  // auto picks NCCL on one host with two GPUs.
  const auto by_auto = RunFeed(Transport::kAuto, 1, &used, &note);
  EXPECT_EQ(used, "nccl") << note;
  ASSERT_EQ(by_auto.size(), by_grpc.size());
  for (size_t i = 0; i < by_grpc.size(); ++i) EXPECT_EQ(by_auto[i], by_grpc[i]) << "batch " << i;
}

// The same for the MoE families (routing, grouped GEMMs and combine all on
// the device ahead of the send) and for a tensor-parallel target (its
// capture rank sends).
TEST_F(GpuTarget, NcclDeliversWhatGrpcDoesForMoeModels) {
  for (const char* spec : {"small-random-moe", "small-random-qwen3-moe"}) {
    Start(2, spec);
    if (IsSkipped()) return;
    std::string used, note;
    const auto by_grpc = RunFeed(Transport::kGrpc, -1, &used, &note);
    const auto by_nccl = RunFeed(Transport::kNccl, 1, &used, &note);
    EXPECT_EQ(used, "nccl") << spec << ": " << note;
    ASSERT_EQ(by_nccl.size(), by_grpc.size()) << spec;
    for (size_t i = 0; i < by_grpc.size(); ++i) {
      EXPECT_EQ(by_nccl[i], by_grpc[i]) << spec << " batch " << i;
    }
    serving_.reset();
    engine_.reset();
  }
}

TEST_F(GpuTarget, NcclFromATensorParallelTargetDeliversWhatGrpcDoes) {
  Start(2, "small-random-qwen3-moe", /*tp=*/2);
  if (IsSkipped()) return;
  std::string used, note;
  const auto by_grpc = RunFeed(Transport::kGrpc, -1, &used, &note);
  const auto by_nccl = RunFeed(Transport::kNccl, 1, &used, &note);
  EXPECT_EQ(used, "nccl") << note;
  ASSERT_EQ(by_nccl.size(), by_grpc.size());
  for (size_t i = 0; i < by_grpc.size(); ++i) EXPECT_EQ(by_nccl[i], by_grpc[i]) << "batch " << i;
}

// fp8_e4m3 over NCCL: the trainer's GPU receives the bytes a raw gRPC feed
// gets (codes and scales, checksum verified), K*H + 4K a token.
TEST_F(GpuTarget, NcclDeliversTheFp8BytesGrpcDoes) {
  Start(2);
  if (IsSkipped()) return;
  std::string used, note;
  const auto by_grpc =
      RunFeed(Transport::kGrpc, -1, &used, &note, Encoding::kFp8E4m3, /*fp8_raw=*/true);
  const auto by_nccl = RunFeed(Transport::kNccl, 1, &used, &note, Encoding::kFp8E4m3);
  EXPECT_EQ(used, "nccl") << note;
  ASSERT_EQ(by_nccl.size(), by_grpc.size());
  const int64_t K = static_cast<int64_t>(layers_.size()), H = model_->config.hidden_size;
  for (size_t i = 0; i < by_grpc.size(); ++i) {
    int64_t T = 0;
    for (int32_t l : lens_[i]) T += l;
    EXPECT_EQ(by_grpc[i].size(), static_cast<size_t>(T * (K * H + 4 * K))) << "batch " << i;
    EXPECT_EQ(by_nccl[i], by_grpc[i]) << "batch " << i;
  }
}

TEST_F(GpuTarget, AutoOnTheTargetsOwnGpuFallsBackToGrpc) {
  Start(1);
  if (IsSkipped()) return;
  std::string used, note;
  const auto by_grpc = RunFeed(Transport::kGrpc, -1, &used, &note);
  const auto by_auto = RunFeed(Transport::kAuto, 0, &used, &note);
  EXPECT_EQ(used, "grpc");
  EXPECT_NE(note.find("own GPU"), std::string::npos) << note;
  EXPECT_EQ(by_auto, by_grpc);
}

#if DRAFTFEED_HAVE_NCCL
// A trainer that joins the communicator, gets a batch announced and then
// vanishes without receiving it: the target's send is aborted (not stuck on
// the GPU), the stream ends, and the target goes on serving exact results to
// the next trainers, by NCCL and by gRPC.
TEST_F(GpuTarget, TrainerVanishingMidTransferLeavesTheTargetServing) {
  Start(2);
  if (IsSkipped()) return;
  {
    auto stub = v1::TargetService::NewStub(
        grpc::CreateChannel(serving_->address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    auto stream = stub->StreamHiddenStates(&ctx);
    auto id = NcclPeer::NewUniqueId();
    ASSERT_TRUE(id.ok()) << id.status();
    v1::StreamRequest req;
    v1::Open* open = req.mutable_open();
    for (int32_t l : layers_) open->add_layers(l);
    open->set_transport(v1::TRANSPORT_NCCL);
    open->set_nccl_unique_id(*id);
    open->set_gpu_uuid(CudaDeviceUuid(1));
    ASSERT_TRUE(stream->Write(req));
    auto peer = NcclPeer::Start(*id, NcclPeer::kReceiverRank, 1);
    ASSERT_TRUE(peer.ok()) << peer.status();
    v1::StreamResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    ASSERT_EQ(resp.opened().transport(), v1::TRANSPORT_NCCL);
    ASSERT_TRUE((*peer)->Wait(30).ok());
    ASSERT_TRUE((*peer)->Handshake(30).ok());  // the target reads batches only after it
    v1::StreamRequest batch;
    batch.mutable_batch()->set_batch_id(1);
    for (int32_t t : toks_[2]) batch.mutable_batch()->add_token_ids(t);
    batch.mutable_batch()->add_seq_lens(static_cast<int32_t>(toks_[2].size()));
    ASSERT_TRUE(stream->Write(batch));
    ASSERT_TRUE(stream->Read(&resp));  // the announcement (the forward is over); no receive
    ASSERT_TRUE(resp.has_chunk());
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the send is waiting
    (*peer)->Abort();
    ctx.TryCancel();
    stream->Finish();
  }
  std::string used, note;
  const auto by_grpc = RunFeed(Transport::kGrpc, -1, &used, &note);
  ASSERT_EQ(by_grpc.size(), lens_.size());
  const auto by_nccl = RunFeed(Transport::kNccl, 1, &used, &note);
  EXPECT_EQ(used, "nccl");
  EXPECT_EQ(by_nccl, by_grpc);
}
#endif

TEST_F(GpuTarget, NcclOnTheTargetsOwnGpuIsRefused) {
  Start(1);
  if (IsSkipped()) return;
  FeedOptions opt;
  opt.targets = {serving_->address()};
  opt.layers = layers_;
  opt.transport = Transport::kNccl;
  opt.cuda_device = 0;
  auto feed = Feed::Open(opt);
  ASSERT_FALSE(feed.ok());
  EXPECT_NE(feed.status().message().find("own GPU"), std::string::npos) << feed.status();
}
#endif  // DRAFTFEED_HAVE_CUDA

#if DRAFTFEED_HAVE_NCCL
// The peer on its own, rank 0 on cuda:0 and rank 1 on cuda:1: after the
// handshake a send is posted (and returns) while the receiver has not posted
// yet, which the target relies on (it posts behind a forward, before the
// trainer knows of the batch); then the receive delivers the exact bytes,
// and both sides report the checksum of what the host wrote.
TEST(NcclPeerTest, AfterTheHandshakeASendPostsAloneAndDeliversExactBytes) {
  if (GpuCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  const size_t bytes = (size_t{48} << 20) + 4096 + 64;  // not a power of two
  std::vector<unsigned char> want(bytes);
  for (size_t i = 0; i < bytes; ++i) want[i] = static_cast<unsigned char>((i * 131) ^ (i >> 9));
  const uint64_t want_sum = v1::PayloadChecksum(want.data(), bytes);
  auto id = NcclPeer::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::mutex mu;
  std::condition_variable cv;
  bool send_posted = false;
  absl::Status status[2];
  uint64_t sums[2] = {0, 0};
  std::vector<unsigned char> got(bytes, 0);
  auto rank = [&](int r) {
    auto started = NcclPeer::Start(*id, r, r);
    absl::Status s = started.ok() ? (*started)->Wait(60) : started.status();
    if (s.ok()) s = (*started)->Handshake(60);
    void* buf = nullptr;
    cudaStream_t stream = nullptr;
    if (s.ok() && (cudaMalloc(&buf, bytes) != cudaSuccess ||
                   cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess)) {
      s = absl::InternalError("cuda set-up");
    }
    if (s.ok() && r == NcclPeer::kSenderRank) {
      cudaMemcpy(buf, want.data(), bytes, cudaMemcpyHostToDevice);
      auto op = (*started)->PostSend(buf, bytes, stream, 60);
      {
        std::lock_guard<std::mutex> lock(mu);
        send_posted = true;  // only now may the receiver post
      }
      cv.notify_all();
      if (!op.ok()) {
        s = op.status();
      } else {
        auto sum = (*started)->WaitOp(*op, 60);
        if (sum.ok())
          sums[r] = *sum;
        else
          s = sum.status();
      }
    } else if (s.ok()) {
      {
        std::unique_lock<std::mutex> lock(mu);
        if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return send_posted; })) {
          s = absl::DeadlineExceededError("the send was never posted alone");
        }
      }
      if (s.ok()) {
        auto sum = (*started)->Recv(buf, bytes, stream, 60);
        if (sum.ok())
          sums[r] = *sum;
        else
          s = sum.status();
      }
      if (s.ok()) cudaMemcpy(got.data(), buf, bytes, cudaMemcpyDeviceToHost);
    }
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      send_posted = true;  // never leave the other rank waiting on this one
      cv.notify_all();
    }
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (buf != nullptr) cudaFree(buf);
    status[r] = s;
  };
  std::thread sender(rank, 0), receiver(rank, 1);
  sender.join();
  receiver.join();
  ASSERT_TRUE(status[0].ok()) << status[0];
  ASSERT_TRUE(status[1].ok()) << status[1];
  EXPECT_EQ(sums[0], want_sum);
  EXPECT_EQ(sums[1], want_sum);
  EXPECT_TRUE(got == want) << "the received bytes differ from the sent ones";
}
#endif

}  // namespace
}  // namespace draftfeed
