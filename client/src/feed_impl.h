// Feed::Impl: the feed's state, shared by its parts, each in a file of its own:
//   connection.cc  targets' streams: connect, open, read, write, end;
//   batches.cc     the batch table: chunks landing, BatchDone, errors (it is
//                  the BatchSink the transports deliver into);
//   dispatch.cc    which target gets which batch, and the supervisor (hung
//                  targets, no target at all, DNS discovery);
//   feed.cc        the public Feed calls.
// One mutex, `mu`, guards everything but a stream's write queue; payload
// bytes are copied without it.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "client/src/feed_rates.h"
#include "client/src/transport.h"
#include "client/src/transports/grpc/grpc_stream.h"
#include "common/capture_encoding.h"
#include "common/host_buffer_pool.h"
#include "common/payload_checksum.h"
#include "common/target_outputs.h"
#include "draftfeed/client.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"

namespace draftfeed {

using Clock = std::chrono::steady_clock;

struct Feed::Impl final : BatchSink {
  // Messages a gRPC connection reads ahead of its processor (chunks are
  // chunk_bytes each, 4 MiB by default).
  static constexpr size_t kReadAheadMessages = 4;

  struct Target;

  // One stream to one target. Its reader thread owns the end of the stream;
  // its writer thread sends queued batches so no lock is held across Write.
  struct Conn {
    Target* target = nullptr;
    GrpcStream stream;
    std::unique_ptr<StreamTransport> transport;
    std::thread reader;
    std::thread writer;
    std::mutex wmu;
    std::condition_variable wcv;
    std::deque<grpc::ByteBuffer> wq;
    bool wclosed = false;   // writer: send what is queued, then WritesDone
    bool finished = false;  // reader is done (guarded by Impl::mu)
    // Cancelled to drop batches (Feed::Cancel), not lost: its end is no
    // failure, and the target reconnects at once (guarded by Impl::mu).
    bool cancelled_by_client = false;
    // The last chunk, BatchDone or BatchError of any of its batches (guarded
    // by Impl::mu): a batch queued behind others the target is serving (a
    // long sequence's forwards take minutes) is waiting, not hung.
    std::chrono::steady_clock::time_point last_progress{};
  };

  enum class State { kConnecting, kLive, kDown, kRefused };

  struct Target {
    std::string address;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<v1::TargetService::Stub> stub;
    TargetDescription info;
    State state = State::kConnecting;
    std::shared_ptr<Conn> conn;
    int32_t credits = 1;
    // The live stream's capture, as its Opened said.
    CaptureEncoding encoding = CaptureEncoding::kBf16;
    int64_t bytes_per_token = 0;  // the row: hidden states, then target outputs
    int64_t hidden_bytes_per_token = 0;
    int64_t attempts = 0;
    double backoff_s = 0;
    Clock::time_point next_attempt{};
    std::thread connector;
    absl::Status refusal;  // why it is kRefused
    double rate_tps = 0;   // EWMA of tokens / forward time; 0 = not measured yet
    TargetStats stats;
    double joined_s = 0;  // SinceOpen() when it joined the feed
    TargetWindow window;
  };

  struct Pending {
    std::vector<int32_t> token_ids;
    std::vector<int32_t> seq_lens;
    // The payload's buffer, from the transport of the stream it is on, in
    // `device`'s memory (-1: host); `bytes` long.
    std::shared_ptr<std::byte> buffer;
    int device = -1;
    size_t bytes = 0;
    std::optional<uint64_t> transport_checksum;  // the transport's, of the whole payload
    int landings = 0;                            // chunks claimed whose bytes have not landed yet
    uint64_t epoch = 0;                          // bumped whenever the batch is unassigned
    std::optional<v1::BatchDone> early_done;     // BatchDone that beat its bytes
    // Checksum fed chunk by chunk while the bytes are in cache; valid while
    // chunks arrive in order (otherwise the batch is re-hashed whole).
    v1::PayloadHasher hasher;
    bool hashed_in_order = true;
    int64_t tokens_received = 0;
    Target* target = nullptr;
    Conn* conn = nullptr;
    Clock::time_point last_progress{};
    bool complete = false;
    absl::Status error;
    HiddenBatch result;
  };

  FeedOptions options;
  bool read_handoff = false;  // options.read_handoff, resolved
  // Host result buffers: reused across batches (a fresh 200 MB buffer per
  // batch would cost a page fault per 4 KiB); idle memory capped at 2x
  // prefetch_bytes.
  std::unique_ptr<HostBufferPool> pool;
  std::unique_ptr<ClientTransports> transports;
  std::shared_ptr<const ClientCredentials> credentials;  // TLS and token of every channel and call
  std::string fingerprint;                               // every target must serve this
  std::string fingerprint_source;
  int32_t hidden_size = 0;
  Clock::time_point opened_at = Clock::now();

  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Target>> targets;
  std::vector<std::string> dns_targets;
  Clock::time_point next_dns_refresh{};
  std::map<uint64_t, Pending> pending;            // by batch id = submission order
  std::set<uint64_t> unassigned;                  // pending, not on any target
  std::vector<std::shared_ptr<Conn>> dead_conns;  // threads still to join
  uint64_t next_id = 1;
  int64_t outstanding_bytes = 0;
  FeedStats stats;
  FeedWindow window;                     // of `stats`
  std::optional<FeedStats> final_stats;  // what Close() left
  absl::Status fatal;                    // sticky: no target for unavailable_timeout_s
  std::optional<Clock::time_point> no_target_since;
  std::atomic<bool> closing{false};  // set under mu; transports read it without
  std::thread supervisor;

  int64_t K() const { return static_cast<int64_t>(options.layers.size()); }
  double SinceOpen() const {
    return std::chrono::duration<double>(Clock::now() - opened_at).count();
  }
  // Samples the windows (feed.cc): cheap, so done wherever counters move and
  // by the supervisor, which keeps a window's base near its start when
  // nothing is delivered for a while.
  void RecordWindowsLocked();
  FeedStats StatsLocked();
  // What a token of a batch weighs before a stream says (prefetch_bytes).
  CaptureEncoding RequestedEncoding() const {
    return static_cast<CaptureEncoding>(options.encoding);
  }
  int64_t RequestedBytesPerToken() const {
    return CaptureBytesPerToken(RequestedEncoding(), K(), hidden_size) + outputs_layout.bytes;
  }
  // FeedOptions::target_outputs as the wire's, and its per-token layout
  // (bytes 0 when nothing is asked); fixed at Open.
  TargetOutputs outputs;
  TargetOutputsLayout outputs_layout;

  // connection.cc
  // `dns_name`: the dns:/// name `address` was resolved from ("" if none).
  void AddTargetLocked(const std::string& address, const std::string& dns_name);
  void ConnectLoop(Target* t);
  absl::Status ConnectOnce(Target* t, bool first);
  static void WriteLoop(Conn* c);
  static void StopWriter(Conn* c, bool drop_queued);
  bool Process(Conn* conn, grpc::ByteBuffer& raw, v1::StreamResponse& resp);
  void ReadLoop(std::shared_ptr<Conn> conn);
  void OnConnEnd(Target* t, const std::shared_ptr<Conn>& conn, const grpc::Status& status);

  // batches.cc
  std::optional<Landing> Claim(const void* stream, const ChunkHeader& chunk, size_t payload_bytes,
                               int device, const Acquire& acquire) override;
  void Landed(const void* stream, const ChunkHeader& chunk, size_t payload_bytes, Landing* landing,
              bool ok, std::optional<uint64_t> checksum, double recv_ms) override;
  void FailBatch(const void* stream, uint64_t id, absl::Status why) override;
  void StreamBroken(const void* stream, std::string why, bool cancel) override;
  bool Closing() const override { return closing.load(); }
  void HandleResponse(Target* t, Conn* conn, const v1::StreamResponse& resp);
  void FinishBatch(Target* t, uint64_t id, Pending& p, const v1::BatchDone& d);
  void Unassign(Pending& p);
  void Fail(uint64_t id, Pending& p, absl::Status status);
  void FailMalformedChunk(Target* t, uint64_t id, Pending& p, const ChunkHeader& c,
                          size_t payload_bytes);

  // feed.cc
  int64_t CancelLocked(const std::vector<uint64_t>& batch_ids);

  // dispatch.cc
  void Dispatch();
  bool AnyLive() const;
  std::string TargetErrors() const;
  void SuperviseLoop();
  absl::Status AddTargets(const std::string& target);
};

}  // namespace draftfeed
