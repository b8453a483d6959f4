// How the client reaches targets: TLS channel credentials made once from
// FeedOptions::tls (gRPC's own, OpenSSL-backed), the name a target's
// certificate must carry, and the bearer token every call sends.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "draftfeed/client.h"

namespace draftfeed {

class ClientCredentials {
 public:
  // Reads the PEM files `tls` names and checks `token`: INVALID_ARGUMENT
  // naming the option and file for one that cannot be read or is not PEM, a
  // certificate without its key, or a token a header cannot carry.
  static absl::StatusOr<std::shared_ptr<const ClientCredentials>> Create(const TlsOptions& tls,
                                                                         std::string token);
  // Plaintext, no token: DescribeTarget(address) and tests.
  static std::shared_ptr<const ClientCredentials> Plaintext();

  bool tls() const { return tls_; }
  const std::shared_ptr<grpc::ChannelCredentials>& channel_credentials() const { return creds_; }
  // The name the certificate of the target at `address` must carry:
  // TlsOptions::server_name, else `dns_name` (the name a dns:/// target
  // resolved from, since the address is then an IP), else "" (gRPC checks
  // the address's own host).
  std::string ServerName(const std::string& dns_name) const;
  // Adds "authorization: Bearer <token>" to a call, when there is a token.
  void Authorize(grpc::ClientContext* ctx) const;
  // `s` (a failed call) with what a TLS failure in it means, and which option
  // fixes it, ahead of gRPC's own words; other failures as they are.
  absl::Status Explain(const absl::Status& s) const;

 private:
  bool tls_ = false;
  bool ca_given_ = false;
  bool has_client_cert_ = false;
  std::string server_name_;
  std::string authorization_;  // "Bearer <token>", or empty
  std::shared_ptr<grpc::ChannelCredentials> creds_;
};

}  // namespace draftfeed
