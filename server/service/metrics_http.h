// The /metrics endpoint: cpp-httplib's HTTP server on its own threads,
// answering GET /metrics with a registry's Prometheus text exposition.
//
// It faces whatever can reach its port, so each connection is bounded: only
// GET and HEAD of /metrics and /healthz are answered, a request with a body is
// refused before the body is read, a request's line and headers must arrive
// within a deadline and a byte budget, an idle kept-alive connection is closed,
// and enough workers serve that a scrape answers beside slow clients.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace draftfeed {

class TokenChecker;
class BoundedHttpServer;

struct MetricsHttpOptions {
  // Bearer tokens a request must carry ("Authorization: Bearer <token>",
  // from --metrics_token_file); null: none is asked for.
  std::shared_ptr<const TokenChecker> tokens;
  int threads = 8;                   // connections served at once
  double header_timeout_s = 2;       // a request's line and headers, from its first byte
  double idle_timeout_s = 5;         // a kept-alive connection waiting for its next request
  double write_timeout_s = 5;        // a response's writes
  size_t max_request_bytes = 16384;  // a request's line and headers
  int max_requests_per_connection = 100;
};

class MetricsHttpServer {
 public:
  // Serves GET /metrics on `listen` ("host:port", "[v6]:port"; port 0 picks a
  // free one) with the text `render` returns at each request. INVALID_ARGUMENT
  // naming --metrics_listen for an address that does not parse, UNAVAILABLE
  // for one that cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, std::function<std::string()> render,
      MetricsHttpOptions options = {});
  ~MetricsHttpServer();  // stops serving and joins the threads
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

  // The host and port of a --metrics_listen value, or INVALID_ARGUMENT
  // naming the flag: checked before the model loads.
  static absl::StatusOr<std::pair<std::string, int>> ParseListen(const std::string& listen);

  // Whether /metrics may listen on `listen`: /metrics is plaintext HTTP, so an
  // address other than loopback needs a bearer token (`token`:
  // --metrics_token_file) or a target that serves plaintext anyway
  // (`insecure`: --insecure). INVALID_ARGUMENT naming the flags otherwise.
  static absl::Status CheckExposure(const std::string& listen, bool insecure, bool token);

 private:
  MetricsHttpServer() = default;
  std::unique_ptr<BoundedHttpServer> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace draftfeed
