#include "client/src/target_info.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <chrono>
#include <set>

#include "absl/strings/str_cat.h"
#include "client/src/grpc_stream.h"

namespace draftfeed {

TargetDescription Describe(const std::string& address, const v1::TargetInfo& info) {
  TargetDescription d;
  d.address = address;
  d.model_id = info.model_id();
  d.architecture = info.architecture();
  d.fingerprint = info.fingerprint();
  d.server_version = info.server_version();
  d.num_layers = info.num_layers();
  d.hidden_size = info.hidden_size();
  d.vocab_size = info.vocab_size();
  d.max_batch_tokens = info.max_batch_tokens();
  d.devices.assign(info.devices().begin(), info.devices().end());
  d.layer_types.assign(info.layer_types().begin(), info.layer_types().end());
  return d;
}

absl::StatusOr<TargetDescription> QueryInfo(v1::TargetService::Stub* stub,
                                            const std::string& address, double timeout_s,
                                            bool wait_for_ready, const ClientCredentials& creds) {
  grpc::ClientContext ctx;
  creds.Authorize(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  ctx.set_wait_for_ready(wait_for_ready);
  v1::TargetInfo info;
  grpc::Status s = stub->GetTargetInfo(&ctx, v1::GetTargetInfoRequest(), &info);
  if (!s.ok())
    return creds.Explain(FromGrpc(s, absl::StrCat("target ", address, ": GetTargetInfo")));
  return Describe(address, info);
}

std::string DnsNameOf(const std::string& target) {
  constexpr std::string_view kDns = "dns:///";
  if (target.rfind(kDns, 0) != 0) return "";
  const std::string rest = target.substr(kDns.size());
  return rest.substr(0, rest.rfind(':'));
}

absl::StatusOr<std::vector<std::string>> ExpandTarget(const std::string& target) {
  constexpr std::string_view kDns = "dns:///";
  if (target.rfind(kDns, 0) != 0) return std::vector<std::string>{target};
  const std::string rest = target.substr(kDns.size());
  const size_t colon = rest.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("target ", target, " has no :port"));
  }
  const std::string host = rest.substr(0, colon);
  const std::string port = rest.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", target, ": ", gai_strerror(rc)));
  }
  std::set<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, buf, sizeof buf);
      out.insert(absl::StrCat(buf, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, buf, sizeof buf);
      out.insert(absl::StrCat("[", buf, "]:", port));
    }
  }
  freeaddrinfo(res);
  return std::vector<std::string>(out.begin(), out.end());
}

absl::StatusOr<TargetDescription> DescribeTarget(const std::string& address, double timeout_s) {
  return DescribeTarget(address, TlsOptions(), "", timeout_s);
}

absl::StatusOr<TargetDescription> DescribeTarget(const std::string& address, const TlsOptions& tls,
                                                 const std::string& token, double timeout_s) {
  absl::StatusOr<std::shared_ptr<const ClientCredentials>> creds =
      ClientCredentials::Create(tls, token);
  if (!creds.ok()) return creds.status();
  auto stub = v1::TargetService::NewStub(MakeChannel(address, **creds));
  return QueryInfo(stub.get(), address, timeout_s, /*wait_for_ready=*/true, **creds);
}

}  // namespace draftfeed
