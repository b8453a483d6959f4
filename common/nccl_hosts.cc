#include "common/nccl_hosts.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace draftfeed {

HostIdentity LocalHost() {
  if (const char* forced = std::getenv("DRAFTFEED_HOST_ID"); forced != nullptr && *forced != 0) {
    return {absl::StrCat("env:", forced), forced};
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::string boot;
  if (f && std::getline(f, boot) && !boot.empty()) return {absl::StrCat("boot:", boot), host};
  return {absl::StrCat("host:", host), host};
}

absl::Status CheckNcclSocketIfname(absl::string_view ifname, absl::string_view option) {
  const bool printable = std::all_of(ifname.begin(), ifname.end(), [](char c) {
    return std::isgraph(static_cast<unsigned char>(c)) != 0;
  });
  if (!printable) {
    return absl::InvalidArgumentError(absl::StrCat(
        option, "='", ifname,
        "' has whitespace or a control character; NCCL_SOCKET_IFNAME takes interface-name "
        "prefixes separated by commas (^ excludes, = matches a name exactly), e.g. eth0 or "
        "^docker,lo"));
  }
  return absl::OkStatus();
}

absl::Status UseNcclSocketIfname(absl::string_view ifname, absl::string_view option) {
  if (ifname.empty()) return absl::OkStatus();
  if (absl::Status s = CheckNcclSocketIfname(ifname, option); !s.ok()) return s;
  // Two feeds of one process may ask at once; the environment is one.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (const char* set = std::getenv("NCCL_SOCKET_IFNAME"); set != nullptr) {
    if (ifname == set) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat(option, "=", ifname, " but this process already has NCCL_SOCKET_IFNAME=", set,
                     " (NCCL reads one interface per process, at its first use): set one of them"));
  }
  setenv("NCCL_SOCKET_IFNAME", std::string(ifname).c_str(), 1);
  return absl::OkStatus();
}

std::string DescribeNcclSocketIfname() {
  if (const char* set = std::getenv("NCCL_SOCKET_IFNAME"); set != nullptr) {
    return absl::StrCat("NCCL_SOCKET_IFNAME=", set);
  }
  return "NCCL_SOCKET_IFNAME (unset: NCCL takes an InfiniBand interface, else the first that is "
         "neither docker nor loopback)";
}

std::string NcclUniqueIdAddress(absl::string_view unique_id) {
  // NCCL's bootstrap handle: a 64-bit magic, then the root's socket address
  // (a sockaddr_in or sockaddr_in6) where the trainer's NCCL listens.
  constexpr size_t kMagicBytes = 8;
  if (unique_id.size() != 128) return "";
  union {
    sockaddr sa;
    sockaddr_in in4;
    sockaddr_in6 in6;
  } addr;
  std::memset(&addr, 0, sizeof(addr));
  std::memcpy(&addr, unique_id.data() + kMagicBytes, sizeof(addr));
  char text[INET6_ADDRSTRLEN] = {};
  if (addr.sa.sa_family == AF_INET) {
    if (inet_ntop(AF_INET, &addr.in4.sin_addr, text, sizeof(text)) == nullptr) return "";
    if (addr.in4.sin_port == 0) return "";
    return absl::StrCat(text, ":", ntohs(addr.in4.sin_port));
  }
  if (addr.sa.sa_family == AF_INET6) {
    if (inet_ntop(AF_INET6, &addr.in6.sin6_addr, text, sizeof(text)) == nullptr) return "";
    if (addr.in6.sin6_port == 0) return "";
    return absl::StrCat("[", text, "]:", ntohs(addr.in6.sin6_port));
  }
  return "";
}

std::string NcclSetupHint(bool across_hosts, absl::string_view bootstrap) {
  if (!across_hosts) return "the other process never joined or stopped";
  return absl::StrCat(
      "check ", DescribeNcclSocketIfname(),
      ": on both hosts it must name an interface that reaches the other host, and TCP between "
      "them must be open on every port (NCCL's bootstrap and socket transport listen on "
      "ephemeral ports, in both directions)",
      bootstrap.empty() ? "" : absl::StrCat("; the trainer's NCCL bootstrap is at ", bootstrap));
}

}  // namespace draftfeed
