#include "client/src/target_info.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <set>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "client/src/transports/grpc/grpc_stream.h"

namespace draftfeed {
namespace {

// "TRANSPORT_NCCL" -> "nccl", "ENCODING_FP8_E4M3" -> "fp8_e4m3": the names the
// client's options take. A number this client's proto lacks stays a number.
std::string WireName(const std::string& name, std::string_view prefix) {
  if (name.empty()) return "unknown";
  std::string out = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

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
  d.max_sequence_tokens = info.max_sequence_tokens() > 0 ? info.max_sequence_tokens()
                                                          : info.max_batch_tokens();
  d.batch_invariant = info.batch_invariant();
  d.numerics = info.numerics();
  d.devices.assign(info.devices().begin(), info.devices().end());
  d.layer_types.assign(info.layer_types().begin(), info.layer_types().end());
  d.dtype = info.dtype();
  for (int t : info.transports()) {
    d.transports.push_back(
        WireName(v1::Transport_Name(static_cast<v1::Transport>(t)), "TRANSPORT_"));
  }
  for (int e : info.encodings()) {
    d.encodings.push_back(WireName(v1::Encoding_Name(static_cast<v1::Encoding>(e)), "ENCODING_"));
  }
  d.nccl_across_hosts = info.nccl_across_hosts();
  d.max_credits = info.max_credits();
  d.max_capture_layers = info.max_capture_layers();
  if (info.has_target_outputs()) {
    d.target_outputs.max_top_k = info.target_outputs().max_top_k();
    d.target_outputs.max_draft_vocab = info.target_outputs().max_draft_vocab();
    for (int e : info.target_outputs().draft_probs_encodings()) {
      d.target_outputs.draft_probs_encodings.push_back(
          WireName(v1::Encoding_Name(static_cast<v1::Encoding>(e)), "ENCODING_"));
    }
  }
  if (info.has_layout()) {
    d.layout.tp = std::max(1, info.layout().tp());
    d.layout.moe_parallel = info.layout().moe_parallel();
    d.layout.rank_weight_bytes = info.layout().rank_weight_bytes();
  }
  return d;
}

absl::Status ExplainCallFailure(const grpc::Status& s, const std::string& address,
                                const std::string& call, double timeout_s) {
  const std::string& m = s.error_message();
  std::string why;
  if (m.find("Connection refused") != std::string::npos) {
    why = "connection refused (nothing listens there: is draftfeed-target running, on that port?)";
  } else if (m.find("DNS resolution failed") != std::string::npos ||
             m.find("Domain name not found") != std::string::npos ||
             m.find("Name or service not known") != std::string::npos) {
    why = "name not resolved (no such host)";
  } else if (m.find("No route to host") != std::string::npos ||
             m.find("Network is unreachable") != std::string::npos) {
    why = "host unreachable (no route to it)";
  } else if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    why = absl::StrCat("no answer within ", timeout_s,
                       "s (the host is down, firewalled, or too busy to answer)");
  }
  if (why.empty()) return FromGrpc(s, absl::StrCat("target ", address, ": ", call));
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("target ", address, ": ", why, " [", call, ": ", m, "]"));
}

absl::StatusOr<TargetDescription> QueryInfo(v1::TargetService::Stub* stub,
                                            const std::string& address, double timeout_s,
                                            const ClientCredentials& creds) {
  grpc::ClientContext ctx;
  creds.Authorize(&ctx);
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  // Fail fast: a refused connection or an unknown name ends the call at once
  // (waiting for readiness would turn both into DEADLINE_EXCEEDED after
  // `timeout_s`); the feed retries lost targets with backoff.
  ctx.set_wait_for_ready(false);
  v1::TargetInfo info;
  grpc::Status s = stub->GetTargetInfo(&ctx, v1::GetTargetInfoRequest(), &info);
  if (!s.ok()) return creds.Explain(ExplainCallFailure(s, address, "GetTargetInfo", timeout_s));
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
    return absl::UnavailableError(
        absl::StrCat("target ", target, ": name not resolved (", gai_strerror(rc), ")"));
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
  return QueryInfo(stub.get(), address, timeout_s, **creds);
}

}  // namespace draftfeed
