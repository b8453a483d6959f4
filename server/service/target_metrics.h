// What a target counts for /metrics and its log: the counters and histograms
// the streams update as they serve (relaxed atomics, no lock on the serving
// path), the gauges sampled from the service when /metrics is read, the
// stream-closed and refusal log lines, and the periodic throughput line.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "draftfeed/v1/draftfeed.pb.h"
#include "server/service/metrics.h"
#include "server/service/stream_context.h"

namespace draftfeed {

class TargetMetrics {
 public:
  TargetMetrics();

  MetricsRegistry& registry() { return registry_; }

  // One batch's result fully handed to its transport: its tokens, payload
  // bytes (by transport), and its time queued, in the forward and sending.
  void CountBatchServed(v1::Transport transport, int64_t tokens, int64_t payload_bytes,
                        double queue_s, double forward_s, double send_s);
  // A BatchError sent (the batch was refused or failed), by status code.
  void CountBatchError(absl::StatusCode code);
  void CountStreamOpened() { streams_opened_->Add(); }
  // A stream that ended other than refused, by the status it ended with.
  void CountStreamClosed(absl::StatusCode code);
  // A stream ended before its Opened (authentication, --max_streams, a bad
  // Open), by status code.
  void CountStreamRefused(absl::StatusCode code);

  int64_t batches_served() const { return batches_served_->value(); }
  int64_t tokens_served() const { return tokens_served_->value(); }
  int64_t payload_bytes() const { return payload_grpc_->value() + payload_nccl_->value(); }

 private:
  MetricsRegistry registry_;
  Counter* batches_served_;
  Counter* tokens_served_;
  Counter* payload_grpc_;
  Counter* payload_nccl_;
  Counter* streams_opened_;
  Histogram* queue_seconds_;
  Histogram* forward_seconds_;
  Histogram* send_seconds_;
};

// The gauges read from `target` at each scrape: queue depth, batches
// running, open streams, credits granted and in use, result bytes waiting
// (sum and max over streams; per stream too when `per_stream`, labelled by
// stream id and client name: one series per stream, so off by default), the
// capture buffers' host memory, the process's resident memory, uptime and an
// info series with the model and version. `target` must outlive the
// registry's renders.
void AddServiceGauges(const StreamContext& target, bool per_stream);

// The process's resident set size in bytes (/proc/self/statm); 0 when unknown.
int64_t ResidentBytes();

// What one stream did, for its closing log line.
struct StreamSummary {
  std::string peer;
  std::string client_name;
  std::string token_name;
  bool refused = false;  // the target ended it before its Opened
  v1::Transport transport = v1::TRANSPORT_GRPC;
  std::vector<int32_t> layers;
  v1::Encoding encoding = v1::ENCODING_BF16;
  int64_t batches = 0;
  int64_t tokens = 0;
  int64_t payload_bytes = 0;
  int64_t batch_errors = 0;
  double seconds = 0;
  absl::Status status;
};
// "draftfeed-target: stream closed from PEER client 'x': transport grpc,
// layers 1,2, bf16: 12 batches, 4096 tokens, 8.0 MiB in 1.20 s, 0 batch
// errors: OK", or for a stream that never opened "draftfeed-target: stream
// refused from PEER ...: CODE: reason".
std::string StreamClosedText(const StreamSummary& s);
// The log line the stream prints as it ends: StreamClosedText stamped with
// the time now (LogTimestamp), as LogLine writes every line.
std::string StreamClosedLine(const StreamSummary& s);

// Every `period_s`, one line on stderr with the interval's batches, tokens,
// tokens/s and bytes sent, and the open streams, credits in use and queue.
class ThroughputLogger {
 public:
  ThroughputLogger(const StreamContext& target, double period_s);
  ~ThroughputLogger();  // stops the thread
  ThroughputLogger(const ThroughputLogger&) = delete;
  ThroughputLogger& operator=(const ThroughputLogger&) = delete;

  // The line for an interval of `seconds` in which the counters moved by the
  // deltas given (exposed for tests).
  static std::string Line(double seconds, int64_t batches, int64_t tokens, int64_t bytes,
                          int64_t open_streams, int64_t credits_in_use, int64_t queued);

 private:
  void Loop();
  const StreamContext& target_;
  const std::chrono::duration<double> period_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace draftfeed
