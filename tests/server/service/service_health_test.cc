// grpc.health.v1.Health: the target answers for "draftfeed.v1.TargetService"
// (and "", the server as a whole), SERVING until it drains, then NOT_SERVING;
// in-process and from the draftfeed-target binary.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>

#include "absl/status/statusor.h"
#include "tests/server/service/loopback_target.h"
#include "tests/server/service/target_process.h"

namespace draftfeed {
namespace {

using Server = testing::LoopbackTarget;

constexpr char kTargetService[] = "draftfeed.v1.TargetService";
// grpc.health.v1.HealthCheckResponse.ServingStatus
constexpr int kServing = 1, kNotServing = 2;

// One /grpc.health.v1.Health/Check call, encoded by hand (field 1 of the
// request is the service name, field 1 of the response the status varint):
// the generated health stubs are not part of the system gRPC.
absl::StatusOr<int> HealthCheck(const std::string& address, const std::string& service) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  std::string request;
  if (!service.empty()) {
    request.push_back('\x0a');
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &req, &resp,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  const grpc::Status st = done.get_future().get();
  if (!st.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  }
  std::vector<grpc::Slice> slices;
  if (!resp.Dump(&slices).ok()) return absl::InternalError("unreadable health response");
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (bytes.empty()) return 0;  // UNKNOWN, the default value
  if (bytes.size() != 2 || bytes[0] != '\x08') {
    return absl::InternalError("unexpected health response encoding");
  }
  return static_cast<int>(bytes[1]);
}

TEST(HealthTest, ServingUntilTheDrainThenNotServing) {
  Server server;
  auto named = HealthCheck(server.address(), kTargetService);
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(*named, kServing);
  auto whole = HealthCheck(server.address(), "");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(*whole, kServing);
  auto other = HealthCheck(server.address(), "draftfeed.v1.NoSuchService");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kNotFound) << other.status();

  // Step 1 of the shutdown: the server still answers, and says not to send
  // new streams here.
  server.service().BeginDrain();
  named = HealthCheck(server.address(), kTargetService);
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(*named, kNotServing);
  whole = HealthCheck(server.address(), "");
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(*whole, kNotServing);
}

// The binary registers the same health service; SIGTERM then stops it cleanly.
TEST(HealthTest, TargetBinaryAnswersServing) {
  testing::TargetProcess target({}, "service_health_test");
  ASSERT_FALSE(target.address().empty()) << "draftfeed-target did not start";
  auto named = HealthCheck(target.address(), kTargetService);
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(*named, kServing);
  const int status = target.Terminate();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

}  // namespace
}  // namespace draftfeed
