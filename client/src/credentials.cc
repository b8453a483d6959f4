#include "client/src/credentials.h"

#include <utility>

#include <grpcpp/security/credentials.h>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/pem_file.h"
#include "common/status_macros.h"

namespace draftfeed {
namespace {

// What the target's token file accepts (server/service/auth_tokens.h).
constexpr size_t kMaxTokenBytes = 256;

}  // namespace

absl::StatusOr<std::shared_ptr<const ClientCredentials>> ClientCredentials::Create(
    const TlsOptions& tls, std::string token) {
  auto out = std::make_shared<ClientCredentials>();
  if (!token.empty()) {
    if (token.size() > kMaxTokenBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token: ", token.size(), " characters; a target accepts at most ", kMaxTokenBytes));
    }
    for (char c : token) {
      if (c <= ' ' || c > '~') {
        return absl::InvalidArgumentError(
            "token: holds a space or a character that is not printable ASCII (a header cannot "
            "carry it)");
      }
    }
    out->authorization_ = absl::StrCat("Bearer ", token);
  }
  const bool wants_tls = tls.enabled || !tls.ca_file.empty() || !tls.cert_file.empty() ||
                         !tls.key_file.empty() || !tls.server_name.empty();
  if (!wants_tls) {
    out->creds_ = grpc::InsecureChannelCredentials();
    return out;
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return absl::InvalidArgumentError(
        tls.cert_file.empty()
            ? "tls: a key without its certificate (give both cert and key, for mutual TLS)"
            : "tls: a certificate without its key (give both cert and key, for mutual TLS)");
  }
  grpc::SslCredentialsOptions ssl;
  // Empty roots: gRPC uses the system's trust store.
  if (!tls.ca_file.empty()) {
    DF_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPemFile("tls ca_file", tls.ca_file, "CERTIFICATE"));
  }
  if (!tls.cert_file.empty()) {
    DF_ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                        ReadPemFile("tls cert_file", tls.cert_file, "CERTIFICATE"));
    DF_ASSIGN_OR_RETURN(ssl.pem_private_key,
                        ReadPemFile("tls key_file", tls.key_file, "PRIVATE KEY"));
  }
  out->tls_ = true;
  out->ca_given_ = !tls.ca_file.empty();
  out->has_client_cert_ = !tls.cert_file.empty();
  out->server_name_ = tls.server_name;
  out->creds_ = grpc::SslCredentials(ssl);
  return out;
}

std::shared_ptr<const ClientCredentials> ClientCredentials::Plaintext() {
  auto out = std::make_shared<ClientCredentials>();
  out->creds_ = grpc::InsecureChannelCredentials();
  return out;
}

std::string ClientCredentials::ServerName(const std::string& dns_name) const {
  if (!tls_) return "";
  return server_name_.empty() ? dns_name : server_name_;
}

absl::Status ClientCredentials::Explain(const absl::Status& s) const {
  const absl::string_view m = s.message();
  const bool closed = absl::StrContains(m, "Socket closed") ||
                      absl::StrContains(m, "Connection reset") ||
                      absl::StrContains(m, "Broken pipe");
  std::string why;
  if (absl::StrContains(m, "wrong version number")) {
    why =
        "TLS handshake failed: the target does not speak TLS (it was started without "
        "--tls_cert); connect without tls";
  } else if (absl::StrContains(m, "certificate verify failed")) {
    why = absl::StrCat(
        "TLS: the target's certificate was refused: it does not chain to ",
        ca_given_ ? "the CA of tls ca_file" : "a CA of the system's trust store (give tls ca_file)",
        ", or it has expired or is not yet valid");
  } else if (absl::StrContains(m, "not in peer certificate")) {
    why =
        "TLS: the target's certificate does not name the host connected to (give tls "
        "server_name: the name it carries)";
  } else if (closed && tls_) {
    why = has_client_cert_
              ? "the target closed the connection in the TLS handshake: it refused this "
                "client's certificate (not signed by its --tls_client_ca, or expired)"
              : "the target closed the connection in the TLS handshake: it requires a client "
                "certificate (mutual TLS: give tls cert_file and key_file)";
  } else if (closed) {
    why =
        "the target closed the connection: it may serve TLS only (started with --tls_cert); "
        "connect with tls";
  }
  if (why.empty()) return s;
  return absl::Status(s.code(), absl::StrCat(why, " [", m, "]"));
}

void ClientCredentials::Authorize(grpc::ClientContext* ctx) const {
  if (!authorization_.empty()) ctx->AddMetadata("authorization", authorization_);
}

}  // namespace draftfeed
