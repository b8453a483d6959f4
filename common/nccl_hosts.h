// What both sides of the NCCL transport need to know about hosts, without
// NCCL or CUDA (so CPU builds decide, parse and explain the same way): which
// machine a process runs on, the process's NCCL network interface, and the
// bootstrap address a trainer's ncclUniqueId carries.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace draftfeed {

// Which machine (and boot) a process runs on: two processes are on one host
// when their ids are equal. `name` is for messages only.
struct HostIdentity {
  std::string id;
  std::string name;
};

// This process's host: the kernel's boot id ("boot:…"), else the hostname
// ("host:…"); `name` is the hostname. DRAFTFEED_HOST_ID, when set, replaces
// both ("env:<value>", "<value>"): two processes of one machine then look
// like two hosts (how the cross-host path is tested on one machine), or a
// container runtime that hides the boot id can name the machine.
HostIdentity LocalHost();

// INVALID_ARGUMENT, naming `option` (the flag or field that gave it), for an
// interface list NCCL cannot mean (empty is fine: NCCL's own choice).
absl::Status CheckNcclSocketIfname(absl::string_view ifname, absl::string_view option);

// Makes NCCL use `ifname` for its bootstrap and socket transport in this
// process: sets NCCL_SOCKET_IFNAME, which NCCL reads once, at its first use,
// so call it before the process's first NCCL stream. Empty: leaves NCCL's
// own choice (or the environment's). Errors as CheckNcclSocketIfname, and
// FAILED_PRECONDITION when the environment already names another interface.
absl::Status UseNcclSocketIfname(absl::string_view ifname, absl::string_view option);

// "NCCL_SOCKET_IFNAME=eth0", or what NCCL does without it.
std::string DescribeNcclSocketIfname();

// The bootstrap address ("10.0.0.5:41234", "[fe80::1]:41234") an
// ncclUniqueId carries: where the trainer's NCCL listens for the target to
// join. Empty when the bytes hold no IPv4/IPv6 address where NCCL puts it.
std::string NcclUniqueIdAddress(absl::string_view unique_id);

// The advice a timed-out NCCL set-up or handshake ends with: on one host,
// that the other process never joined; across hosts, the interface and the
// reachability to check (`bootstrap`: NcclUniqueIdAddress, may be empty).
std::string NcclSetupHint(bool across_hosts, absl::string_view bootstrap);

}  // namespace draftfeed
