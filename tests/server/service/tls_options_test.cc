#include "server/service/tls_options.h"

#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace draftfeed {
namespace {

TEST(IsLoopbackListen, OnlyAddressesThatOtherHostsCannotReach) {
  for (const char* local :
       {"127.0.0.1:50051", "127.0.0.1:0", "127.1.2.3:1", "localhost:50051", "LOCALHOST:1",
        "[::1]:50051", "unix:/tmp/df.sock", "unix-abstract:df"}) {
    EXPECT_TRUE(IsLoopbackListen(local)) << local;
  }
  for (const char* remote : {"0.0.0.0:50051", "[::]:50051", ":50051", "10.0.0.5:50051",
                             "gpu-3.lab:50051", "128.0.0.1:1", "[::2]:1", "127.evil.example:1"}) {
    EXPECT_FALSE(IsLoopbackListen(remote)) << remote;
  }
}

std::string Refusal(const std::string& listen, const ListenSecurity& security) {
  auto creds = MakeServerCredentials(listen, security);
  EXPECT_FALSE(creds.ok()) << listen;
  EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(creds.status().message());
}

TEST(MakeServerCredentials, PlaintextBeyondLoopbackNeedsInsecure) {
  EXPECT_EQ(Refusal("0.0.0.0:50051", {}),
            "--listen=0.0.0.0:50051 is not a loopback address and no TLS is configured: add "
            "--tls_cert and --tls_key (and --tls_client_ca for mutual TLS), or --insecure to "
            "serve plaintext on it");
  EXPECT_TRUE(MakeServerCredentials("0.0.0.0:50051", {.insecure = true}).ok());
  EXPECT_TRUE(MakeServerCredentials("127.0.0.1:50051", {}).ok());
}

TEST(MakeServerCredentials, RefusesHalfPairsAndContradictions) {
  EXPECT_EQ(Refusal("127.0.0.1:0", {.tls_cert = "c.pem"}),
            "--tls_cert needs --tls_key (the certificate's private key)");
  EXPECT_EQ(Refusal("127.0.0.1:0", {.tls_key = "k.pem"}),
            "--tls_key needs --tls_cert (the certificate it is the key of)");
  EXPECT_EQ(Refusal("127.0.0.1:0", {.tls_client_ca = "ca.pem"}),
            "--tls_client_ca needs --tls_cert and --tls_key: client certificates are checked "
            "only over TLS");
  EXPECT_EQ(Refusal("127.0.0.1:0", {.tls_cert = "c.pem", .tls_key = "k.pem", .insecure = true}),
            "--insecure serves plaintext, but --tls_cert asks for TLS: drop one of them");
  EXPECT_EQ(Refusal("127.0.0.1:0", {.tls_cert = "/nonexistent/c.pem", .tls_key = "k.pem"}),
            "--tls_cert /nonexistent/c.pem: cannot open");
}

}  // namespace
}  // namespace draftfeed
