// The credentials a target listens with, from its flags: TLS from PEM files
// (gRPC's own OpenSSL-backed credentials), mutual TLS with a client CA, or
// plaintext, which a non-loopback address gets only when asked for by name.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/security/server_credentials.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace draftfeed {

struct ListenSecurity {
  std::string tls_cert;       // PEM certificate chain (--tls_cert)
  std::string tls_key;        // its PEM private key (--tls_key)
  std::string tls_client_ca;  // PEM CA(s) client certificates must chain to (--tls_client_ca)
  bool insecure = false;      // plaintext on a non-loopback address (--insecure)

  bool tls() const { return !tls_cert.empty(); }
  // "plaintext", "TLS" or "mutual TLS", for the start-up line.
  std::string Describe() const;
};

// Whether gRPC listening on `listen` accepts connections from this host only:
// 127.0.0.0/8, ::1, localhost, or a unix socket.
bool IsLoopbackListen(absl::string_view listen);

// Credentials for a server on `listen`. INVALID_ARGUMENT naming the flag to
// add or drop: half a certificate/key pair, a client CA without TLS, TLS with
// --insecure, plaintext on a non-loopback address without --insecure, or a
// file that cannot be read or holds no PEM block of the kind the flag wants.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const std::string& listen, const ListenSecurity& security);

}  // namespace draftfeed
