// draftfeed-target: serves a frozen Qwen model's hidden states over gRPC.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#if DRAFTFEED_HAVE_CUDA
#include "server/model/cuda_engine.h"
#endif
#include "common/log_line.h"
#include "common/nccl_hosts.h"
#include "server/model/fp8_quantize.h"
#include "server/model/model.h"
#include "server/model/sharding_plan.h"
#include "server/model/weight_check.h"
#include "server/service/auth_tokens.h"
#include "server/service/metrics_http.h"
#include "server/service/startup.h"
#include "server/service/target_engines.h"
#include "server/service/target_flag_checks.h"
#include "server/service/target_metrics.h"
#include "server/service/target_service.h"
#include "server/service/target_signals.h"
#include "server/service/tls_options.h"
#include "server/service/transport_registry.h"
#include "server/service/version.h"

ABSL_FLAG(std::string, model, "tiny-random",
          "Checkpoint directory (HF config.json + safetensors, single or sharded) or a built-in "
          "random model (every one is listed under Models above).");
ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "Address to serve on. Port 0 picks a free port (see --port_file).");
ABSL_FLAG(std::string, device, "auto",
          "cpu, cuda:N, or auto (cuda:0 when a GPU and the CUDA engine are present, else cpu).");
ABSL_FLAG(std::string, devices, "",
          "Comma-separated GPU indices, e.g. 0,1,2: one engine replica per GPU behind this "
          "endpoint, or with --tp N one instance per N consecutive GPUs (overrides --device).");
ABSL_FLAG(int32_t, threads, 0, "CPU engine threads (0 = all cores; split over the --tp ranks).");
ABSL_FLAG(int32_t, tp, 1,
          "Tensor-parallel ranks holding one model instance: heads, FFN columns and experts are "
          "split over them and their partial outputs summed after every mixer and MLP. With "
          "--device cpu the ranks are threads; with --devices, every tp consecutive GPUs form "
          "one instance summed through NCCL (--devices 0,1,2,3 --tp 2: two instances of two "
          "GPUs). Ranks may share a GPU (--devices 0,0 --tp 2) to prove a plan on one GPU. FP8 "
          "checkpoints are cut with their 128x128 block scales: a --tp whose pieces fall off the "
          "blocks is refused at start-up, naming the tensor.");
ABSL_FLAG(std::string, moe_parallel, "ep",
          "MoE models at --tp > 1: ep (each rank holds num_experts/tp whole experts) or split "
          "(each rank holds 1/tp of every expert's moe_intermediate_size).");
ABSL_FLAG(bool, print_plan, false,
          "Print the tensor-parallel plan of --model at --tp and --moe_parallel (per-rank weight "
          "bytes, each tensor's cut, the all-reduces) and exit without serving.");
ABSL_FLAG(int64_t, max_batch_tokens, 16384,
          "Tokens of one forward: the capture buffers and GPU workspace are sized for it. A batch "
          "up to --max_sequence_tokens runs in forwards of at most this many tokens.");
// The default where no flag is given; an engine that cannot carry sequences
// then serves without chunked prefill instead of refusing to start.
constexpr int64_t kDefaultMaxSequenceTokens = 262144;
ABSL_FLAG(int64_t, max_sequence_tokens, kDefaultMaxSequenceTokens,
          "Most tokens of one batch, and so its longest sequence. A batch over --max_batch_tokens "
          "runs in chunks of at most that many (chunked prefill): each engine keeps one "
          "sequence's attention K/V and GDN state across them, planned at start-up (GPU memory: "
          "the K/V grow with this flag). Equal to --max_batch_tokens: no chunking.");
ABSL_FLAG(int32_t, max_capture_layers, 8,
          "GPU engines: most layer ids one stream or batch may capture (DFlash uses 5, EAGLE-3 "
          "4); two capture buffers of max_batch_tokens x this x hidden bf16 are reserved. More "
          "fails with INVALID_ARGUMENT. The CPU engine has no limit.");
ABSL_FLAG(int32_t, default_credits, 4, "In-flight batches per stream when the client asks for 0.");
ABSL_FLAG(int32_t, max_credits, 32, "Upper bound on a stream's in-flight batches.");
ABSL_FLAG(int64_t, chunk_bytes, 4 << 20,
          "Payload bytes per HiddenChunk (rounded to whole tokens).");
ABSL_FLAG(int64_t, max_queued_batches, 256, "Scheduler queue bound across all streams.");
ABSL_FLAG(int64_t, max_stream_pending_mib, 2048,
          "Per stream: MiB of results taken for the forward and not yet written to the client "
          "(captures, and unsent BatchErrors); at this much the stream's batches wait while "
          "other streams run on (two of a stream's batches always fit, whatever their size, so "
          "that one computes while the last is written). The default holds "
          "2-3 batches at the Qwen3.6-27B shape (16,384 tokens x 5 layers x 5,120 x 2 B = 800 "
          "MiB a batch; 1,280 MiB at 8 layers) where 32 credits could pin 25 GiB; 64 streams "
          "of 2 GiB still add up: cap the total with --host_memory_cap_gib. 0 = no cap.");
ABSL_FLAG(int32_t, max_streams, 64,
          "Open streams this target serves at once; the next is refused with "
          "RESOURCE_EXHAUSTED until one closes.");
ABSL_FLAG(int32_t, max_streams_per_client, 0,
          "Open streams of one client at once (its bearer token's name with --auth_tokens_file, "
          "else its address), so that one client cannot hold every slot; the next is refused "
          "with RESOURCE_EXHAUSTED naming this flag. 0 = half of --max_streams (at least 1).");
ABSL_FLAG(double, open_timeout_s, 10,
          "End a stream (DEADLINE_EXCEEDED) that has not sent its Open this many seconds after "
          "it started; a stream counts against --max_streams only from its Open. 0 = never.");
ABSL_FLAG(double, max_rejects_per_s, 100,
          "Per stream: refused batches (invalid, or sent while draining) past a burst of 32 are "
          "read at most this many a second, so a client flooding invalid batches cannot take "
          "the target's cores from the others (0 = no limit).");
ABSL_FLAG(double, stream_idle_timeout_s, 300,
          "End a stream (DEADLINE_EXCEEDED) that for this long has sent no message, taken no "
          "write and had no batch running (a stream waiting for its own batches, or reading a "
          "large result, is not idle); its unsent results and queued batches are dropped. A stream "
          "with a write pending (a slow reader) gets 4 times this with nothing completed. 0 = "
          "never.");
ABSL_FLAG(int32_t, drain_timeout_s, 60,
          "On SIGTERM/SIGINT: seconds to let accepted batches finish before cancelling. A "
          "second SIGTERM/SIGINT during the drain exits at once (status 1), logging the streams "
          "and batches it abandons; one while the model loads exits 0. SIGHUP never stops the "
          "target.");
ABSL_FLAG(double, throttle_tokens_per_s, 0,
          "Cap the engine at this many tokens/s (0 = off): emulates a slower device in "
          "balancing and split benchmarks.");
ABSL_FLAG(double, host_memory_cap_gib, 0,
          "Cap on the host memory of captured hidden states (batches being sent plus buffers "
          "kept for reuse), GiB; a forward waits for buffers to come back rather than exceed "
          "it (one batch always runs). 0 = no cap beyond the streams' credits.");
ABSL_FLAG(bool, nccl, true,
          "Offer the NCCL transport (trainers with their own GPU receive hidden states GPU to "
          "GPU). Needs a target with exactly one GPU.");
ABSL_FLAG(double, nccl_timeout_s, 120,
          "Each batch's NCCL send must finish within this many seconds; otherwise the "
          "communicator is aborted and the stream ends.");
ABSL_FLAG(double, nccl_setup_timeout_s, 60,
          "An NCCL stream's set-up (joining the trainer's communicator, the handshake) must "
          "finish within this many seconds; otherwise the stream ends naming what to check.");
ABSL_FLAG(bool, nccl_across_hosts, true,
          "Offer NCCL to trainers on other hosts too (NCCL's network transport: InfiniBand/RoCE, "
          "else sockets; they ask with transport=nccl, or auto with nccl_across_hosts=True). "
          "false: NCCL for trainers on this host only, others are refused naming this flag.");
ABSL_FLAG(std::string, nccl_socket_ifname, "",
          "The network interface(s) NCCL uses to reach trainers on other hosts, as "
          "NCCL_SOCKET_IFNAME (e.g. eth0, ^docker,lo); empty: NCCL_SOCKET_IFNAME from the "
          "environment, else NCCL's own choice. A value other than the environment's is "
          "refused.");
ABSL_FLAG(std::string, port_file, "", "If set, the bound port is written there once serving.");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain to serve TLS with (with --tls_key). Without TLS, a --listen "
          "address other than loopback needs --insecure.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA certificate(s): every client must present a certificate signed by one "
          "(mutual TLS). Needs --tls_cert.");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "File of named bearer tokens, one 'name: token' a line (# comments): every call but "
          "health must carry one ('authorization: Bearer <token>'); the name appears in the "
          "stream's log line. Re-read on SIGHUP (a bad file then keeps the old set).");
ABSL_FLAG(bool, insecure, false,
          "Serve plaintext on a --listen address other than loopback (refused without it "
          "unless TLS is configured).");
ABSL_FLAG(std::string, quantize, "none",
          "Quantize the model at load: none, or fp8 (e4m3 weights with one fp32 scale per "
          "128x128 block, as Qwen's FP8 checkpoints; refused for a checkpoint already FP8).");
ABSL_FLAG(std::string, fp8_experts, "fp8",
          "FP8 MoE models on CUDA: run the routed experts through FP8 grouped GEMMs (fp8: "
          "the FP8 engine's maths, half the expert memory, and the faster: on an H200 the "
          "Qwen3.6-35B-A3B-FP8 shape runs 104,188 tokens/s, and 72,231 with bf16 experts when "
          "fp8 ran 96,535) or "
          "dequantize them to bf16 at load (bf16: twice the expert memory).");
ABSL_FLAG(std::string, fp8_gemm, "auto",
          "FP8 models on CUDA: the GEMM behind the dense FP8 projections. auto: draftfeed's "
          "Hopper GEMM on sm_90 (the faster on an H200: 1.04-1.09x cuBLASLt's), draftfeed's "
          "portable one on other GPUs (B200, RTX PRO 6000); cublaslt: cuBLASLt's (refused at start-up off sm_90); "
          "draftfeed: draftfeed's own, its Hopper kernel where it runs, else the portable one. "
          "MoE experts use draftfeed's on Hopper either way, and so (except under cublaslt) "
          "does each MLP's gate_up, fused with SwiGLU and down's quantization.");
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port to serve Prometheus metrics on, at /metrics over plaintext HTTP (e.g. "
          "127.0.0.1:9400; port 0 picks a free one, logged at start-up); GET only, no request "
          "bodies. An address other than loopback needs --metrics_token_file, or --insecure on "
          "a plaintext target. Empty = off.");
ABSL_FLAG(std::string, metrics_token_file, "",
          "File of named bearer tokens for /metrics, as --auth_tokens_file's ('name: token' a "
          "line): every scrape must send 'Authorization: Bearer <token>' (Prometheus: "
          "authorization.credentials_file). Kept apart from the stream tokens, which must not "
          "travel over plaintext HTTP. Re-read on SIGHUP.");
ABSL_FLAG(bool, metrics_per_stream, false,
          "Also export each open stream's waiting result bytes as its own series (labels "
          "stream and client): a series lives while its stream is open, but every stream "
          "opened adds one to Prometheus, so off by default; the sum and max over streams are "
          "always exported.");
ABSL_FLAG(double, log_every_s, 60,
          "Every this many seconds, one stderr line with the interval's batches, tokens, "
          "tok/s and MiB sent, the open streams, credits in use and queue depth. 0 = off.");
ABSL_FLAG(int32_t, load_threads, 0,
          "Threads that read a checkpoint's weights into pinned chunks for the GPU upload "
          "(0 = min(8, cores)); more help a disk that needs many requests in flight.");
ABSL_FLAG(bool, check_weights, true,
          "At load, scan every weight for NaN and infinities, FP8 weights for NaN codes "
          "(0x7f, 0xff) and block scales that are not finite, not > 0 or over 2^64/448 (the "
          "FP8 GEMMs would overflow), and refuse to start on the first, naming the tensor and "
          "element; without it such a checkpoint serves NaN states. Cost: one read of every "
          "weight on all cores, logged at start-up: from the page cache about 0.15 s a GiB "
          "(5.2 GiB in 0.7 s on a 2-core VM), from a cold disk the disk's own read (there 1 "
          "GiB/s), which the GPU upload then finds cached. --check_weights=false skips it.");

namespace draftfeed {
namespace {

// Removes the server reflection plugin from a ServerBuilder.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const std::unique_ptr<grpc::ServerBuilderPlugin>& p) {
      return p->name().find("reflection") != std::string::npos;
    });
  }
};

int Fail(const std::string& msg) {
  LogF("draftfeed-target: error: %s", msg.c_str());
  return 1;
}

// SIGHUP: re-reads one token file into `checker` (null: not configured).
void ReloadOnSighup(const std::string& path, TokenChecker* checker) {
  if (checker == nullptr) return;
  std::vector<std::string> warnings;
  if (absl::Status s = ReloadTokenFile(path, checker, &warnings); !s.ok()) {
    LogF("draftfeed-target: SIGHUP: kept the %zu tokens in use: %s", checker->size(),
         std::string(s.message()).c_str());
    return;
  }
  for (const std::string& w : warnings) LogF("draftfeed-target: warning: %s", w.c_str());
  LogF("draftfeed-target: SIGHUP: %zu bearer tokens from %s, for calls from now on",
       checker->size(), path.c_str());
}

// --print_plan: the tensor-parallel plan of --model, and the exit status a
// target would have with it.
int PrintPlan(int tp, MoeParallel moe_parallel) {
  auto model = OpenModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return Fail(std::string(model.status().message()));
  auto plan = PlanTensorParallel((*model)->config, tp, moe_parallel);
  if (!plan.ok()) return Fail(std::string(plan.status().message()));
  std::printf("%s: %s", (*model)->id.c_str(), DescribePlan(*plan, model->get()).c_str());
  // The plan a target would refuse at start-up exits as that target would.
  if (absl::Status s = CheckBlockScaleCuts(*plan, **model); !s.ok()) {
    return Fail(std::string(s.message()));
  }
  return 0;
}

// One token file (--auth_tokens_file or --metrics_token_file), its warnings
// logged; null when `path` is empty.
absl::StatusOr<std::shared_ptr<TokenChecker>> LoadTokens(const std::string& path) {
  if (path.empty()) return nullptr;
  auto file = ReadTokenFile(path);
  if (!file.ok()) return file.status();
  for (const std::string& w : file->warnings) LogF("draftfeed-target: warning: %s", w.c_str());
  return std::make_shared<TokenChecker>(std::move(file->tokens));
}

// Where the target serves and reports, and who may call it.
struct Exposure {
  ListenSecurity security;
  std::shared_ptr<grpc::ServerCredentials> credentials;
  std::shared_ptr<TokenChecker> tokens, metrics_tokens;  // null: not configured
};

// Everything about where the target serves and reports, and its security,
// settled before the model loads (minutes for a large checkpoint): a bad
// address, certificate or token file fails in a second, each with one message
// instead of gRPC's log. SIGHUP re-reads the token files from here on.
absl::StatusOr<Exposure> CheckExposure(TargetSignals* signals) {
  if (absl::Status s = CheckListenAddress(absl::GetFlag(FLAGS_listen)); !s.ok()) return s;
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    if (absl::Status s = CheckPortFile(pf); !s.ok()) return s;
  }
  Exposure e;
  e.security = {.tls_cert = absl::GetFlag(FLAGS_tls_cert),
                .tls_key = absl::GetFlag(FLAGS_tls_key),
                .tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca),
                .insecure = absl::GetFlag(FLAGS_insecure)};
  auto credentials = MakeServerCredentials(absl::GetFlag(FLAGS_listen), e.security);
  if (!credentials.ok()) return credentials.status();
  e.credentials = *std::move(credentials);
  const std::string tokens_path = absl::GetFlag(FLAGS_auth_tokens_file);
  auto tokens = LoadTokens(tokens_path);
  if (!tokens.ok()) return tokens.status();
  e.tokens = *std::move(tokens);
  const std::string metrics_tokens_path = absl::GetFlag(FLAGS_metrics_token_file);
  auto metrics_tokens = LoadTokens(metrics_tokens_path);
  if (!metrics_tokens.ok()) {
    return absl::Status(metrics_tokens.status().code(),
                        absl::StrCat("--metrics_token_file: ", metrics_tokens.status().message()));
  }
  e.metrics_tokens = *std::move(metrics_tokens);
  if (const std::string ml = absl::GetFlag(FLAGS_metrics_listen); !ml.empty()) {
    if (absl::Status s =
            MetricsHttpServer::CheckExposure(ml, e.security.insecure, e.metrics_tokens != nullptr);
        !s.ok()) {
      return s;
    }
  } else if (e.metrics_tokens != nullptr) {
    return absl::InvalidArgumentError(
        "--metrics_token_file needs --metrics_listen (the /metrics endpoint it guards)");
  }
  if (e.tokens != nullptr || e.metrics_tokens != nullptr) {
    signals->SetReload(
        [tokens_path, metrics_tokens_path, tokens = e.tokens, metrics_tokens = e.metrics_tokens] {
          ReloadOnSighup(tokens_path, tokens.get());
          ReloadOnSighup(metrics_tokens_path, metrics_tokens.get());
        });
  }
  return e;
}

// The model and the engines that serve it, ready for batches.
struct LoadedTarget {
  std::unique_ptr<Model> model;
  std::vector<std::unique_ptr<Engine>> engines;
  std::vector<Engine*> engine_ptrs;
  double load_s = 0;
};

// Loads --model, checks its weights (unless --check_weights=false), applies
// --quantize, makes the engines of the tensor-parallel plan and reserves
// their sequence carry.
absl::StatusOr<LoadedTarget> LoadTarget(const std::vector<int>& gpus, int tp,
                                        MoeParallel moe_parallel) {
  const auto t0 = std::chrono::steady_clock::now();
  LoadedTarget t;
  auto model = OpenModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return model.status();
  t.model = *std::move(model);
  if (absl::GetFlag(FLAGS_check_weights)) {
    WeightCheckStats checked;
    if (absl::Status s = CheckWeightsFinite(*t.model, &checked); !s.ok()) return s;
    LogF(
        "draftfeed-target: checked %lld weight tensors (%.1f MiB) for NaN, Inf and bad FP8 "
        "scales in %.3fs on %d threads (--check_weights=false skips it)",
        static_cast<long long>(checked.tensors), static_cast<double>(checked.bytes) / (1 << 20),
        checked.seconds, checked.threads);
  }
  if (absl::Status s = ApplyQuantizeFlag(*t.model, absl::GetFlag(FLAGS_quantize)); !s.ok()) {
    return s;
  }
  // The plan checks --tp against the model's head counts and widths.
  auto plan = PlanTensorParallel(t.model->config, tp, moe_parallel);
  if (!plan.ok()) return plan.status();
  auto engines = MakeTargetEngines(t.model.get(), *plan,
                                   {.gpus = gpus,
                                    .cpu_threads = absl::GetFlag(FLAGS_threads),
                                    .max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens),
                                    .max_capture_layers = absl::GetFlag(FLAGS_max_capture_layers),
                                    .fp8_expert_gemms = absl::GetFlag(FLAGS_fp8_experts) == "fp8",
                                    .fp8_gemm = absl::GetFlag(FLAGS_fp8_gemm),
                                    .load_threads = absl::GetFlag(FLAGS_load_threads)});
  if (!engines.ok()) return engines.status();
  t.engines = *std::move(engines);
  for (auto& e : t.engines) t.engine_ptrs.push_back(e.get());
  const int64_t max_sequence_tokens = absl::GetFlag(FLAGS_max_sequence_tokens);
  if (absl::Status s = ReserveSequenceCarry(
          t.engine_ptrs,
          {.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens),
           .max_sequence_tokens = max_sequence_tokens,
           .require_sequence_tokens = max_sequence_tokens != kDefaultMaxSequenceTokens});
      !s.ok()) {
    return s;
  }
  if (const Engine::ParallelLayout l = t.engine_ptrs.front()->layout(); l.tp > 1) {
    LogF("draftfeed-target: tensor parallel over %d ranks%s, %.1f MiB of weights per rank", l.tp,
         l.moe_parallel.empty() ? "" : absl::StrCat(", moe ", l.moe_parallel).c_str(),
         static_cast<double>(l.rank_weight_bytes) / (1 << 20));
  }
  t.load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return t;
}

ServiceOptions ServiceOptionsFromFlags(const std::vector<int>& gpus,
                                       std::shared_ptr<TokenChecker> tokens) {
  ServiceOptions options;
  options.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  options.max_sequence_tokens = absl::GetFlag(FLAGS_max_sequence_tokens);
  options.default_credits = absl::GetFlag(FLAGS_default_credits);
  options.max_credits = absl::GetFlag(FLAGS_max_credits);
  options.chunk_bytes = absl::GetFlag(FLAGS_chunk_bytes);
  options.max_queued_batches = absl::GetFlag(FLAGS_max_queued_batches);
  options.max_stream_pending_bytes = absl::GetFlag(FLAGS_max_stream_pending_mib) << 20;
  options.max_streams = absl::GetFlag(FLAGS_max_streams);
  options.max_streams_per_client = absl::GetFlag(FLAGS_max_streams_per_client);
  if (options.max_streams_per_client == 0) {
    options.max_streams_per_client = std::max(1, options.max_streams / 2);
  }
  options.open_timeout_s = absl::GetFlag(FLAGS_open_timeout_s);
  options.stream_idle_timeout_s = absl::GetFlag(FLAGS_stream_idle_timeout_s);
  options.max_rejects_per_s = absl::GetFlag(FLAGS_max_rejects_per_s);
  options.throttle_tokens_per_s = absl::GetFlag(FLAGS_throttle_tokens_per_s);
#if DRAFTFEED_HAVE_CUDA
  // Pinned capture buffers: the engines copy into them at full bandwidth
  // while their next forward runs.
  if (!gpus.empty()) options.host_allocator = PinnedHostAllocator();
#else
  (void)gpus;
#endif
  options.host_memory_cap_bytes =
      static_cast<int64_t>(absl::GetFlag(FLAGS_host_memory_cap_gib) * (int64_t{1} << 30));
  options.enable_nccl = absl::GetFlag(FLAGS_nccl);
  options.nccl_timeout_s = absl::GetFlag(FLAGS_nccl_timeout_s);
  options.nccl_setup_timeout_s = absl::GetFlag(FLAGS_nccl_setup_timeout_s);
  options.nccl_across_hosts = absl::GetFlag(FLAGS_nccl_across_hosts);
  options.tokens = std::move(tokens);
  return options;
}

// Builds and starts the gRPC server on --listen; its bound port in `port`.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(TargetService* service,
                                                              const Exposure& exposure, int* port) {
  grpc::EnableDefaultHealthCheckService(true);
  // Reflection cannot check a bearer token, so a target that checks them
  // serves none. Linking grpc++_reflection registers its plugin with every
  // ServerBuilder (a static initializer), called for or not: WithoutReflection
  // takes it out again.
  grpc::ServerBuilder builder;
  if (exposure.tokens == nullptr) {
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  } else {
    builder.SetOption(std::make_unique<WithoutReflection>());
  }
  *port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), exposure.credentials, port);
  builder.RegisterService(service);
  // gRPC's default SO_REUSEPORT would let a second target bind a port that
  // one already serves, and the kernel would split the trainers between them.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(64 << 20);
  builder.SetMaxSendMessageSize(-1);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", absl::GetFlag(FLAGS_listen),
                     exposure.security.tls() ? " (address in use or malformed, or --tls_key is "
                                               "not the private key of --tls_cert?)"
                                             : " (address in use or malformed?)"));
  }
  return server;
}

// The start-up line: what is served where, how, and how long loading took.
void LogServing(const LoadedTarget& loaded, const TargetService& service, const Exposure& exposure,
                int port, const MetricsHttpServer* metrics_http) {
  const Model& m = *loaded.model;
  const TransportEnv transports = service.transport_env();
  LogF(
      "draftfeed-target %s: serving %s (%s, %lld layers, hidden %lld, fingerprint %s) "
      "on port %d (%s%s), device %s, token budget %lld (batches up to %lld), %s, loaded in %.2fs%s",
      std::string(kDraftfeedVersion).c_str(), m.id.c_str(),
      std::string(ArchName(m.config.arch)).c_str(), static_cast<long long>(m.config.num_layers),
      static_cast<long long>(m.config.hidden_size), m.fingerprint.c_str(), port,
      exposure.security.Describe().c_str(),
      exposure.tokens == nullptr
          ? ""
          : absl::StrCat(", ", exposure.tokens->size(), " bearer tokens").c_str(),
      absl::StrJoin(loaded.engine_ptrs, ",",
                    [](std::string* out, Engine* e) { out->append(e->device_name()); })
          .c_str(),
      static_cast<long long>(service.options().max_batch_tokens),
      static_cast<long long>(service.max_sequence_tokens()),
      SummarizeTransports(transports).c_str(), loaded.load_s,
      metrics_http == nullptr
          ? ""
          : absl::StrCat(", metrics on http port ", metrics_http->port(), " /metrics").c_str());
  LogF("draftfeed-target: %s", DescribeNcclTransport(transports).c_str());
}

// Waits for SIGTERM/SIGINT, then lets accepted batches finish within
// --drain_timeout_s (a second signal exits at once: target_signals.h).
void ServeUntilStopped(TargetSignals* signals, TargetService* service, grpc::Server* server,
                       std::unique_ptr<ThroughputLogger> throughput) {
  const int sig = signals->WaitForStop();
  LogF("draftfeed-target: %s received, finishing accepted batches",
       sig == SIGTERM ? "SIGTERM" : "SIGINT");
  throughput.reset();
  service->BeginDrain();
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::seconds(absl::GetFlag(FLAGS_drain_timeout_s));
  server->Shutdown(deadline);
  service->StopScheduler();
  // The capture buffers' allocations: a steady stream allocates only its
  // first few, so a count that grows with the batches means the idle cap
  // frees what the next batch allocates again (pinned memory: both stall).
  const HostBufferPool& pool = service->scheduler().pool();
  LogF(
      "draftfeed-target: stopped after %lld batches, %lld tokens (%lld batches skipped: "
      "their stream was gone before they ran); %lld capture buffer allocations, peak %lld MiB",
      static_cast<long long>(service->scheduler().completed_batches()),
      static_cast<long long>(service->scheduler().completed_tokens()),
      static_cast<long long>(service->scheduler().skipped_batches()),
      static_cast<long long>(pool.allocations()),
      static_cast<long long>(pool.peak_total_bytes() >> 20));
  signals->Drained();  // a late signal no longer asks the service what it abandons
}

int Run(TargetSignals* signals) {
  auto gpus = GpusFromFlags();
  if (!gpus.ok()) return Fail(std::string(gpus.status().message()));
  if (absl::Status s = CheckTargetFlags(); !s.ok()) return Fail(std::string(s.message()));
  const int tp = absl::GetFlag(FLAGS_tp);
  const MoeParallel moe_parallel = *ParseMoeParallel(absl::GetFlag(FLAGS_moe_parallel));
  if (absl::GetFlag(FLAGS_print_plan)) return PrintPlan(tp, moe_parallel);
  if (!gpus->empty() && gpus->size() % static_cast<size_t>(tp) != 0) {
    return Fail(absl::StrCat("--tp ", tp, " groups every ", tp,
                             " GPUs of --devices into one "
                             "model instance; ",
                             gpus->size(), " GPU(s) given (", absl::StrJoin(*gpus, ","),
                             ") is not a multiple of ", tp));
  }
  auto exposure = CheckExposure(signals);
  if (!exposure.ok()) return Fail(std::string(exposure.status().message()));
  auto loaded = LoadTarget(*gpus, tp, moe_parallel);
  if (!loaded.ok()) return Fail(std::string(loaded.status().message()));

  TargetService service(loaded->engine_ptrs, ServiceOptionsFromFlags(*gpus, exposure->tokens));
  int port = 0;
  auto server = StartGrpcServer(&service, *exposure, &port);
  if (!server.ok()) return Fail(std::string(server.status().message()));
  service.ServeHealth(server->get());
  // From here SIGTERM drains (before: it exits, nothing served).
  signals->Serving([&service] {
    return absl::StrCat(service.open_streams(), " open streams and ", service.scheduler().queued(),
                        " queued batches");
  });
  AddServiceGauges(service.stream_context(), absl::GetFlag(FLAGS_metrics_per_stream));
  AddGpuMemoryGauges(service.metrics().registry(), *gpus);
  std::unique_ptr<MetricsHttpServer> metrics_http;
  if (const std::string ml = absl::GetFlag(FLAGS_metrics_listen); !ml.empty()) {
    auto started =
        MetricsHttpServer::Start(ml, [&service] { return service.metrics().registry().Render(); },
                                 {.tokens = exposure->metrics_tokens});
    if (!started.ok()) {
      (*server)->Shutdown();
      service.StopScheduler();
      return Fail(std::string(started.status().message()));
    }
    metrics_http = *std::move(started);
  }
  std::unique_ptr<ThroughputLogger> throughput;
  if (const double every = absl::GetFlag(FLAGS_log_every_s); every > 0) {
    throughput = std::make_unique<ThroughputLogger>(service.stream_context(), every);
  }
  LogServing(*loaded, service, *exposure, port, metrics_http.get());
  if (const std::string pf = absl::GetFlag(FLAGS_port_file); !pf.empty()) {
    if (absl::Status s = WritePortFile(pf, port); !s.ok()) {
      (*server)->Shutdown();
      service.StopScheduler();
      return Fail(std::string(s.message()));
    }
  }
  ServeUntilStopped(signals, &service, server->get(), std::move(throughput));
  return 0;
}

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  // Before any thread starts, so that every thread inherits the block: one
  // thread takes the signals in every phase (server/service/target_signals.h).
  draftfeed::BlockTargetSignals();
  draftfeed::TargetSignals* signals = draftfeed::TargetSignals::Start();
  absl::SetProgramUsageMessage(
      "Serves the hidden states of a frozen Qwen3.5/3.6 or Qwen3 model to drafter trainers.\n"
      "  draftfeed-target --model tiny-random --listen 127.0.0.1:50051 --device cpu\n"
      "  draftfeed-target --model /ckpt/Qwen3.6-27B --listen 0.0.0.0:50051");
  absl::FlagsUsageConfig usage;
  // The flags' file is "draftfeed-target", not the build machine's path.
  usage.normalize_filename = draftfeed::NormalizeFlagFile;
  usage.contains_help_flags = [](absl::string_view file) {
    return file == draftfeed::kTargetFlagsFile;
  };
  usage.version_string = [] { return std::string(draftfeed::kDraftfeedVersion) + "\n"; };
  absl::SetFlagsUsageConfig(usage);
  if (std::optional<int> rc = draftfeed::HandleTargetHelpOrVersion(argc, argv)) return *rc;
  if (absl::Status s = draftfeed::CheckTargetFlagNames(argc, argv); !s.ok()) {
    return draftfeed::Fail(std::string(s.message()));
  }
  absl::ParseCommandLine(argc, argv);
  return draftfeed::Run(signals);
}
