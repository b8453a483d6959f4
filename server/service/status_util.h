// The one place where absl::Status becomes grpc::Status: everything behind the
// service edge speaks absl::Status.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace draftfeed {

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  // absl::StatusCode and grpc::StatusCode share the google.rpc.Code numbering.
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

}  // namespace draftfeed
