// gRPC service of a target: GetTargetInfo and the StreamHiddenStates data
// plane (callback API, one reactor per stream, a scheduler shared by all).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server.h>

#include "common/capture_encoding.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "server/model/engine.h"
#include "server/service/scheduler.h"
#include "server/service/service_options.h"
#include "server/service/stream_context.h"
#include "server/service/stream_registry.h"
#include "server/service/stream_transport.h"
#include "server/service/target_metrics.h"

namespace draftfeed {

class TargetService;

// A gRPC server for `service` on 127.0.0.1 at a free port, and its address
// ("127.0.0.1:PORT"): how tests and benchmarks run a target in-process. It
// serves grpc.health.v1.Health as draftfeed-target does.
struct LoopbackServer {
  std::unique_ptr<grpc::Server> server;
  std::string address;
};
LoopbackServer ServeOnLoopback(TargetService* service);

// StreamHiddenStates is served raw (ByteBuffer in and out) so that payload
// chunks leave as slices pointing at the capture buffer, never copied into a
// protobuf `bytes` field; control messages are ordinary protobuf.
class TargetService final
    : public v1::TargetService::WithCallbackMethod_GetTargetInfo<
          v1::TargetService::WithRawCallbackMethod_StreamHiddenStates<v1::TargetService::Service>> {
 public:
  // `engines` are replicas of one model (one per device); not owned.
  TargetService(std::vector<Engine*> engines, ServiceOptions options);
  ~TargetService() override;

  grpc::ServerUnaryReactor* GetTargetInfo(grpc::CallbackServerContext* ctx,
                                          const v1::GetTargetInfoRequest* request,
                                          v1::TargetInfo* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StreamHiddenStates(
      grpc::CallbackServerContext* ctx) override;

  // Answers grpc.health.v1.Health for "draftfeed.v1.TargetService" (and the
  // server as a whole, "") on `server`'s default health service: SERVING
  // from now until the drain begins, NOT_SERVING from then on. A server built
  // without the default health service (grpc::EnableDefaultHealthCheckService)
  // has none; then this does nothing.
  void ServeHealth(grpc::Server* server);

  // Graceful shutdown, step 1: no new batches are accepted; every stream ends
  // with UNAVAILABLE once its accepted batches have been sent in full; health
  // checks answer NOT_SERVING.
  void BeginDrain();
  int64_t open_streams() const;
  // Step 2, after the server has shut down: finish queued work, join workers.
  void StopScheduler() { scheduler_.Stop(); }

  const ServiceOptions& options() const { return options_; }
  const Model& model() const { return engines_.front()->model(); }
  v1::TargetInfo Info() const;
  // The capture encodings every engine writes, in the first engine's order.
  std::vector<CaptureEncoding> encodings() const;
  // Most layers one batch may capture on every engine (0 = no limit), and
  // the error for a stream or batch that asks for more.
  int64_t max_capture_layers() const;
  // Whether every engine computes target outputs (they all hold lm_head).
  bool serves_target_outputs() const;
  // The most tokens one Batch may hold: options().max_sequence_tokens where
  // every engine can carry that much, else max_batch_tokens.
  int64_t max_sequence_tokens() const;
  // TargetInfo.batch_invariant: a sequence's bits ignore its batch and the
  // replica that runs it.
  bool batch_invariant() const;
  // TargetInfo.numerics: the engines' common Engine::numerics, empty where
  // they differ.
  std::string numerics() const;
  // What the stream transports need of this target.
  TransportEnv transport_env() const;
  Scheduler& scheduler() { return scheduler_; }
  bool draining() const { return draining_.load(); }
  // The most responses one stream has held queued and not yet written, over
  // the target's life: what the stream's memory holds beyond its payloads.
  int64_t peak_queued_responses() const { return streams_.peak_queued_responses(); }
  // What /metrics and the log count (the streams update it as they serve).
  TargetMetrics& metrics() { return metrics_; }
  const TargetMetrics& metrics() const { return metrics_; }
  // Each open stream's credits and waiting result bytes, now.
  std::vector<StreamLoad> StreamLoads() const;
  // Writes a refused stream's log line, at most kRefusalLinesPerS a second;
  // the next line written after some were held back says how many.
  void LogRefusedStream(const std::string& line) { streams_.LogRefusedStream(line); }
  static constexpr int64_t kRefusalLinesPerS = StreamRegistry::kRefusalLinesPerS;
  // What each stream is handed of this target (and /metrics' gauges and the
  // throughput line read): built once, at construction.
  const StreamContext& stream_context() const { return context_; }

 private:
  // Every stream_idle_timeout_s / 4 (at most 1 s), ends the idle streams
  // and (likewise for open_timeout_s) those that sent no Open in time;
  // with max_rejects_per_s, every 20 ms resumes the reads of streams whose
  // refused batches were throttled.
  void IdleLoop();

  std::vector<Engine*> engines_;
  const ServiceOptions options_;
  TargetMetrics metrics_;  // before scheduler_: its threads' results are counted until they stop
  Scheduler scheduler_;
  std::atomic<bool> draining_{false};
  StreamRegistry streams_;  // registered from their start until done
  const StreamContext context_;
  // Taken before the registry's lock (IdleLoop, BeginDrain).
  mutable std::mutex mu_;
  grpc::HealthCheckServiceInterface* health_ = nullptr;  // owned by the server; guarded by mu_
  std::condition_variable idle_cv_;
  bool stopping_idle_ = false;  // guarded by mu_
  std::thread idle_thread_;     // when a timeout above or max_rejects_per_s is > 0
};

}  // namespace draftfeed
