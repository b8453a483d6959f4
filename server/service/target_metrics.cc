#include "server/service/target_metrics.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/log_line.h"
#include "common/thread_name.h"
#include "server/model/model.h"
#include "server/service/scheduler.h"
#include "server/service/stream_registry.h"
#include "server/service/version.h"

namespace draftfeed {
namespace {

// "TRANSPORT_GRPC" -> "grpc": the names the flags and the clients use.
std::string Lower(absl::string_view wire, absl::string_view prefix) {
  if (wire.substr(0, prefix.size()) == prefix) wire.remove_prefix(prefix.size());
  std::string out(wire);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string TransportName(v1::Transport t) {
  return Lower(v1::Transport_Name(t == v1::TRANSPORT_UNSPECIFIED ? v1::TRANSPORT_GRPC : t),
               "TRANSPORT_");
}

}  // namespace

TargetMetrics::TargetMetrics()
    : batches_served_(registry_.GetCounter(
          "draftfeed_batches_served_total",
          "Batches whose result was handed in full to the stream's transport.")),
      tokens_served_(
          registry_.GetCounter("draftfeed_tokens_served_total", "Tokens of the batches served.")),
      payload_grpc_(registry_.GetCounter("draftfeed_payload_bytes_total",
                                         "Hidden-state payload bytes sent, by transport.",
                                         {{"transport", "grpc"}})),
      payload_nccl_(
          registry_.GetCounter("draftfeed_payload_bytes_total", "", {{"transport", "nccl"}})),
      streams_opened_(registry_.GetCounter("draftfeed_streams_opened_total",
                                           "Streams that were sent their Opened.")),
      queue_seconds_(registry_.GetHistogram(
          "draftfeed_queue_seconds", "Time a batch waited in the scheduler before its forward.",
          LatencyBucketsSeconds())),
      forward_seconds_(registry_.GetHistogram("draftfeed_forward_seconds",
                                              "Time of a batch's forward on its engine.",
                                              LatencyBucketsSeconds())),
      send_seconds_(registry_.GetHistogram(
          "draftfeed_send_seconds",
          "Time to send a batch's payload: gRPC, from its first chunk handed to gRPC to the "
          "last written; NCCL, the send on the device.",
          LatencyBucketsSeconds())) {
  registry_.DeclareCounter("draftfeed_batch_errors_total", "BatchErrors sent, by status code.");
  registry_.DeclareCounter(
      "draftfeed_streams_closed_total",
      "Streams that ended (other than refused), by the status they ended with.");
  registry_.DeclareCounter(
      "draftfeed_streams_refused_total",
      "Streams ended before their Opened (token, --max_streams, a bad Open), by status code.");
}

void TargetMetrics::CountBatchServed(v1::Transport transport, int64_t tokens, int64_t payload_bytes,
                                     double queue_s, double forward_s, double send_s) {
  batches_served_->Add();
  tokens_served_->Add(tokens);
  (transport == v1::TRANSPORT_NCCL ? payload_nccl_ : payload_grpc_)->Add(payload_bytes);
  queue_seconds_->Observe(queue_s);
  forward_seconds_->Observe(forward_s);
  send_seconds_->Observe(send_s);
}

void TargetMetrics::CountBatchError(absl::StatusCode code) {
  registry_
      .GetCounter("draftfeed_batch_errors_total", "", {{"code", absl::StatusCodeToString(code)}})
      ->Add();
}

void TargetMetrics::CountStreamClosed(absl::StatusCode code) {
  registry_
      .GetCounter("draftfeed_streams_closed_total", "", {{"code", absl::StatusCodeToString(code)}})
      ->Add();
}

void TargetMetrics::CountStreamRefused(absl::StatusCode code) {
  registry_
      .GetCounter("draftfeed_streams_refused_total", "", {{"code", absl::StatusCodeToString(code)}})
      ->Add();
}

int64_t ResidentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

void AddServiceGauges(const StreamContext& target, bool per_stream) {
  const StreamContext* t = &target;  // outlives the registry's renders
  MetricsRegistry& r = t->metrics.registry();
  const auto one = [](double v) { return std::vector<GaugeSample>{{.value = v}}; };
  const auto start = std::chrono::steady_clock::now();
  r.AddGaugeCallback("draftfeed_uptime_seconds", "Seconds since the service started.", [=] {
    return one(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  });
  r.AddGaugeCallback(
      "draftfeed_target_info", "1, labelled with the model served and the server's version.",
      [t] {
        const Model& m = t->model;
        return std::vector<GaugeSample>{{.labels = {{"model", m.id},
                                                    {"fingerprint", m.fingerprint},
                                                    {"version", std::string(kDraftfeedVersion)}},
                                         .value = 1}};
      });
  r.AddGaugeCallback("draftfeed_queue_depth", "Batches queued in the scheduler, all streams.",
                     [=] { return one(t->scheduler.queued()); });
  r.AddGaugeCallback("draftfeed_running_batches",
                     "Batches taken by an engine and not yet delivered to their stream.",
                     [=] { return one(t->scheduler.running()); });
  r.AddCounterCallback("draftfeed_skipped_batches_total",
                       "Batches skipped because their stream was gone before they ran.",
                       [=] { return t->scheduler.skipped_batches(); });
  r.AddGaugeCallback("draftfeed_host_capture_bytes",
                     "Host memory of capture buffers, in use and kept for reuse.", [=] {
                       const HostBufferPool& p = t->scheduler.pool();
                       return one(p.live_bytes() + p.idle_bytes());
                     });
  r.AddGaugeCallback("draftfeed_resident_bytes", "Resident memory of the target process.",
                     [=] { return one(ResidentBytes()); });
  // The per-stream gauges come from one walk over the streams per family.
  r.AddGaugeCallback("draftfeed_open_streams", "Streams open now.",
                     [=] { return one(t->streams.open_streams()); });
  r.AddGaugeCallback("draftfeed_credits_granted", "Sum of the open streams' credits.", [=] {
    int64_t sum = 0;
    for (const StreamLoad& l : t->streams.Loads()) sum += l.credits;
    return one(sum);
  });
  r.AddGaugeCallback("draftfeed_credits_in_use",
                     "Batches in flight over all streams (each holds a credit until its last "
                     "message is written).",
                     [=] {
                       int64_t sum = 0;
                       for (const StreamLoad& l : t->streams.Loads()) sum += l.inflight;
                       return one(sum);
                     });
  // Not "_sum": Prometheus reads that suffix as a histogram's or summary's.
  r.AddGaugeCallback("draftfeed_pending_result_bytes",
                     "Result bytes taken for the forward and not yet written, all streams.", [=] {
                       int64_t sum = 0;
                       for (const StreamLoad& l : t->streams.Loads()) sum += l.pending_bytes;
                       return one(sum);
                     });
  r.AddGaugeCallback("draftfeed_pending_result_bytes_max",
                     "The most result bytes waiting on one stream.", [=] {
                       int64_t most = 0;
                       for (const StreamLoad& l : t->streams.Loads()) {
                         most = std::max(most, l.pending_bytes);
                       }
                       return one(most);
                     });
  if (per_stream) {
    r.AddGaugeCallback(
        "draftfeed_stream_pending_result_bytes",
        "Result bytes waiting on each open stream (--metrics_per_stream).", [=] {
          std::vector<GaugeSample> out;
          for (const StreamLoad& l : t->streams.Loads()) {
            out.push_back({.labels = {{"stream", absl::StrCat(l.id)}, {"client", l.client_name}},
                           .value = static_cast<double>(l.pending_bytes)});
          }
          return out;
        });
  }
}

std::string StreamClosedLine(const StreamSummary& s) {
  return absl::StrCat(LogTimestamp(std::chrono::system_clock::now()), " ", StreamClosedText(s));
}

std::string StreamClosedText(const StreamSummary& s) {
  std::string who;
  if (!s.token_name.empty()) absl::StrAppend(&who, " token ", s.token_name);
  if (!s.client_name.empty()) absl::StrAppend(&who, " client '", s.client_name, "'");
  const std::string status = s.status.ok() ? "OK"
                                           : absl::StrCat(absl::StatusCodeToString(s.status.code()),
                                                          ": ", s.status.message());
  if (s.refused) {
    return absl::StrCat("draftfeed-target: stream refused from ", s.peer, who, ": ", status);
  }
  return absl::StrFormat(
      "draftfeed-target: stream closed from %s%s: transport %s, layers %s, %s: %d batches, %d "
      "tokens, %.1f MiB in %.2f s, %d batch errors: %s",
      s.peer, who, TransportName(s.transport), absl::StrJoin(s.layers, ","),
      Lower(v1::Encoding_Name(s.encoding == v1::ENCODING_UNSPECIFIED ? v1::ENCODING_BF16
                                                                     : s.encoding),
            "ENCODING_"),
      s.batches, s.tokens, static_cast<double>(s.payload_bytes) / (1 << 20), s.seconds,
      s.batch_errors, status);
}

ThroughputLogger::ThroughputLogger(const StreamContext& target, double period_s)
    : target_(target), period_(period_s) {
  thread_ = std::thread([this] {
    NameThisThread("df-throughput");
    Loop();
  });
}

ThroughputLogger::~ThroughputLogger() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::string ThroughputLogger::Line(double seconds, int64_t batches, int64_t tokens, int64_t bytes,
                                   int64_t open_streams, int64_t credits_in_use, int64_t queued) {
  return absl::StrFormat(
      "draftfeed-target: last %.0f s: %d batches, %d tokens (%.0f tok/s), %.1f MiB sent; %d "
      "streams open, %d credits in use, %d batches queued",
      seconds, batches, tokens, seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0,
      static_cast<double>(bytes) / (1 << 20), open_streams, credits_in_use, queued);
}

void ThroughputLogger::Loop() {
  const TargetMetrics& m = target_.metrics;
  int64_t batches = m.batches_served(), tokens = m.tokens_served(), bytes = m.payload_bytes();
  auto last = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, period_, [this] { return stopping_; })) {
    const auto now = std::chrono::steady_clock::now();
    const int64_t b = m.batches_served(), t = m.tokens_served(), y = m.payload_bytes();
    int64_t in_use = 0;
    for (const StreamLoad& l : target_.streams.Loads()) in_use += l.inflight;
    const std::string line =
        Line(std::chrono::duration<double>(now - last).count(), b - batches, t - tokens, y - bytes,
             target_.streams.open_streams(), in_use, target_.scheduler.queued());
    LogLine(line);
    batches = b;
    tokens = t;
    bytes = y;
    last = now;
  }
}

}  // namespace draftfeed
