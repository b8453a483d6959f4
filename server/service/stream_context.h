// What a stream, and what reads across streams (/metrics, the throughput
// line), is handed of its target: the options, the model and the facts
// derived from the engines once, the scheduler, the counters, the registry
// of open streams and the drain flag. The service owns every piece and
// outlives its streams; a stream never reaches the service itself.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "common/capture_encoding.h"
#include "draftfeed/v1/draftfeed.pb.h"
#include "server/service/stream_transport.h"

namespace draftfeed {

struct Model;
struct ServiceOptions;
class Scheduler;
class StreamRegistry;
class TargetMetrics;

struct StreamContext {
  const ServiceOptions& options;
  const Model& model;
  // Fixed once the service has its engines (TargetService says what each is).
  v1::TargetInfo info;  // what Opened carries
  std::vector<CaptureEncoding> encodings;
  bool serves_target_outputs = false;
  int64_t max_capture_layers = 0;   // 0 = no limit
  int64_t max_sequence_tokens = 0;  // the most tokens one Batch may hold
  TransportEnv transport_env;
  Scheduler& scheduler;
  TargetMetrics& metrics;
  StreamRegistry& streams;
  const std::atomic<bool>& draining;  // the target drains: no new batches
};

}  // namespace draftfeed
