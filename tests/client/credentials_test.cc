#include "client/src/credentials.h"

#include <grpcpp/grpcpp.h>

#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "client/src/target_info.h"
#include "gtest/gtest.h"

namespace draftfeed {
namespace {

std::string Refusal(const TlsOptions& tls, const std::string& token = "") {
  auto creds = ClientCredentials::Create(tls, token);
  EXPECT_FALSE(creds.ok());
  EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(creds.status().message());
}

std::string TempFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(ClientCredentials, PlaintextWithoutTlsOptionsTlsWithAny) {
  auto plain = ClientCredentials::Create(TlsOptions(), "");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE((*plain)->tls());
  auto system_roots = ClientCredentials::Create(TlsOptions{.enabled = true}, "");
  ASSERT_TRUE(system_roots.ok()) << system_roots.status();
  EXPECT_TRUE((*system_roots)->tls());
  auto named = ClientCredentials::Create(TlsOptions{.server_name = "gpu-3.lab"}, "");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_TRUE((*named)->tls());
  EXPECT_EQ((*named)->ServerName("targets.svc"), "gpu-3.lab");  // the option wins
  EXPECT_EQ((*system_roots)->ServerName("targets.svc"), "targets.svc");
  EXPECT_EQ((*plain)->ServerName("targets.svc"), "");
}

TEST(ClientCredentials, RefusesUnreadableOrWrongPemAndHalfPairs) {
  EXPECT_EQ(Refusal({.ca_file = "/nonexistent/ca.pem"}),
            "tls ca_file /nonexistent/ca.pem: cannot open");
  const std::string key = TempFile("key.pem",
                                   "-----BEGIN PRIVATE KEY-----\nAAAA\n"
                                   "-----END PRIVATE KEY-----\n");
  EXPECT_EQ(Refusal({.ca_file = key}),
            "tls ca_file " + key + ": no PEM '-----BEGIN ...CERTIFICATE-----' block in it");
  EXPECT_EQ(Refusal({.cert_file = key}),
            "tls: a certificate without its key (give both cert and key, for mutual TLS)");
  EXPECT_EQ(Refusal({.key_file = key}),
            "tls: a key without its certificate (give both cert and key, for mutual TLS)");
}

TEST(ClientCredentials, RefusesATokenAHeaderCannotCarry) {
  EXPECT_EQ(Refusal({}, "has space"),
            "token: holds a space or a character that is not printable ASCII (a header cannot "
            "carry it)");
  EXPECT_EQ(Refusal({}, "tab\there"),
            "token: holds a space or a character that is not printable ASCII (a header cannot "
            "carry it)");
  EXPECT_EQ(Refusal({}, std::string(300, 'x')),
            "token: 300 characters; a target accepts at most 256");
}

TEST(ClientCredentials, ExplainsTlsFailuresAndLeavesOthersAlone) {
  auto tls = *ClientCredentials::Create(TlsOptions{.enabled = true}, "");
  auto plain = *ClientCredentials::Create(TlsOptions(), "");
  const absl::Status verify = absl::UnavailableError(
      "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Ssl handshake "
      "failed: SSL_ERROR_SSL: error:0A000086:SSL routines::certificate verify failed");
  const absl::Status explained = tls->Explain(verify);
  EXPECT_EQ(explained.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(std::string(explained.message()),
            "TLS: the target's certificate was refused: it does not chain to a CA of the "
            "system's trust store (give tls ca_file), or it has expired or is not yet valid [" +
                std::string(verify.message()) + "]");
  const absl::Status closed = absl::UnavailableError("ipv4:127.0.0.1:1: Socket closed");
  EXPECT_EQ(
      std::string(tls->Explain(closed).message())
          .rfind("the target closed the connection in the TLS handshake: it requires a client "
                 "certificate",
                 0),
      0u);
  EXPECT_EQ(std::string(plain->Explain(closed).message())
                .rfind("the target closed the connection: it may serve TLS only", 0),
            0u);
  const absl::Status refused = absl::UnavailableError("Connection refused");
  EXPECT_EQ(tls->Explain(refused), refused);
}

TEST(DnsNameOf, TheNameOfADnsTargetOnly) {
  EXPECT_EQ(DnsNameOf("dns:///draftfeed-targets.ns.svc.cluster.local:50051"),
            "draftfeed-targets.ns.svc.cluster.local");
  EXPECT_EQ(DnsNameOf("10.0.0.5:50051"), "");
  EXPECT_EQ(DnsNameOf("gpu-3.lab:50051"), "");
}

}  // namespace
}  // namespace draftfeed
