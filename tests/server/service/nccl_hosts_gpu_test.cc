// NCCL across hosts on two GPUs of one machine: the target is given another
// host identity (ServiceOptions::host), so the trainer's Open names another
// host and the cross-host code path runs, and NCCL is kept off NVLink and
// shared memory (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE, NCCL_NET=Socket), so the
// bytes go through its socket transport on loopback as they would between
// hosts. Its own binary: NCCL reads those variables once per process, so
// nothing may call NCCL before the first test sets them. Skips with fewer
// than two GPUs.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "common/nccl/nccl_peer.h"
#include "common/nccl_hosts.h"
#include "common/payload_checksum.h"
#include "draftfeed/client.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "server/model/cuda_engine.h"
#include "server/service/target_service.h"
#include "server/service/transport_registry.h"
#include "tests/server/service/test_tokens.h"

namespace draftfeed {
namespace {

// NCCL's log of this process: which transport each connection took.
std::string NcclLogPath() {
  return ::testing::TempDir() + "draftfeed_nccl_hosts_" + std::to_string(getpid()) + ".log";
}

// Before this process's first NCCL call (NCCL reads these once).
void ForceNcclOntoSockets() {
  setenv("NCCL_P2P_DISABLE", "1", 1);
  setenv("NCCL_SHM_DISABLE", "1", 1);
  setenv("NCCL_NET", "Socket", 1);
  setenv("NCCL_IB_DISABLE", "1", 1);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("NCCL_DEBUG", "INFO", 1);
  setenv("NCCL_DEBUG_SUBSYS", "INIT,P2P,NET", 1);
  setenv("NCCL_DEBUG_FILE", NcclLogPath().c_str(), 1);
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// NCCL's lines about its transports (for a failure's message).
std::string TransportLines(const std::string& log) {
  std::stringstream in(log), out;
  for (std::string line; std::getline(in, line);) {
    if (line.find(" via ") != std::string::npos || line.find("NET/") != std::string::npos) {
      out << line << "\n";
    }
  }
  return out.str();
}

class NcclAcrossHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
    ForceNcclOntoSockets();
    // Loopback is the one interface two GPUs of this machine surely share.
    ASSERT_TRUE(UseNcclSocketIfname("lo", "the test").ok());
    model_ = *OpenModel("small-random");
    CudaEngineOptions copt;
    copt.device = 0;
    copt.max_tokens = 4096;
    auto engine = CudaEngine::Create(model_.get(), copt);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = *std::move(engine);
  }
  static void TearDownTestSuite() { unlink(NcclLogPath().c_str()); }
  void TearDown() override {
    if (service_ != nullptr) {
      service_->BeginDrain();
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
      service_->StopScheduler();
    }
  }

  // The target on GPU 0, as host "host-a".
  void Serve(bool across_hosts, double setup_timeout_s = 30) {
    ServiceOptions options;
    options.max_batch_tokens = 4096;
    options.nccl_timeout_s = 30;
    options.nccl_setup_timeout_s = setup_timeout_s;
    options.nccl_across_hosts = across_hosts;
    options.host = {"test:host-a", "host-a"};
    service_ = std::make_unique<TargetService>(std::vector<Engine*>{engine_.get()}, options);
    LoopbackServer served = ServeOnLoopback(service_.get());
    server_ = std::move(served.server);
    address_ = served.address;
  }

  v1::TargetInfo Info() {
    auto stub = v1::TargetService::NewStub(
        grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    v1::TargetInfo info;
    EXPECT_TRUE(stub->GetTargetInfo(&ctx, {}, &info).ok());
    return info;
  }

  FeedOptions Options(Transport transport, bool across_hosts) {
    FeedOptions opt;
    opt.targets = {address_};
    opt.layers = layers_;
    opt.transport = transport;
    opt.cuda_device = transport == Transport::kGrpc ? -1 : 1;
    opt.nccl_timeout_s = 30;
    opt.nccl_setup_timeout_s = 30;
    opt.nccl_across_hosts = across_hosts;
    if (transport != Transport::kGrpc) opt.nccl_socket_ifname = "lo";
    return opt;
  }

  // Every batch's bytes in host memory, and the transport and note the
  // target's stream had.
  std::vector<std::vector<uint8_t>> Run(const FeedOptions& opt, std::string* used,
                                        std::string* note) {
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
  std::unique_ptr<CudaEngine> engine_;
  std::unique_ptr<TargetService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  const std::vector<int32_t> layers_ = {1, 3, -1};
  const std::vector<std::vector<int32_t>> lens_ = {{1}, {300, 17, 5}, {4096}};
  std::vector<std::vector<int32_t>> toks_ = {testing::RandomTokens(1, 4096, 1),
                                             testing::RandomTokens(322, 4096, 2),
                                             testing::RandomTokens(4096, 4096, 3)};
};

TEST_F(NcclAcrossHosts, NcclDeliversWhatGrpcDoesThroughSockets) {
  Serve(/*across_hosts=*/true);
  const v1::TargetInfo info = Info();
  EXPECT_TRUE(info.nccl_across_hosts());
  EXPECT_EQ(SummarizeTransports(service_->transport_env()),
            "transports grpc,nccl (nccl across hosts)");
  EXPECT_EQ(DescribeNcclTransport(service_->transport_env()),
            "nccl offered to trainers on this host and on other hosts (NCCL_SOCKET_IFNAME=lo; "
            "set-up timeout 30 s, transfer timeout 30 s)");
  std::string used, note;
  const auto by_grpc = Run(Options(Transport::kGrpc, false), &used, &note);
  ASSERT_EQ(by_grpc.size(), lens_.size());
  const auto by_nccl = Run(Options(Transport::kNccl, false), &used, &note);
  EXPECT_EQ(used, "nccl");
  EXPECT_EQ(note,
            "nccl across hosts (trainer on host " + LocalHost().name + ", target on host host-a)");
  ASSERT_EQ(by_nccl.size(), by_grpc.size());
  for (size_t i = 0; i < by_grpc.size(); ++i) EXPECT_EQ(by_nccl[i], by_grpc[i]) << "batch " << i;
  // NCCL connected the two GPUs through its socket transport, never NVLink
  // or shared memory.
  const std::string log = ReadFile(NcclLogPath());
  EXPECT_NE(log.find("via NET/Socket"), std::string::npos) << TransportLines(log);
  EXPECT_EQ(log.find("via P2P"), std::string::npos) << TransportLines(log);
  EXPECT_EQ(log.find("via SHM"), std::string::npos) << TransportLines(log);
}

TEST_F(NcclAcrossHosts, AutoCrossesHostsOnlyWhenAsked) {
  Serve(/*across_hosts=*/true);
  std::string used, note;
  const auto by_grpc = Run(Options(Transport::kAuto, false), &used, &note);
  EXPECT_EQ(used, "grpc");
  EXPECT_EQ(note, "auto chose grpc: trainer on host " + LocalHost().name +
                      ", target on host host-a: NCCL across hosts needs nccl_across_hosts=True "
                      "(or transport=nccl)");
  const auto by_nccl = Run(Options(Transport::kAuto, true), &used, &note);
  EXPECT_EQ(used, "nccl") << note;
  EXPECT_EQ(by_nccl, by_grpc);
}

TEST_F(NcclAcrossHosts, ATargetForItsOwnHostRefusesOthersNamingItsFlag) {
  Serve(/*across_hosts=*/false);
  const v1::TargetInfo info = Info();
  EXPECT_FALSE(info.nccl_across_hosts());
  ASSERT_EQ(info.transports_size(), 2);  // NCCL is still offered on its own host
  EXPECT_EQ(SummarizeTransports(service_->transport_env()),
            "transports grpc,nccl (nccl on this host only)");
  absl::StatusOr<std::unique_ptr<Feed>> feed = Feed::Open(Options(Transport::kNccl, false));
  ASSERT_FALSE(feed.ok());
  EXPECT_EQ(feed.status().code(), absl::StatusCode::kFailedPrecondition) << feed.status();
  EXPECT_NE(feed.status().message().find(
                "transport nccl refused: trainer on host " + LocalHost().name +
                ", target on host host-a: this target was started with --nccl_across_hosts=false"),
            std::string::npos)
      << feed.status();
  std::string used, note;
  const auto by_auto = Run(Options(Transport::kAuto, true), &used, &note);
  EXPECT_EQ(used, "grpc");
  EXPECT_NE(note.find("--nccl_across_hosts=false"), std::string::npos) << note;
  EXPECT_EQ(by_auto.size(), lens_.size());
}

// A trainer on "another host" whose NCCL never joins: the target gives up
// after its set-up timeout, saying what to check between the hosts.
TEST_F(NcclAcrossHosts, ASetupThatNeverCompletesTimesOutNamingTheInterface) {
  Serve(/*across_hosts=*/true, /*setup_timeout_s=*/2);
  auto id = NcclPeer::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  const std::string bootstrap = NcclUniqueIdAddress(*id);
  EXPECT_EQ(bootstrap.rfind("127.0.0.1:", 0), 0u) << bootstrap;  // NCCL_SOCKET_IFNAME=lo
  auto stub =
      v1::TargetService::NewStub(grpc::CreateChannel(address_, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stub->StreamHiddenStates(&ctx);
  v1::StreamRequest req;
  v1::Open* open = req.mutable_open();
  for (int32_t l : layers_) open->add_layers(l);
  open->set_transport(v1::TRANSPORT_NCCL);
  open->set_nccl_unique_id(*id);
  open->set_host_id("test:host-b");
  open->set_host_name("host-b");
  ASSERT_TRUE(stream->Write(req));
  v1::StreamResponse resp;
  EXPECT_FALSE(stream->Read(&resp));  // no Opened: the set-up failed
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  EXPECT_NE(s.error_message().find("transport nccl setup failed: nccl setup timed out after 2 s: "
                                   "check NCCL_SOCKET_IFNAME=lo"),
            std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("the trainer's NCCL bootstrap is at " + bootstrap),
            std::string::npos)
      << s.error_message();
  // The target serves on.
  std::string used, note;
  EXPECT_EQ(Run(Options(Transport::kGrpc, false), &used, &note).size(), lens_.size());
}

}  // namespace
}  // namespace draftfeed
