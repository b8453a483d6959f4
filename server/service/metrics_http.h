// The /metrics endpoint: cpp-httplib's HTTP server on its own threads,
// answering GET /metrics with a registry's Prometheus text exposition.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}

namespace draftfeed {

class MetricsHttpServer {
 public:
  // Serves GET /metrics on `listen` ("host:port", "[v6]:port"; port 0 picks a
  // free one) with the text `render` returns at each request. INVALID_ARGUMENT
  // naming --metrics_listen for an address that does not parse, UNAVAILABLE
  // for one that cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(
      const std::string& listen, std::function<std::string()> render);
  ~MetricsHttpServer();  // stops serving and joins the thread
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }

  // The host and port of a --metrics_listen value, or INVALID_ARGUMENT
  // naming the flag: checked before the model loads.
  static absl::StatusOr<std::pair<std::string, int>> ParseListen(const std::string& listen);

 private:
  MetricsHttpServer() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace draftfeed
