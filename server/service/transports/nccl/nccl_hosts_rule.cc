#include "server/service/transports/nccl/nccl_hosts_rule.h"

#include "absl/strings/str_cat.h"
#include "common/nccl_hosts.h"

namespace draftfeed {

namespace {

// "trainer on host B, target on host A": how every message names the two.
std::string BothHosts(const TransportEnv& env, const v1::Open& open) {
  const std::string target = env.host.name.empty() ? env.host.id : env.host.name;
  if (open.host_id().empty()) {
    return absl::StrCat("trainer on a host it did not name, target on host ", target);
  }
  const std::string trainer = open.host_name().empty() ? open.host_id() : open.host_name();
  // Names can match where ids differ. The target's id stays out of the
  // message: a client that learnt it could pose as this host.
  if (trainer == target) {
    return absl::StrCat("trainer and target on hosts both named ", target,
                        " but of different host ids (another boot, or DRAFTFEED_HOST_ID)");
  }
  return absl::StrCat("trainer on host ", trainer, ", target on host ", target);
}

}  // namespace

bool NcclAcrossHosts(const TransportEnv& env, const v1::Open& open) {
  return open.host_id().empty() || open.host_id() != env.host.id;
}

std::string NcclHostsRefusal(const TransportEnv& env, const v1::Open& open) {
  if (!NcclAcrossHosts(env, open)) return "";
  if (!env.nccl_across_hosts) {
    return absl::StrCat(BothHosts(env, open),
                        ": this target was started with --nccl_across_hosts=false (NCCL for "
                        "trainers on its own host only)");
  }
  if (open.transport() == v1::TRANSPORT_AUTO && !open.nccl_across_hosts()) {
    return absl::StrCat(BothHosts(env, open),
                        ": NCCL across hosts needs nccl_across_hosts=True (or transport=nccl)");
  }
  return "";
}

std::string NcclHostsNote(const TransportEnv& env, const v1::Open& open) {
  if (!NcclAcrossHosts(env, open)) return "";
  return absl::StrCat("nccl across hosts (", BothHosts(env, open), ")");
}

std::string DescribeNcclOffer(const TransportEnv& env, const std::string& why_not) {
  if (!why_not.empty()) return absl::StrCat("nccl not offered: ", why_not);
  const std::string timeouts = absl::StrCat("set-up timeout ", env.nccl_setup_timeout_s,
                                            " s, transfer timeout ", env.nccl_timeout_s, " s");
  if (!env.nccl_across_hosts) {
    return absl::StrCat("nccl offered to trainers on this host only (--nccl_across_hosts=false; ",
                        timeouts, ")");
  }
  return absl::StrCat("nccl offered to trainers on this host and on other hosts (",
                      DescribeNcclSocketIfname(), "; ", timeouts, ")");
}

}  // namespace draftfeed
