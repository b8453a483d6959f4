// draftfeed client: feeds packed token batches to target servers and hands
// back their hidden states, token-major [T, K, H] in bf16.
//
//   draftfeed::FeedOptions opt;
//   opt.targets = {"127.0.0.1:50051"};
//   opt.layers = {1, 3, -1};            // layer ids; -1 = post-final-norm state
//   auto feed = draftfeed::Feed::Open(opt).value();
//   uint64_t id = feed->Submit(tokens, seq_lens).value();
//   draftfeed::HiddenBatch b = feed->Next().value();   // submission order
//
// Thread safety: Submit and Next may be called from different threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace draftfeed {

struct FeedOptions {
  // "host:port" or any gRPC target string (e.g. "dns:///targets.ns.svc:50051").
  std::vector<std::string> targets;
  // Layer ids to capture, in output order: i = raw output of decoder layer i
  // (transformers' hidden_states[i+1]), -1 = post-final-norm state.
  std::vector<int32_t> layers;
  // Batches submitted but not yet returned by Next(); Submit blocks beyond it.
  int32_t prefetch = 8;
  // Credits asked of each target (its in-flight batches for this stream).
  int32_t credits_per_target = 4;
  // Refuse targets whose fingerprint differs. Empty: the first target's is
  // taken and every other target must match it.
  std::string expected_fingerprint;
  // Recompute each batch's checksum and fail the batch on a mismatch.
  bool verify_checksum = true;
  // Seconds to wait for a target to answer GetTargetInfo / Open.
  double connect_timeout_s = 30.0;
  std::string client_name;
};

struct TargetDescription {
  std::string address;
  std::string model_id;
  std::string architecture;
  std::string fingerprint;
  std::string server_version;
  int32_t num_layers = 0;
  int32_t hidden_size = 0;
  int32_t vocab_size = 0;
  int64_t max_batch_tokens = 0;
  std::vector<std::string> devices;
  std::vector<std::string> layer_types;
};

struct HiddenBatch {
  uint64_t batch_id = 0;
  std::vector<int32_t> token_ids;
  std::vector<int32_t> seq_lens;
  int64_t num_tokens = 0;
  int64_t num_layers = 0;  // K
  int64_t hidden_size = 0;  // H
  std::vector<uint16_t> hidden;  // bf16 bit patterns, [T, K, H]
  uint64_t checksum = 0;  // as sent in BatchDone (verified when asked)
  std::string target;     // address that computed it
  double queue_ms = 0, forward_ms = 0, send_ms = 0;
};

struct FeedStats {
  int64_t submitted = 0;
  int64_t delivered = 0;
  int64_t failed = 0;
  int64_t tokens_delivered = 0;
  int64_t bytes_received = 0;
  int64_t outstanding = 0;  // submitted, not yet returned by Next()
  double elapsed_s = 0;     // since Open
};

// Queries one target without opening a stream.
absl::StatusOr<TargetDescription> DescribeTarget(const std::string& address,
                                                 double timeout_s = 10.0);

class Feed {
 public:
  static absl::StatusOr<std::unique_ptr<Feed>> Open(const FeedOptions& options);
  ~Feed();
  Feed(const Feed&) = delete;
  Feed& operator=(const Feed&) = delete;

  // Queues a packed batch; blocks while `prefetch` batches are outstanding.
  // Returns the batch id that the matching HiddenBatch carries.
  absl::StatusOr<uint64_t> Submit(std::vector<int32_t> token_ids, std::vector<int32_t> seq_lens);
  // Next result in submission order; blocks until it is ready. A batch the
  // target refused comes back as that error (the feed stays usable).
  // FAILED_PRECONDITION when nothing is outstanding.
  absl::StatusOr<HiddenBatch> Next();
  // Half-closes the streams and waits for them to end.
  absl::Status Close();

  const TargetDescription& target() const;  // the first target's description
  FeedStats Stats() const;

 private:
  struct Impl;
  explicit Feed(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace draftfeed
