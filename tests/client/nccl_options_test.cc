// The feed's NCCL options are checked when it opens, in every build, each
// refusal naming its field (no target is needed: nothing connects first).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "draftfeed/client.h"

namespace draftfeed {
namespace {

FeedOptions Options(Transport transport) {
  FeedOptions opt;
  opt.targets = {"127.0.0.1:1"};  // never reached
  opt.layers = {0};
  opt.transport = transport;
  opt.connect_timeout_s = 0.5;
  return opt;
}

void ExpectRefused(const FeedOptions& opt, const std::string& names) {
  absl::StatusOr<std::unique_ptr<Feed>> feed = Feed::Open(opt);
  ASSERT_FALSE(feed.ok());
  EXPECT_EQ(feed.status().code(), absl::StatusCode::kInvalidArgument) << feed.status();
  EXPECT_NE(feed.status().message().find(names), std::string::npos) << feed.status();
}

TEST(NcclOptionsTest, DefaultsKeepAutoOnOneHost) {
  const FeedOptions opt;
  EXPECT_FALSE(opt.nccl_across_hosts);
  EXPECT_TRUE(opt.nccl_socket_ifname.empty());
  EXPECT_EQ(opt.nccl_setup_timeout_s, 60.0);
  EXPECT_EQ(opt.nccl_timeout_s, 120.0);
}

TEST(NcclOptionsTest, TimeoutsMustBeFinitePositiveSeconds) {
  for (Transport t : {Transport::kGrpc, Transport::kNccl, Transport::kAuto}) {
    for (double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
      FeedOptions opt = Options(t);
      opt.nccl_setup_timeout_s = bad;
      ExpectRefused(opt, "FeedOptions.nccl_setup_timeout_s must be a finite number of seconds");
      opt = Options(t);
      opt.nccl_timeout_s = bad;
      ExpectRefused(opt, "FeedOptions.nccl_timeout_s must be a finite number of seconds");
    }
  }
}

TEST(NcclOptionsTest, NcclOptionsWithGrpcAreRefused) {
  FeedOptions opt = Options(Transport::kGrpc);
  opt.nccl_across_hosts = true;
  ExpectRefused(opt, "FeedOptions.nccl_across_hosts is set but FeedOptions.transport is grpc");
  opt = Options(Transport::kGrpc);
  opt.nccl_socket_ifname = "eth0";
  ExpectRefused(opt,
                "FeedOptions.nccl_socket_ifname=eth0 is set but FeedOptions.transport is grpc");
}

TEST(NcclOptionsTest, AnInterfaceNcclCannotMeanIsRefused) {
  for (Transport t : {Transport::kNccl, Transport::kAuto}) {
    FeedOptions opt = Options(t);
    opt.nccl_socket_ifname = "eth 0";
    ExpectRefused(opt, "FeedOptions.nccl_socket_ifname='eth 0' has whitespace");
  }
}

TEST(NcclOptionsTest, AcrossHostsWithAutoPassesTheOptionChecks) {
  // What fails next is the receiving GPU (none named here) or a build
  // without NCCL, never the cross-host options.
  FeedOptions opt = Options(Transport::kAuto);
  opt.nccl_across_hosts = true;
  opt.nccl_setup_timeout_s = 5;
  absl::StatusOr<std::unique_ptr<Feed>> feed = Feed::Open(opt);
  ASSERT_FALSE(feed.ok());
  EXPECT_TRUE(feed.status().message().find("cuda_device") != std::string::npos ||
              feed.status().message().find("without NCCL") != std::string::npos)
      << feed.status();
}

}  // namespace
}  // namespace draftfeed
