#include "server/service/tls_options.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
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

// A certificate path that is not a small regular file is refused before it is
// read, naming the flag, the file and the limit: a FIFO used to block start-up
// forever in the read, and /dev/zero to fill memory until the kernel killed
// the target.
TEST(MakeServerCredentials, RefusesFilesThatAreNotSmallRegularFiles) {
  char dir_template[] = "/tmp/df-pem-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const std::string big = dir + "/big.pem";
  std::FILE* f = std::fopen(big.c_str(), "w");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(ftruncate(fileno(f), (1 << 20) + 1), 0);  // sparse: no disk is written
  std::fclose(f);
  EXPECT_EQ(Refusal("127.0.0.1:0", {.tls_cert = big, .tls_key = big}),
            "--tls_cert " + big + ": 1048577 bytes is over the 1048576-byte limit of a PEM file");

  const std::string fifo = dir + "/fifo.pem";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_EQ(Refusal("127.0.0.1:0", {.tls_cert = fifo, .tls_key = fifo}),
            "--tls_cert " + fifo + ": is a FIFO, not a regular file holding PEM");
  EXPECT_EQ(Refusal("127.0.0.1:0", {.tls_cert = "/dev/zero", .tls_key = "/dev/zero"}),
            "--tls_cert /dev/zero: is a character device, not a regular file holding PEM");
  EXPECT_EQ(Refusal("127.0.0.1:0", {.tls_cert = dir, .tls_key = dir}),
            "--tls_cert " + dir + ": is a directory, not a regular file holding PEM");
  std::remove(fifo.c_str());
  std::remove(big.c_str());
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace draftfeed
