// Host identity, NCCL's interface setting and the unique id's bootstrap
// address: what both NCCL sides decide and say without NCCL itself.
#include "common/nccl_hosts.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace draftfeed {
namespace {

// Restores an environment variable when it goes out of scope.
class EnvVar {
 public:
  EnvVar(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    had_ = std::getenv(name) != nullptr;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ~EnvVar() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(LocalHostTest, IsTheBootIdOrHostnameAndTheOverrideWins) {
  EnvVar unset("DRAFTFEED_HOST_ID", nullptr);
  const HostIdentity here = LocalHost();
  EXPECT_TRUE(here.id.rfind("boot:", 0) == 0 || here.id.rfind("host:", 0) == 0) << here.id;
  EXPECT_GT(here.id.size(), 5u);
  EXPECT_FALSE(here.name.empty());
  EXPECT_EQ(LocalHost().id, here.id);  // stable within a boot
  {
    EnvVar forced("DRAFTFEED_HOST_ID", "rack7-node3");
    const HostIdentity other = LocalHost();
    EXPECT_EQ(other.id, "env:rack7-node3");
    EXPECT_EQ(other.name, "rack7-node3");
    EXPECT_NE(other.id, here.id);
  }
  EnvVar empty("DRAFTFEED_HOST_ID", "");  // empty is no override
  EXPECT_EQ(LocalHost().id, here.id);
}

TEST(NcclSocketIfnameTest, RejectsWhitespaceNamingTheOption) {
  EXPECT_TRUE(CheckNcclSocketIfname("", "--nccl_socket_ifname").ok());
  EXPECT_TRUE(CheckNcclSocketIfname("^docker,lo", "--nccl_socket_ifname").ok());
  EXPECT_TRUE(CheckNcclSocketIfname("=eth0", "--nccl_socket_ifname").ok());
  for (const char* bad : {"eth 0", "eth0\n", "\teth0"}) {
    absl::Status s = CheckNcclSocketIfname(bad, "FeedOptions.nccl_socket_ifname");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("FeedOptions.nccl_socket_ifname='"), std::string::npos) << s;
    EXPECT_NE(s.message().find("whitespace"), std::string::npos) << s;
  }
}

TEST(NcclSocketIfnameTest, SetsTheEnvironmentOnceAndRefusesAnotherValue) {
  EnvVar unset("NCCL_SOCKET_IFNAME", nullptr);
  EXPECT_NE(DescribeNcclSocketIfname().find("unset"), std::string::npos);
  ASSERT_TRUE(UseNcclSocketIfname("", "--nccl_socket_ifname").ok());
  EXPECT_EQ(std::getenv("NCCL_SOCKET_IFNAME"), nullptr);  // empty leaves NCCL's choice
  ASSERT_TRUE(UseNcclSocketIfname("eth1", "--nccl_socket_ifname").ok());
  ASSERT_NE(std::getenv("NCCL_SOCKET_IFNAME"), nullptr);
  EXPECT_STREQ(std::getenv("NCCL_SOCKET_IFNAME"), "eth1");
  EXPECT_EQ(DescribeNcclSocketIfname(), "NCCL_SOCKET_IFNAME=eth1");
  EXPECT_TRUE(UseNcclSocketIfname("eth1", "FeedOptions.nccl_socket_ifname").ok());  // the same
  absl::Status other = UseNcclSocketIfname("ib0", "FeedOptions.nccl_socket_ifname");
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.message().find("FeedOptions.nccl_socket_ifname=ib0"), std::string::npos) << other;
  EXPECT_NE(other.message().find("NCCL_SOCKET_IFNAME=eth1"), std::string::npos) << other;
  EXPECT_STREQ(std::getenv("NCCL_SOCKET_IFNAME"), "eth1");  // unchanged
  EXPECT_EQ(UseNcclSocketIfname("ib 0", "x").code(), absl::StatusCode::kInvalidArgument);
}

// An ncclUniqueId as NCCL lays out its bootstrap handle: 8 bytes of magic,
// then the root's sockaddr.
std::string UniqueIdWith(const void* addr, size_t bytes) {
  std::string id(128, '\0');
  const uint64_t magic = 0x0123456789abcdefULL;
  std::memcpy(id.data(), &magic, sizeof(magic));
  std::memcpy(id.data() + 8, addr, bytes);
  return id;
}

TEST(NcclUniqueIdAddressTest, ReadsTheBootstrapAddress) {
  sockaddr_in in4{};
  in4.sin_family = AF_INET;
  in4.sin_port = htons(41234);
  ASSERT_EQ(inet_pton(AF_INET, "10.1.2.3", &in4.sin_addr), 1);
  EXPECT_EQ(NcclUniqueIdAddress(UniqueIdWith(&in4, sizeof(in4))), "10.1.2.3:41234");

  sockaddr_in6 in6{};
  in6.sin6_family = AF_INET6;
  in6.sin6_port = htons(5000);
  ASSERT_EQ(inet_pton(AF_INET6, "fe80::1", &in6.sin6_addr), 1);
  EXPECT_EQ(NcclUniqueIdAddress(UniqueIdWith(&in6, sizeof(in6))), "[fe80::1]:5000");

  // Not a handle NCCL made: no address rather than a made-up one.
  EXPECT_EQ(NcclUniqueIdAddress(std::string(128, '\x01')), "");
  EXPECT_EQ(NcclUniqueIdAddress(std::string(127, '\0')), "");
  in4.sin_port = 0;
  EXPECT_EQ(NcclUniqueIdAddress(UniqueIdWith(&in4, sizeof(in4))), "");
}

TEST(NcclSetupHintTest, AcrossHostsNamesTheInterfaceAndTheBootstrap) {
  EnvVar set("NCCL_SOCKET_IFNAME", "eth2");
  EXPECT_EQ(NcclSetupHint(false, "10.1.2.3:41234"), "the other process never joined or stopped");
  const std::string across = NcclSetupHint(true, "10.1.2.3:41234");
  EXPECT_EQ(across.rfind("check NCCL_SOCKET_IFNAME=eth2", 0), 0u) << across;
  EXPECT_NE(across.find("ephemeral ports"), std::string::npos) << across;
  EXPECT_NE(across.find("the trainer's NCCL bootstrap is at 10.1.2.3:41234"), std::string::npos)
      << across;
  EXPECT_EQ(NcclSetupHint(true, "").find("bootstrap is at"), std::string::npos);
}

}  // namespace
}  // namespace draftfeed
