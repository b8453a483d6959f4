#include "server/service/metrics_http.h"

#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/thread_name.h"

namespace draftfeed {

absl::StatusOr<std::pair<std::string, int>> MetricsHttpServer::ParseListen(
    const std::string& listen) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_listen=", listen, " is not host:port (e.g. 0.0.0.0:9400; port 0 picks one)"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::make_pair(host, port);
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, std::function<std::string()> render) {
  auto parsed = ParseListen(listen);
  if (!parsed.ok()) return parsed.status();
  const auto& [host, port] = *parsed;
  std::unique_ptr<MetricsHttpServer> out(new MetricsHttpServer());
  out->server_ = std::make_unique<httplib::Server>();
  out->server_->Get("/metrics",
                    [render = std::move(render)](const httplib::Request&, httplib::Response& res) {
                      res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
                    });
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which a
  // second target would bind a port another already serves, and the scrapes
  // would be split between them.
  out->server_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Prometheus scrapes one request at a time; a few threads keep a slow
  // client from blocking the next scrape without taking the engines' cores.
  out->server_->new_task_queue = [] { return new httplib::ThreadPool(2); };
  if (port == 0) {
    out->port_ = out->server_->bind_to_any_port(host);
  } else if (out->server_->bind_to_port(host, port)) {
    out->port_ = port;
  } else {
    out->port_ = -1;
  }
  if (out->port_ <= 0) {
    return absl::UnavailableError(absl::StrCat("--metrics_listen=", listen,
                                               ": cannot listen there (address in use, or "
                                               "the host is not this machine's?)"));
  }
  httplib::Server* server = out->server_.get();
  auto ended = std::make_shared<std::atomic<bool>>(false);
  out->thread_ = std::thread([server, ended] {
    NameThisThread("df-metrics");
    server->listen_after_bind();
    ended->store(true);
  });
  // stop() before the loop runs would leave it listening and the destructor
  // waiting: return once it runs.
  while (!server->is_running() && !ended->load())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return out;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace draftfeed
