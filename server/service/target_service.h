// gRPC service of a target: GetTargetInfo and the StreamHiddenStates data
// plane (callback API, one reactor per stream, a scheduler shared by all).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server.h>

#include "common/capture_encoding.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "server/model/engine.h"
#include "server/service/auth_tokens.h"
#include "server/service/log_rate_limit.h"
#include "server/service/scheduler.h"
#include "server/service/stream_transport.h"
#include "server/service/target_metrics.h"

namespace draftfeed {

struct ServiceOptions {
  int64_t max_batch_tokens = 16384;            // tokens of one forward
  // Most tokens of one Batch, and so its longest sequence: a batch over
  // max_batch_tokens runs in forward chunks, the engines carrying each
  // spanning sequence across them (they must have ReserveCarry'd this much).
  // At most max_batch_tokens (0 included): no chunking.
  int64_t max_sequence_tokens = 0;
  int32_t default_credits = 4;                 // Open.max_inflight_batches == 0
  int32_t max_credits = 32;                    // larger requests are clamped
  int64_t chunk_bytes = 4 << 20;               // payload per HiddenChunk (whole tokens)
  int64_t max_queued_batches = 256;            // scheduler backstop
  double throttle_tokens_per_s = 0;            // > 0: cap the engine's rate (benchmarks)
  int64_t host_pool_bytes = int64_t{2} << 30;  // idle capture buffers kept for reuse
  int64_t host_memory_cap_bytes = 0;           // capture buffers live + idle; 0 = no cap
  // Per stream: bytes of results taken for the forward and not yet written
  // (captures, and unsent BatchErrors); at this much the stream's batches
  // wait and other streams run on. 0 = no cap.
  int64_t max_stream_pending_bytes = int64_t{2048} << 20;
  int32_t max_streams = 64;            // open streams; the next is RESOURCE_EXHAUSTED
  // Open streams of one client: its bearer token's name when tokens are
  // checked, else its address (without the port); 0 = no share beyond
  // max_streams. A stream counts from its Open on, so that streams which
  // never send one cannot lock good clients out.
  int32_t max_streams_per_client = 0;
  // A stream that has sent no Open this long after it started is ended
  // (DEADLINE_EXCEEDED); 0 = never.
  double open_timeout_s = 10;
  double stream_idle_timeout_s = 300;  // a stream idle this long is ended; 0 = never
  // Per stream: batches refused (invalid, or sent while draining) beyond a
  // burst of kRejectBurst are read at most this many a second; a flood of
  // invalid batches costs the target reads and parses that no credit or
  // fair queue accounts for. 0 = unlimited.
  double max_rejects_per_s = 100;
  // Capture buffers' memory: pinned (PinnedHostAllocator) for GPU engines.
  HostAllocator host_allocator = HostAllocator::Heap();
  bool enable_nccl = true;             // offer TRANSPORT_NCCL (one GPU engine, NCCL built in)
  double nccl_timeout_s = 120.0;       // one batch's NCCL send must finish in this
  double nccl_setup_timeout_s = 60.0;  // a stream's NCCL set-up and handshake, likewise
  bool nccl_across_hosts = true;       // offer NCCL to trainers on other hosts too
  // The host trainers' Open.host_id is compared with; empty id: LocalHost().
  // Tests set it to make one machine's target and trainer look like two hosts.
  HostIdentity host;
  // Bearer tokens every call but health must carry (--auth_tokens_file);
  // null: none are checked.
  std::shared_ptr<const TokenChecker> tokens;
};

class StreamReactor;

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
  absl::Status CheckCaptureLayers(size_t asked) const;
  // What the stream transports need of this target.
  TransportEnv transport_env() const;
  Scheduler& scheduler() { return scheduler_; }
  bool draining() const { return draining_.load(); }
  // The most responses one stream has held queued and not yet written, over
  // the target's life: what the stream's memory holds beyond its payloads.
  int64_t peak_queued_responses() const { return peak_queued_responses_.load(); }
  // What /metrics and the log count (the streams update it as they serve).
  TargetMetrics& metrics() { return metrics_; }
  const TargetMetrics& metrics() const { return metrics_; }
  // Each open stream's credits and waiting result bytes, now.
  std::vector<StreamLoad> StreamLoads() const;
  // Writes a refused stream's log line, at most kRefusalLinesPerS a second;
  // the next line written after some were held back says how many.
  void LogRefusedStream(const std::string& line);
  static constexpr int64_t kRefusalLinesPerS = 10;

 private:
  friend class StreamReactor;
  // Every stream is registered from its start (for the drain and the idle
  // and Open deadlines) until OnDone unregisters it.
  void Register(StreamReactor* r);
  void Unregister(StreamReactor* r);
  // At a stream's Open: counts it as open, or RESOURCE_EXHAUSTED naming
  // --max_streams (that many are open) or --max_streams_per_client (its
  // client, `client`, holds its share). Unregister uncounts it.
  absl::Status Admit(StreamReactor* r, const std::string& client);
  void NoteQueuedResponses(int64_t queued);
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
  std::atomic<int64_t> peak_queued_responses_{0};
  mutable std::mutex mu_;
  std::set<StreamReactor*> streams_;
  // The open (admitted) streams, by client. Its own lock: Admit runs under a
  // stream's lock, which IdleLoop takes under mu_.
  mutable std::mutex admit_mu_;
  std::map<StreamReactor*, std::string> admitted_;
  std::map<std::string, int32_t> client_streams_;
  grpc::HealthCheckServiceInterface* health_ = nullptr;  // owned by the server; guarded by mu_
  std::condition_variable idle_cv_;
  bool stopping_idle_ = false;  // guarded by mu_
  LogRateLimit refusal_log_{kRefusalLinesPerS};
  std::thread idle_thread_;     // when a timeout above or max_rejects_per_s is > 0
};

}  // namespace draftfeed
