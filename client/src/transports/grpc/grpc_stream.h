// The client's gRPC plumbing: channels, message (de)serialisation and the
// data stream, read as raw ByteBuffers so payload bytes go from gRPC's slices
// straight into a batch's buffer (one copy), never through a protobuf string.
#pragma once

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/status.h"
#include "client/src/credentials.h"
#include "google/protobuf/message.h"

namespace draftfeed {

// A channel to `address` with `creds`' TLS (if any); `dns_name`: the name a
// dns:/// target's `address` was resolved from ("" for any other).
std::shared_ptr<grpc::Channel> MakeChannel(const std::string& address,
                                           const ClientCredentials& creds,
                                           const std::string& dns_name = "");
grpc::ByteBuffer ToBuffer(const google::protobuf::Message& msg);
bool ParseBuffer(grpc::ByteBuffer& bb, google::protobuf::Message* msg);
absl::Status FromGrpc(const grpc::Status& s, const std::string& context);

// One StreamHiddenStates call with blocking Read / Write / WritesDone /
// Finish, like grpc::ClientReaderWriter, but opened through the public
// generic stub (gRPC's synchronous generic bidi stream is internal API). One
// thread may read while another writes; whichever of them waits drives the
// call's completion queue and hands the other its completion, so a read costs
// what it costs on the synchronous API: the reading thread polls for itself.
class GrpcStream {
 public:
  GrpcStream() = default;
  ~GrpcStream();  // cancels and finishes a call that was not finished
  GrpcStream(const GrpcStream&) = delete;
  GrpcStream& operator=(const GrpcStream&) = delete;

  // Starts the call on `channel`, with `creds`' token; false when it could
  // not start.
  bool Start(const std::shared_ptr<grpc::Channel>& channel, const ClientCredentials& creds);
  bool Read(grpc::ByteBuffer* msg);         // false: the stream ended
  bool Write(const grpc::ByteBuffer& msg);  // false: the stream is broken
  bool WritesDone();
  // Once, with no read or write in progress.
  grpc::Status Finish();
  void TryCancel() { ctx_.TryCancel(); }

 private:
  struct Op {
    bool done = false;
    bool ok = false;
  };
  bool Await(Op* op);

  grpc::ClientContext ctx_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool polling_ = false;  // one waiter drives cq_ at a time
  bool finished_ = false;
};

}  // namespace draftfeed
