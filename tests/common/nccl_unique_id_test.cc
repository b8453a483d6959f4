// A real ncclUniqueId (ncclGetUniqueId needs no GPU): the interface set by
// UseNcclSocketIfname before NCCL's first use is the one NCCL's bootstrap
// listens on, and NcclUniqueIdAddress reads that address out of the id.
#include <gtest/gtest.h>

#include <string>

#include "common/nccl/nccl_peer.h"
#include "common/nccl_hosts.h"

namespace draftfeed {
namespace {

TEST(NcclUniqueIdTest, CarriesTheBootstrapAddressOfTheInterfaceAsked) {
  // The first NCCL call of this process comes after this.
  ASSERT_TRUE(UseNcclSocketIfname("lo", "the test").ok());
  auto id = NcclPeer::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_EQ(id->size(), 128u);
  const std::string address = NcclUniqueIdAddress(*id);
  ASSERT_EQ(address.rfind("127.0.0.1:", 0), 0u) << address;
  const int port = std::stoi(address.substr(10));
  EXPECT_GT(port, 0);
  EXPECT_LT(port, 65536);
  // Every id has a root of its own.
  auto other = NcclPeer::NewUniqueId();
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE(NcclUniqueIdAddress(*other), address);
}

}  // namespace
}  // namespace draftfeed
