#include "server/service/metrics_http.h"

#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/thread_name.h"
#include "server/service/auth_tokens.h"
#include "server/service/tls_options.h"

namespace draftfeed {
namespace {

using Clock = std::chrono::steady_clock;

Clock::duration Seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

// Set by the pre-routing handler when it refuses a request: the connection
// is closed after the answer (a refused body is never read, so what follows
// on the connection is not a request). The handler runs on the worker that
// serves the connection.
thread_local bool close_after_answer = false;

// One connection's socket as cpp-httplib reads requests from it, with the
// bounds its own socket stream lacks (0.11 reads a request line or header
// of any length, and a client that sends a byte now and then holds a worker
// forever): each request's line and headers get a byte budget and a
// deadline, and every wait ends when the server stops.
class BoundedStream final : public httplib::Stream {
 public:
  BoundedStream(int sock, const MetricsHttpOptions& options, const std::atomic<bool>* stopping)
      : sock_(sock), options_(options), stopping_(stopping) {}

  // Waits up to `timeout` for the first byte of the next request.
  bool WaitForRequest(Clock::duration timeout) {
    return pos_ < end_ || Wait(POLLIN, Clock::now() + timeout);
  }
  // The next request's line and headers must arrive from now within the
  // header deadline and byte budget.
  void BeginRequest() {
    deadline_ = Clock::now() + Seconds(options_.header_timeout_s);
    budget_ = options_.max_request_bytes;
  }

  bool is_readable() const override { return pos_ < end_; }
  bool is_writable() const override {
    return const_cast<BoundedStream*>(this)->Wait(
        POLLOUT, Clock::now() + Seconds(options_.write_timeout_s));
  }

  ssize_t read(char* ptr, size_t size) override {
    if (pos_ == end_) {
      if (budget_ == 0 || !Wait(POLLIN, deadline_)) return -1;
      ssize_t n;
      do {
        n = recv(sock_, buf_, std::min(sizeof(buf_), budget_), 0);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      budget_ -= static_cast<size_t>(n);
      pos_ = 0;
      end_ = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, end_ - pos_);
    std::memcpy(ptr, buf_ + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    const Clock::time_point deadline = Clock::now() + Seconds(options_.write_timeout_s);
    size_t sent = 0;
    while (sent < size) {
      if (!Wait(POLLOUT, deadline)) return -1;
      const ssize_t n = send(sock_, ptr + sent, size - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return -1;
      sent += static_cast<size_t>(n);
    }
    return static_cast<ssize_t>(sent);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    Address(getpeername, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    Address(getsockname, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  // Polls in slices of 100 ms so that a stopping server is not kept waiting.
  bool Wait(short events, Clock::time_point deadline) {
    for (;;) {
      if (stopping_->load()) return false;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{.fd = sock_, .events = events, .revents = 0};
      const int r = poll(&p, 1, static_cast<int>(std::min<long long>(left, 100)));
      if (r > 0) return (p.revents & (events | POLLHUP | POLLERR)) != 0;
      if (r < 0 && errno != EINTR) return false;
    }
  }

  template <typename Get>
  void Address(Get get, std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    ip.clear();
    port = 0;
    if (get(sock_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return;
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host), serv,
                    sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host;
      (void)absl::SimpleAtoi(serv, &port);
    }
  }

  const int sock_;
  const MetricsHttpOptions& options_;
  const std::atomic<bool>* const stopping_;
  char buf_[4096];
  size_t pos_ = 0, end_ = 0;
  size_t budget_ = 0;
  Clock::time_point deadline_{};
};

}  // namespace

// cpp-httplib's server with its connection loop replaced by one over a
// BoundedStream (httplib's listen loop calls process_and_close_socket for
// every accepted connection, on a worker of the task queue).
class BoundedHttpServer final : public httplib::Server {
 public:
  explicit BoundedHttpServer(MetricsHttpOptions options) : options_(std::move(options)) {}
  void Stop() {
    stopping_ = true;
    stop();
  }
  const MetricsHttpOptions& options() const { return options_; }

 private:
  bool process_and_close_socket(socket_t sock) override {
    BoundedStream stream(sock, options_, &stopping_);
    for (int i = 0; i < options_.max_requests_per_connection; ++i) {
      // A new connection's first request is due at once; a kept-alive one
      // may wait for the next scrape.
      if (!stream.WaitForRequest(
              Seconds(i == 0 ? options_.header_timeout_s : options_.idle_timeout_s))) {
        break;
      }
      stream.BeginRequest();
      close_after_answer = false;
      bool closed = false;
      const bool last = i + 1 == options_.max_requests_per_connection;
      if (!process_request(stream, last, closed, [](httplib::Request&) {})) break;
      if (closed || close_after_answer) break;
    }
    shutdown(sock, SHUT_RDWR);
    close(sock);
    return true;
  }

  const MetricsHttpOptions options_;
  std::atomic<bool> stopping_{false};
};

namespace {

// Answers what is not a scrape before its body (if any) is read; nullopt
// lets the request through to its handler.
std::optional<int> Refuse(const MetricsHttpOptions& options, const httplib::Request& req,
                          httplib::Response& res) {
  auto refuse = [&](int status, const std::string& why) {
    res.status = status;
    res.set_header("Connection", "close");
    res.set_content(why + "\n", "text/plain; charset=utf-8");
    close_after_answer = true;
    return status;
  };
  if (req.method != "GET" && req.method != "HEAD") {
    res.set_header("Allow", "GET, HEAD");
    return refuse(405, "only GET /metrics and GET /healthz are served");
  }
  const std::string length = req.get_header_value("Content-Length");
  if (req.has_header("Transfer-Encoding") || (!length.empty() && length != "0")) {
    return refuse(413, "a request body is not accepted here");
  }
  if (options.tokens != nullptr) {
    const std::string value = req.get_header_value("Authorization");
    std::optional<absl::string_view> authorization;
    if (req.has_header("Authorization")) authorization = value;
    if (absl::StatusOr<std::string> who = options.tokens->Authenticate(authorization); !who.ok()) {
      res.set_header("WWW-Authenticate", "Bearer realm=\"draftfeed-metrics\"");
      return refuse(401, absl::StrCat(who.status().message(), " (--metrics_token_file)"));
    }
  }
  return std::nullopt;
}

}  // namespace

absl::StatusOr<std::pair<std::string, int>> MetricsHttpServer::ParseListen(
    const std::string& listen) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_listen=", listen, " is not host:port (e.g. 127.0.0.1:9400; port 0 picks one)"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return std::make_pair(host, port);
}

absl::Status MetricsHttpServer::CheckExposure(const std::string& listen, bool insecure,
                                              bool token) {
  if (IsLoopbackListen(listen) || insecure || token) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--metrics_listen=", listen,
      " is not a loopback address and /metrics is plaintext HTTP: add --metrics_token_file "
      "(a bearer token every scrape must carry), or --insecure on a target that serves "
      "plaintext anyway"));
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, std::function<std::string()> render, MetricsHttpOptions options) {
  auto parsed = ParseListen(listen);
  if (!parsed.ok()) return parsed.status();
  const auto& [host, port] = *parsed;
  std::unique_ptr<MetricsHttpServer> out(new MetricsHttpServer());
  const int threads = std::max(1, options.threads);
  out->server_ = std::make_unique<BoundedHttpServer>(std::move(options));
  BoundedHttpServer* server = out->server_.get();
  server->set_pre_routing_handler([server](const httplib::Request& req, httplib::Response& res) {
    return Refuse(server->options(), req, res).has_value()
               ? httplib::Server::HandlerResponse::Handled
               : httplib::Server::HandlerResponse::Unhandled;
  });
  server->Get("/metrics",
              [render = std::move(render)](const httplib::Request&, httplib::Response& res) {
                res.set_content(render(), "text/plain; version=0.0.4; charset=utf-8");
              });
  server->Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain; charset=utf-8");
  });
  // A body that got past the pre-routing check would still not be read.
  server->set_payload_max_length(0);
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, with which a
  // second target would bind a port another already serves, and the scrapes
  // would be split between them.
  server->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // One worker per connection: enough that a scrape is answered beside a few
  // slow clients (each is cut at its header deadline), few enough not to
  // take the engines' cores.
  server->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  if (port == 0) {
    out->port_ = server->bind_to_any_port(host);
  } else if (server->bind_to_port(host, port)) {
    out->port_ = port;
  } else {
    out->port_ = -1;
  }
  if (out->port_ <= 0) {
    return absl::UnavailableError(absl::StrCat("--metrics_listen=", listen,
                                               ": cannot listen there (address in use, or "
                                               "the host is not this machine's?)"));
  }
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
  if (server_ != nullptr) server_->Stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace draftfeed
