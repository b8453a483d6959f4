#include "server/service/tls_options.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <utility>

#include <grpcpp/security/server_credentials.h>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/pem_file.h"
#include "common/status_macros.h"

namespace draftfeed {
namespace {

absl::string_view HostOf(absl::string_view listen) {
  if (!listen.empty() && listen.front() == '[') {
    const size_t close = listen.find(']');
    return close == absl::string_view::npos ? listen : listen.substr(1, close - 1);
  }
  const size_t colon = listen.rfind(':');
  // More than one colon without brackets: a bare IPv6 address, no port.
  if (colon != absl::string_view::npos && listen.find(':') == colon) {
    return listen.substr(0, colon);
  }
  return listen;
}

}  // namespace

std::string ListenSecurity::Describe() const {
  if (!tls()) return "plaintext";
  return tls_client_ca.empty() ? "TLS" : "mutual TLS";
}

bool IsLoopbackListen(absl::string_view listen) {
  if (absl::StartsWith(listen, "unix:") || absl::StartsWith(listen, "unix-abstract:")) return true;
  const std::string host = absl::AsciiStrToLower(HostOf(listen));
  if (host == "localhost") return true;
  // Addresses, not names that merely look like them ("127.x.example").
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  return inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& listen, const ListenSecurity& security) {
  const bool cert = !security.tls_cert.empty();
  const bool key = !security.tls_key.empty();
  if (cert != key) {
    return absl::InvalidArgumentError(
        cert ? "--tls_cert needs --tls_key (the certificate's private key)"
             : "--tls_key needs --tls_cert (the certificate it is the key of)");
  }
  if (!cert) {
    if (!security.tls_client_ca.empty()) {
      return absl::InvalidArgumentError(
          "--tls_client_ca needs --tls_cert and --tls_key: client certificates are checked "
          "only over TLS");
    }
    if (!security.insecure && !IsLoopbackListen(listen)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen=", listen,
          " is not a loopback address and no TLS is configured: add --tls_cert and --tls_key "
          "(and --tls_client_ca for mutual TLS), or --insecure to serve plaintext on it"));
    }
    return grpc::InsecureServerCredentials();
  }
  if (security.insecure) {
    return absl::InvalidArgumentError(
        "--insecure serves plaintext, but --tls_cert asks for TLS: drop one of them");
  }
  grpc::SslServerCredentialsOptions options(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  DF_ASSIGN_OR_RETURN(pair.cert_chain, ReadPemFile("--tls_cert", security.tls_cert, "CERTIFICATE"));
  DF_ASSIGN_OR_RETURN(pair.private_key, ReadPemFile("--tls_key", security.tls_key, "PRIVATE KEY"));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  if (!security.tls_client_ca.empty()) {
    DF_ASSIGN_OR_RETURN(options.pem_root_certs,
                        ReadPemFile("--tls_client_ca", security.tls_client_ca, "CERTIFICATE"));
    options.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(options);
}

}  // namespace draftfeed
