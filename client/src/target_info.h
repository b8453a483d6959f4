// Asking a target who it is (GetTargetInfo) and turning the addresses a
// trainer names into the ones the feed connects to.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "draftfeed/client.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"

namespace draftfeed {

TargetDescription Describe(const std::string& address, const v1::TargetInfo& info);

// GetTargetInfo; `wait_for_ready` waits for a target that is still starting.
absl::StatusOr<TargetDescription> QueryInfo(v1::TargetService::Stub* stub,
                                            const std::string& address, double timeout_s,
                                            bool wait_for_ready);

// "dns:///name:port" -> every address the name resolves to, as "ip:port";
// any other target string is returned as it is.
absl::StatusOr<std::vector<std::string>> ExpandTarget(const std::string& target);

}  // namespace draftfeed
