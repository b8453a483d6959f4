// Asking a target who it is (GetTargetInfo) and turning the addresses a
// trainer names into the ones the feed connects to.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/src/credentials.h"
#include "draftfeed/client.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"

namespace draftfeed {

TargetDescription Describe(const std::string& address, const v1::TargetInfo& info);

// GetTargetInfo. It fails as soon as the connection does, saying why
// ("connection refused", "name not resolved") with the address, rather than
// waiting out `timeout_s`, which bounds a connection that hangs.
// The call carries `creds`' token.
absl::StatusOr<TargetDescription> QueryInfo(v1::TargetService::Stub* stub,
                                            const std::string& address, double timeout_s,
                                            const ClientCredentials& creds);

// A failed call's status, its message leading with what went wrong in words
// a trainer acts on, then gRPC's own.
absl::Status ExplainCallFailure(const grpc::Status& s, const std::string& address,
                                const std::string& call, double timeout_s);

// "dns:///name:port" -> every address the name resolves to, as "ip:port";
// any other target string is returned as it is.
absl::StatusOr<std::vector<std::string>> ExpandTarget(const std::string& target);
// "dns:///name:port" -> "name": what the certificates of the addresses it
// expands to must carry; "" for any other target string.
std::string DnsNameOf(const std::string& target);

}  // namespace draftfeed
