// The cross-host rule of the NCCL transport (every build): who may use NCCL
// from another host, what the refusals and notes say, what the start-up line
// and TargetInfo report.
#include "server/service/transports/nccl/nccl_hosts_rule.h"

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>

#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "server/model/cpu_engine.h"
#include "server/service/target_service.h"
#include "server/service/transport_registry.h"

namespace draftfeed {
namespace {

TransportEnv TargetOn(const std::string& id, const std::string& name, bool across = true) {
  TransportEnv env;
  env.host = {id, name};
  env.nccl_across_hosts = across;
  return env;
}

v1::Open TrainerOn(const std::string& id, const std::string& name, v1::Transport t,
                   bool across = false) {
  v1::Open open;
  open.set_transport(t);
  open.set_host_id(id);
  open.set_host_name(name);
  open.set_nccl_across_hosts(across);
  return open;
}

TEST(NcclHostsRuleTest, OneHostIsAlwaysAllowed) {
  for (bool target_across : {true, false}) {
    const TransportEnv env = TargetOn("boot:a", "node-a", target_across);
    for (v1::Transport t : {v1::TRANSPORT_NCCL, v1::TRANSPORT_AUTO}) {
      const v1::Open open = TrainerOn("boot:a", "node-a", t);
      EXPECT_FALSE(NcclAcrossHosts(env, open));
      EXPECT_EQ(NcclHostsRefusal(env, open), "");
      EXPECT_EQ(NcclHostsNote(env, open), "");
    }
  }
}

TEST(NcclHostsRuleTest, NcclByNameCrossesHostsUnasked) {
  const TransportEnv env = TargetOn("boot:a", "node-a");
  const v1::Open open = TrainerOn("boot:b", "node-b", v1::TRANSPORT_NCCL);
  EXPECT_TRUE(NcclAcrossHosts(env, open));
  EXPECT_EQ(NcclHostsRefusal(env, open), "");
  EXPECT_EQ(NcclHostsNote(env, open),
            "nccl across hosts (trainer on host node-b, target on host node-a)");
}

TEST(NcclHostsRuleTest, AutoStaysOnOneHostUnlessTheTrainerAsks) {
  const TransportEnv env = TargetOn("boot:a", "node-a");
  EXPECT_EQ(NcclHostsRefusal(env, TrainerOn("boot:b", "node-b", v1::TRANSPORT_AUTO)),
            "trainer on host node-b, target on host node-a: NCCL across hosts needs "
            "nccl_across_hosts=True (or transport=nccl)");
  EXPECT_EQ(NcclHostsRefusal(env, TrainerOn("boot:b", "node-b", v1::TRANSPORT_AUTO, true)), "");
}

TEST(NcclHostsRuleTest, ATargetThatServesItsHostOnlyRefusesEveryOtherNamingItsFlag) {
  const TransportEnv env = TargetOn("boot:a", "node-a", /*across=*/false);
  for (v1::Transport t : {v1::TRANSPORT_NCCL, v1::TRANSPORT_AUTO}) {
    for (bool asked : {false, true}) {
      EXPECT_EQ(NcclHostsRefusal(env, TrainerOn("boot:b", "node-b", t, asked)),
                "trainer on host node-b, target on host node-a: this target was started with "
                "--nccl_across_hosts=false (NCCL for trainers on its own host only)");
    }
  }
}

TEST(NcclHostsRuleTest, ATrainerThatNamesNoHostIsTakenForAnotherHost) {
  // An older client sends no host id: auto keeps it on gRPC, as it did.
  const TransportEnv env = TargetOn("boot:a", "node-a");
  const v1::Open open = TrainerOn("", "", v1::TRANSPORT_AUTO);
  EXPECT_TRUE(NcclAcrossHosts(env, open));
  EXPECT_EQ(NcclHostsRefusal(env, open),
            "trainer on a host it did not name, target on host node-a: NCCL across hosts needs "
            "nccl_across_hosts=True (or transport=nccl)");
  EXPECT_EQ(NcclHostsRefusal(env, TrainerOn("", "", v1::TRANSPORT_NCCL)), "");
}

TEST(NcclHostsRuleTest, HostsOfOneNameAreToldApartByTheirIds) {
  // Same hostname, another boot (a reboot, a clone, or DRAFTFEED_HOST_ID).
  const TransportEnv env = TargetOn("boot:a", "node");
  const std::string why = NcclHostsRefusal(env, TrainerOn("boot:b", "node", v1::TRANSPORT_AUTO));
  EXPECT_EQ(why,
            "trainer and target on hosts both named node but of different host ids (another "
            "boot, or DRAFTFEED_HOST_ID): NCCL across hosts needs nccl_across_hosts=True (or "
            "transport=nccl)");
  EXPECT_EQ(why.find("boot:a"), std::string::npos);  // the target's id is not given away
}

TEST(NcclHostsRuleTest, TheOfferSaysWhichHostsTheInterfaceAndTheTimeouts) {
  TransportEnv env = TargetOn("boot:a", "node-a");
  env.nccl_setup_timeout_s = 20;
  env.nccl_timeout_s = 90;
  const std::string across = DescribeNcclOffer(env, "");
  EXPECT_EQ(across.rfind("nccl offered to trainers on this host and on other hosts (NCCL_SOCKET_"),
            0u)
      << across;
  EXPECT_NE(across.find("set-up timeout 20 s, transfer timeout 90 s"), std::string::npos);
  env.nccl_across_hosts = false;
  EXPECT_EQ(DescribeNcclOffer(env, ""),
            "nccl offered to trainers on this host only (--nccl_across_hosts=false; set-up "
            "timeout 20 s, transfer timeout 90 s)");
  EXPECT_EQ(DescribeNcclOffer(env, "this target was started with --nccl=false"),
            "nccl not offered: this target was started with --nccl=false");
}

// A CPU target offers no NCCL: its TargetInfo says so for other hosts too,
// and the host it compares trainers with is the one its options name.
TEST(NcclHostsRuleTest, ACpuTargetReportsNoCrossHostNccl) {
  auto model = *OpenModel("tiny-random:0");
  auto engine = *CpuEngine::Create(model.get(), 1);
  ServiceOptions options;
  options.host = {"test:host-a", "host-a"};
  TargetService service({engine.get()}, options);
  EXPECT_EQ(service.transport_env().host.id, "test:host-a");
  EXPECT_FALSE(OffersNcclAcrossHosts(service.transport_env()));
  EXPECT_EQ(SummarizeTransports(service.transport_env()), "transport grpc");
  EXPECT_EQ(DescribeNcclTransport(service.transport_env()).rfind("nccl not offered: ", 0), 0u);
  LoopbackServer served = ServeOnLoopback(&service);
  auto stub = v1::TargetService::NewStub(
      grpc::CreateChannel(served.address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::TargetInfo info;
  ASSERT_TRUE(stub->GetTargetInfo(&ctx, {}, &info).ok());
  EXPECT_FALSE(info.nccl_across_hosts());
  service.BeginDrain();
  served.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  service.StopScheduler();
  // Without an override, this machine's host.
  TargetService plain({engine.get()}, ServiceOptions{});
  EXPECT_EQ(plain.transport_env().host.id, LocalHost().id);
  plain.StopScheduler();
}

}  // namespace
}  // namespace draftfeed
