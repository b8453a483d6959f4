#include "server/service/target_service.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/str_cat.h"
#include "common/log_line.h"
#include "common/thread_name.h"
#include "server/model/sharding_plan.h"
#include "server/service/call_auth.h"
#include "server/service/status_util.h"
#include "server/service/stream_reactor.h"
#include "server/service/transport_registry.h"
#include "server/service/version.h"

namespace draftfeed {

TargetService::TargetService(std::vector<Engine*> engines, ServiceOptions options)
    : engines_(std::move(engines)),
      options_(options),
      scheduler_(engines_, options.max_queued_batches, options.throttle_tokens_per_s,
                 options.host_pool_bytes, options.host_allocator),
      streams_(options.max_streams, options.max_streams_per_client),
      context_{.options = options_,
               .model = model(),
               .info = Info(),
               .encodings = encodings(),
               .serves_target_outputs = serves_target_outputs(),
               .max_capture_layers = max_capture_layers(),
               .max_sequence_tokens = max_sequence_tokens(),
               .transport_env = transport_env(),
               .scheduler = scheduler_,
               .metrics = metrics_,
               .streams = streams_,
               .draining = draining_} {
  scheduler_.set_host_memory_cap(options.host_memory_cap_bytes);
  if (options_.stream_idle_timeout_s > 0 || options_.open_timeout_s > 0 ||
      options_.max_rejects_per_s > 0) {
    idle_thread_ = std::thread([this] {
      NameThisThread("df-idle");
      IdleLoop();
    });
  }
}

TargetService::~TargetService() {
  if (idle_thread_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_idle_ = true;
    }
    idle_cv_.notify_all();
    idle_thread_.join();
  }
  scheduler_.Stop();
}

void TargetService::IdleLoop() {
  using Duration = std::chrono::steady_clock::duration;
  const bool idle_check = options_.stream_idle_timeout_s > 0;
  const bool open_check = options_.open_timeout_s > 0;
  const auto timeout = std::chrono::duration_cast<Duration>(
      std::chrono::duration<double>(idle_check ? options_.stream_idle_timeout_s : 1.0));
  const auto open_timeout = std::chrono::duration_cast<Duration>(
      std::chrono::duration<double>(open_check ? options_.open_timeout_s : 1.0));
  auto period = std::min<Duration>(std::min(timeout, open_timeout) / 4, std::chrono::seconds(1));
  if (options_.max_rejects_per_s > 0) {
    period = std::min<std::chrono::steady_clock::duration>(period, std::chrono::milliseconds(20));
  }
  std::unique_lock<std::mutex> lock(mu_);
  while (!idle_cv_.wait_for(lock, period, [this] { return stopping_idle_; })) {
    // The registry's lock keeps every registered stream alive (OnDone
    // unregisters first).
    const auto now = std::chrono::steady_clock::now();
    streams_.ForEach([&](RegisteredStream* r) {
      r->ResumeIfThrottled(now);
      if (idle_check && r->EndIfIdle(now, timeout)) r->Cancel();
      if (open_check) r->EndIfNotOpened(now, open_timeout);
    });
  }
}

int64_t TargetService::max_sequence_tokens() const {
  const int64_t forward = options_.max_batch_tokens;
  int64_t limit = options_.max_sequence_tokens;
  if (limit <= forward) return forward;
  for (const Engine* e : engines_) limit = std::min(limit, std::max(forward, e->max_carry_tokens()));
  return limit;
}

// Every engine's rows ignore their batch, and all compute the same bits (a
// batch gets one answer whichever replica runs it).
bool TargetService::batch_invariant() const {
  for (const Engine* e : engines_) {
    if (!e->batch_invariant()) return false;
  }
  return !numerics().empty();
}

std::string TargetService::numerics() const {
  if (engines_.empty()) return "";
  const std::string first = engines_.front()->numerics();
  for (const Engine* e : engines_) {
    if (e->numerics() != first) return "";
  }
  return first;
}

v1::TargetInfo TargetService::Info() const {
  const Model& m = model();
  v1::TargetInfo info;
  info.set_model_id(m.id);
  info.set_architecture(std::string(ArchName(m.config.arch)));
  info.set_num_layers(static_cast<int32_t>(m.config.num_layers));
  info.set_hidden_size(static_cast<int32_t>(m.config.hidden_size));
  info.set_vocab_size(static_cast<int32_t>(m.config.vocab_size));
  info.set_dtype("bf16");
  info.set_fingerprint(m.fingerprint);
  for (Engine* e : engines_) info.add_devices(e->device_name());
  info.set_max_batch_tokens(options_.max_batch_tokens);
  info.set_max_sequence_tokens(max_sequence_tokens());
  info.set_batch_invariant(batch_invariant());
  info.set_numerics(numerics());
  const TransportEnv env = transport_env();
  for (v1::Transport t : OfferedTransports(env)) info.add_transports(t);
  info.set_nccl_across_hosts(OffersNcclAcrossHosts(env));
  for (CaptureEncoding e : encodings()) info.add_encodings(static_cast<v1::Encoding>(e));
  info.set_server_version(std::string(kDraftfeedVersion));
  for (LayerKind k : m.config.layer_types) {
    info.add_layer_types(k == LayerKind::kFullAttention ? "full_attention" : "linear_attention");
  }
  info.set_max_credits(options_.max_credits);
  info.set_max_capture_layers(static_cast<int32_t>(max_capture_layers()));
  if (serves_target_outputs()) {
    v1::TargetOutputsOffer* offer = info.mutable_target_outputs();
    offer->set_max_top_k(static_cast<int32_t>(std::min<int64_t>(kMaxTopK, m.config.vocab_size)));
    offer->set_max_draft_vocab(
        static_cast<int32_t>(std::min<int64_t>(kMaxDraftVocab, m.config.vocab_size)));
    offer->add_draft_probs_encodings(v1::ENCODING_BF16);
    offer->add_draft_probs_encodings(v1::ENCODING_FP8_E4M3);
  }
  const Engine::ParallelLayout layout = engines_.front()->layout();
  info.mutable_layout()->set_tp(layout.tp);
  info.mutable_layout()->set_moe_parallel(layout.moe_parallel);
  int64_t rank_bytes = layout.rank_weight_bytes;
  if (rank_bytes == 0) {  // the whole model on each device: the tp 1 plan's one rank
    absl::StatusOr<ShardingPlan> whole = PlanTensorParallel(m.config, 1);
    if (whole.ok()) rank_bytes = RankWeightBytes(*whole, m);
  }
  info.mutable_layout()->set_rank_weight_bytes(rank_bytes);
  return info;
}

std::vector<CaptureEncoding> TargetService::encodings() const {
  std::vector<CaptureEncoding> served = engines_.front()->encodings();
  for (Engine* e : engines_) {
    const std::vector<CaptureEncoding> its = e->encodings();
    std::erase_if(served, [&](CaptureEncoding c) {
      return std::find(its.begin(), its.end(), c) == its.end();
    });
  }
  return served;
}

bool TargetService::serves_target_outputs() const {
  return std::all_of(engines_.begin(), engines_.end(),
                     [](const Engine* e) { return e->serves_target_outputs(); });
}

int64_t TargetService::max_capture_layers() const {
  int64_t most = 0;
  for (Engine* e : engines_) {
    const int64_t m = e->max_capture_layers();
    if (m > 0) most = most == 0 ? m : std::min(most, m);
  }
  return most;
}

grpc::ServerUnaryReactor* TargetService::GetTargetInfo(grpc::CallbackServerContext* ctx,
                                                       const v1::GetTargetInfoRequest*,
                                                       v1::TargetInfo* response) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (absl::StatusOr<std::string> who =
          AuthenticateCall(options_.tokens.get(), *ctx, "GetTargetInfo");
      !who.ok()) {
    reactor->Finish(ToGrpcStatus(who.status()));
    return reactor;
  }
  *response = Info();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* TargetService::StreamHiddenStates(
    grpc::CallbackServerContext* ctx) {
  absl::StatusOr<std::string> who =
      AuthenticateCall(options_.tokens.get(), *ctx, "StreamHiddenStates");
  if (!who.ok()) {
    metrics_.CountStreamRefused(who.status().code());
    LogRefusedStream(
        StreamClosedLine({.peer = ctx->peer(), .refused = true, .status = who.status()}));
    return new RefusedStream(ToGrpcStatus(who.status()));
  }
  return new StreamReactor(context_, ctx, *std::move(who));
}

void TargetService::ServeHealth(grpc::Server* server) {
  std::lock_guard<std::mutex> lock(mu_);
  health_ = server->GetHealthCheckService();
  if (health_ == nullptr) return;
  const bool serving = !draining_.load();
  health_->SetServingStatus(v1::TargetService::service_full_name(), serving);
  health_->SetServingStatus("", serving);
}

void TargetService::BeginDrain() {
  draining_ = true;
  std::lock_guard<std::mutex> lock(mu_);
  // Load balancers stop sending new streams here while the open ones finish.
  if (health_ != nullptr) health_->SetServingStatus(false);
  streams_.ForEach([](RegisteredStream* r) { r->Drain(); });
}

LoopbackServer ServeOnLoopback(TargetService* service) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(service);
  LoopbackServer out;
  out.server = builder.BuildAndStart();
  out.address = absl::StrCat("127.0.0.1:", port);
  if (out.server != nullptr) service->ServeHealth(out.server.get());
  return out;
}

TransportEnv TargetService::transport_env() const {
  return TransportEnv{.engines = engines_,
                      .chunk_bytes = options_.chunk_bytes,
                      .enable_nccl = options_.enable_nccl,
                      .nccl_timeout_s = options_.nccl_timeout_s,
                      .nccl_setup_timeout_s = options_.nccl_setup_timeout_s,
                      .nccl_across_hosts = options_.nccl_across_hosts,
                      .host = options_.host.id.empty() ? LocalHost() : options_.host};
}

std::vector<StreamLoad> TargetService::StreamLoads() const { return streams_.Loads(); }

int64_t TargetService::open_streams() const { return streams_.open_streams(); }

}  // namespace draftfeed
