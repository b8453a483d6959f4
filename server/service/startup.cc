#include "server/service/startup.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string_view>
#include <vector>

#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/model/model.h"
#include "server/service/flags_help.h"
#include "server/service/version.h"

namespace draftfeed {
namespace {

bool IsTargetFlagFile(absl::string_view file) { return file == kTargetFlagsFile; }

// --help's groups, by what a reader starting a target looks for. A flag
// added to the target without a place here shows under "Other flags" (and
// fails tests/server/service/test_target_help.py).
std::vector<FlagGroup> TargetFlagGroups() {
  return {
      {"Model (what is served)", {"model", "quantize", "check_weights", "print_plan"}},
      {"Serving (address, streams, transports)",
       {"listen", "port_file", "default_credits", "chunk_bytes", "drain_timeout_s",
        "throttle_tokens_per_s", "nccl", "nccl_across_hosts", "nccl_socket_ifname",
        "nccl_timeout_s", "nccl_setup_timeout_s"}},
      {"Security (TLS, bearer tokens)", {"tls_cert", "tls_key", "tls_client_ca", "auth_tokens_file", "insecure"}},
      {"Limits (batches, queues, memory, idle streams)",
       {"max_batch_tokens", "max_sequence_tokens", "max_capture_layers", "max_credits",
        "max_queued_batches", "max_streams", "max_stream_pending_mib", "host_memory_cap_gib",
        "max_streams_per_client", "open_timeout_s", "max_rejects_per_s",
        "stream_idle_timeout_s"}},
      {"GPU and CPU (devices, threads, parallelism, FP8 kernels)",
       {"device", "devices", "threads", "tp", "moe_parallel", "load_threads", "fp8_experts",
        "fp8_gemm"}},
      {"Observability (metrics, logs)",
       {"metrics_listen", "metrics_token_file", "metrics_per_stream", "log_every_s"}},
  };
}

std::string Errno(int e) { return std::strerror(e); }

}  // namespace

std::string NormalizeFlagFile(absl::string_view path) {
  // Every flag of the target is defined under server/; others (absl's own)
  // keep their names.
  if (path.find("server/") != absl::string_view::npos) return std::string(kTargetFlagsFile);
  return std::string(path);
}

std::string TargetHelp() {
  std::string out = absl::StrCat("draftfeed-target ", std::string(kDraftfeedVersion), ": ",
                                 std::string(absl::ProgramUsageMessage()), "\n\n");
  absl::StrAppend(&out, "Models (--model):\n");
  std::vector<std::pair<std::string, std::string>> models = {
      {"DIR",
       "a Hugging Face checkpoint directory: config.json (qwen3_5, qwen3, their _moe and "
       "_text forms) and model.safetensors or a sharded model.safetensors.index.json"}};
  for (BuiltinModel& m : BuiltinModels()) models.emplace_back(m.spec, m.description);
  size_t name_width = 0;
  for (const auto& [spec, what] : models) name_width = std::max(name_width, spec.size());
  for (const auto& [spec, what] : models) {
    const std::string lead =
        absl::StrCat("  ", spec, std::string(name_width + 2 - spec.size(), ' '));
    std::string body = WrapText(what, lead.size());
    absl::StrAppend(&out, lead, body.substr(lead.size()));
  }
  absl::StrAppend(&out, "\nFlags (--name=value), by purpose:\n\n",
                  FlagsHelp(TargetFlagGroups(), IsTargetFlagFile));
  absl::StrAppend(&out, "\n  --help   this text;  --version   the version\n");
  return out;
}

std::optional<int> HandleTargetHelpOrVersion(int argc, char** argv) {
  return HandleHelpOrVersion(argc, argv, "draftfeed-target", std::string(kDraftfeedVersion),
                             TargetHelp);
}

absl::Status CheckTargetFlagNames(int argc, char** argv) {
  return CheckFlagNames(argc, argv, "draftfeed-target", IsTargetFlagFile);
}

absl::Status CheckListenAddress(const std::string& listen) {
  const std::string flag = absl::StrCat("--listen=", listen);
  if (listen.rfind("unix:", 0) == 0 || listen.rfind("unix-abstract:", 0) == 0) {
    return absl::OkStatus();  // a socket path: gRPC's own checks
  }
  std::string host, port;
  if (!listen.empty() && listen[0] == '[') {
    const size_t close = listen.find(']');
    if (close == std::string::npos || close + 1 >= listen.size() || listen[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": an IPv6 address is written [addr]:port, e.g. [::]:50051"));
    }
    host = listen.substr(1, close - 1);
    port = listen.substr(close + 2);
  } else {
    const size_t colon = listen.rfind(':');
    if (colon == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": expected host:port, e.g. 127.0.0.1:50051 or 0.0.0.0:0"));
    }
    host = listen.substr(0, colon);
    port = listen.substr(colon + 1);
    if (host.find(':') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": an IPv6 address needs brackets, e.g. [", host, "]:", port));
    }
  }
  int port_number = -1;
  if (port.empty() || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port, &port_number) || port_number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": port '", port, "' is not a number in 0..65535"));
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": host '", host, "' does not resolve (", gai_strerror(rc), ")"));
  }
  // gRPC serves on every address the host resolves to that it can bind;
  // fail only when none binds, naming the first reason.
  std::string why;
  bool any = false;
  for (addrinfo* a = res; a != nullptr && !any; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;  // as gRPC binds: a port in TIME_WAIT is free
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, a->ai_addr, a->ai_addrlen) == 0) {
      any = true;
    } else if (why.empty()) {
      const int e = errno;
      if (e == EADDRINUSE) {
        why = absl::StrCat("port ", port, " is already in use on ", host.empty() ? "*" : host,
                           " (another draftfeed-target? port 0 picks a free one)");
      } else if (e == EADDRNOTAVAIL) {
        why = absl::StrCat(host, " is not an address of this machine");
      } else if (e == EACCES) {
        why = absl::StrCat("binding port ", port,
                           " is not permitted (ports below 1024 need "
                           "privileges)");
      } else {
        why = absl::StrCat("cannot bind: ", Errno(e));
      }
    }
    close(fd);
  }
  freeaddrinfo(res);
  if (!any) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", why.empty() ? "no address to bind" : why));
  }
  return absl::OkStatus();
}

absl::Status CheckPortFile(const std::string& path) {
  const std::string probe = path + ".tmp";
  std::FILE* f = std::fopen(probe.c_str(), "w");
  if (f == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--port_file=", path, ": cannot create ", probe, ": ", Errno(errno)));
  }
  std::fclose(f);
  std::remove(probe.c_str());
  return absl::OkStatus();
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    return absl::InternalError(
        absl::StrCat("--port_file=", path, ": cannot create ", tmp, ": ", Errno(errno)));
  }
  const bool written = std::fprintf(f, "%d\n", port) > 0;
  if (std::fclose(f) != 0 || !written) {
    const int e = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrCat("--port_file=", path, ": cannot write ", tmp, ": ", Errno(e)));
  }
  // Atomic: readers never see a partial file.
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrCat("--port_file=", path, ": cannot rename ", tmp, " to it: ", Errno(e)));
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
