// Who a call is, at the service edge: the bearer-token check (the token's
// name), the stream that answers a call refused before it started, and the
// log line of a stream that opened, naming its token.
#pragma once

#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "draftfeed/v1/draftfeed.pb.h"
#include "server/service/auth_tokens.h"

namespace draftfeed {

// The name of the token `ctx` carries; "" when the target checks no tokens
// (`tokens` null). A refusal is logged (the peer, the method and why; at
// most one line a second, so that a flood of bad calls cannot fill the log).
absl::StatusOr<std::string> AuthenticateCall(const TokenChecker* tokens,
                                             const grpc::CallbackServerContext& ctx,
                                             absl::string_view method);

// A StreamHiddenStates call refused before anything was read: it ends with
// `status` and deletes itself.
class RefusedStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RefusedStream(grpc::Status status) { Finish(std::move(status)); }
  void OnDone() override { delete this; }
};

// One line on stderr for a stream that opened: the peer, the token's name,
// the client certificate's identity (mutual TLS), the client's name, and what
// the stream asked for and got.
void LogStreamOpened(const grpc::CallbackServerContext& ctx, absl::string_view token_name,
                     const v1::Open& open, const v1::Opened& opened);

}  // namespace draftfeed
