// draftfeed-target's flag values, checked before anything loads (the flags
// are defined in main.cc).
#include "server/service/target_flag_checks.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/nccl_hosts.h"
#include "common/status_macros.h"
#include "server/model/sharding_plan.h"
#include "server/service/metrics_http.h"
#if DRAFTFEED_HAVE_CUDA
#include "server/model/cuda_engine.h"
#endif

ABSL_DECLARE_FLAG(int64_t, chunk_bytes);
ABSL_DECLARE_FLAG(int32_t, default_credits);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(std::string, devices);
ABSL_DECLARE_FLAG(int32_t, drain_timeout_s);
ABSL_DECLARE_FLAG(std::string, fp8_experts);
ABSL_DECLARE_FLAG(std::string, fp8_gemm);
ABSL_DECLARE_FLAG(double, host_memory_cap_gib);
ABSL_DECLARE_FLAG(int32_t, load_threads);
ABSL_DECLARE_FLAG(double, log_every_s);
ABSL_DECLARE_FLAG(int64_t, max_batch_tokens);
ABSL_DECLARE_FLAG(int32_t, max_capture_layers);
ABSL_DECLARE_FLAG(int32_t, max_credits);
ABSL_DECLARE_FLAG(int64_t, max_queued_batches);
ABSL_DECLARE_FLAG(double, max_rejects_per_s);
ABSL_DECLARE_FLAG(int64_t, max_sequence_tokens);
ABSL_DECLARE_FLAG(int64_t, max_stream_pending_mib);
ABSL_DECLARE_FLAG(int32_t, max_streams);
ABSL_DECLARE_FLAG(int32_t, max_streams_per_client);
ABSL_DECLARE_FLAG(std::string, metrics_listen);
ABSL_DECLARE_FLAG(std::string, moe_parallel);
ABSL_DECLARE_FLAG(double, nccl_setup_timeout_s);
ABSL_DECLARE_FLAG(std::string, nccl_socket_ifname);
ABSL_DECLARE_FLAG(double, nccl_timeout_s);
ABSL_DECLARE_FLAG(double, open_timeout_s);
ABSL_DECLARE_FLAG(std::string, quantize);
ABSL_DECLARE_FLAG(double, stream_idle_timeout_s);
ABSL_DECLARE_FLAG(int32_t, threads);
ABSL_DECLARE_FLAG(double, throttle_tokens_per_s);
ABSL_DECLARE_FLAG(int32_t, tp);

namespace draftfeed {

// gRPC messages are under 2 GiB; a chunk is one message.
constexpr int64_t kMaxChunkBytes = int64_t{1} << 30;
// Larger caps would overflow a byte count.
constexpr int64_t kMaxHostMemoryCapGib = int64_t{1} << 20;
// The most seconds of any time flag: 7 days.
constexpr double kMaxTimeoutS = 7 * 86400;

// Comparisons are written so that NaN fails them.
absl::Status CheckTargetFlags() {
  auto refuse = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (!(absl::GetFlag(FLAGS_max_batch_tokens) >= 1)) {
    return refuse("--max_batch_tokens=", absl::GetFlag(FLAGS_max_batch_tokens), " must be >= 1");
  }
  // A sequence's positions and token offsets are int32 on the wire and in the
  // kernels.
  constexpr int64_t kMaxSequenceTokens = int64_t{1} << 30;
  if (const int64_t s = absl::GetFlag(FLAGS_max_sequence_tokens);
      !(s >= 1 && s <= kMaxSequenceTokens)) {
    return refuse("--max_sequence_tokens=", s, " must be in [1, ", kMaxSequenceTokens, "]");
  }
  if (const int64_t c = absl::GetFlag(FLAGS_chunk_bytes); !(c >= 1 && c <= kMaxChunkBytes)) {
    return refuse("--chunk_bytes=", c, " must be in [1, ", kMaxChunkBytes,
                  "] (a chunk is one gRPC message)");
  }
  if (const std::string e = absl::GetFlag(FLAGS_fp8_experts); e != "fp8" && e != "bf16") {
    return refuse("--fp8_experts=", e, " is not supported; accepted: fp8, bf16");
  }
  if (const std::string g = absl::GetFlag(FLAGS_fp8_gemm);
      g != "auto" && g != "draftfeed" && g != "cublaslt") {
    return refuse("--fp8_gemm=", g, " is not supported; accepted: auto, draftfeed, cublaslt");
  }
  if (const std::string q = absl::GetFlag(FLAGS_quantize); q != "none" && q != "fp8") {
    return refuse("--quantize=", q, " is not supported; accepted: none, fp8");
  }
  if (!(absl::GetFlag(FLAGS_max_capture_layers) >= 1)) {
    return refuse("--max_capture_layers=", absl::GetFlag(FLAGS_max_capture_layers),
                  " must be >= 1");
  }
  const int32_t default_credits = absl::GetFlag(FLAGS_default_credits);
  const int32_t max_credits = absl::GetFlag(FLAGS_max_credits);
  if (!(max_credits >= 1)) return refuse("--max_credits=", max_credits, " must be >= 1");
  if (!(default_credits >= 1 && default_credits <= max_credits)) {
    return refuse("--default_credits=", default_credits,
                  " must be in [1, --max_credits=", max_credits, "]");
  }
  if (const int64_t q = absl::GetFlag(FLAGS_max_queued_batches); !(q >= 1)) {
    return refuse("--max_queued_batches=", q,
                  " must be >= 1 (the scheduler queue across all streams; 0 would fail every "
                  "batch)");
  }
  if (const int64_t m = absl::GetFlag(FLAGS_max_stream_pending_mib);
      !(m >= 0 && m <= (kMaxHostMemoryCapGib << 10))) {
    return refuse("--max_stream_pending_mib=", m, " must be in [0, ", kMaxHostMemoryCapGib << 10,
                  "] (0 = no cap)");
  }
  if (const int32_t m = absl::GetFlag(FLAGS_max_streams); !(m >= 1)) {
    return refuse("--max_streams=", m, " must be >= 1");
  }
  if (const double r = absl::GetFlag(FLAGS_max_rejects_per_s); !(r >= 0 && std::isfinite(r))) {
    return refuse("--max_rejects_per_s=", r, " must be a finite number >= 0 (0 = no limit)");
  }
  if (const double t = absl::GetFlag(FLAGS_stream_idle_timeout_s); !(t >= 0 && std::isfinite(t))) {
    return refuse("--stream_idle_timeout_s=", t, " must be a finite number >= 0 (0 = never)");
  }
  if (const int32_t p = absl::GetFlag(FLAGS_max_streams_per_client);
      !(p >= 0 && p <= absl::GetFlag(FLAGS_max_streams))) {
    return refuse("--max_streams_per_client=", p,
                  " must be in [0, --max_streams=", absl::GetFlag(FLAGS_max_streams),
                  "] (0 = half of --max_streams)");
  }
  if (!(absl::GetFlag(FLAGS_threads) >= 0)) {
    return refuse("--threads=", absl::GetFlag(FLAGS_threads), " must be >= 0 (0 = all cores)");
  }
  if (absl::GetFlag(FLAGS_load_threads) < 0) {
    return refuse("--load_threads=", absl::GetFlag(FLAGS_load_threads),
                  " must be >= 0 (0 = min(8, cores))");
  }
  if (!(absl::GetFlag(FLAGS_tp) >= 1)) {
    return refuse("--tp=", absl::GetFlag(FLAGS_tp), " must be >= 1 (1 = no tensor parallelism)");
  }
  DF_RETURN_IF_ERROR(ParseMoeParallel(absl::GetFlag(FLAGS_moe_parallel)).status());
  if (!(absl::GetFlag(FLAGS_drain_timeout_s) >= 0)) {
    return refuse("--drain_timeout_s=", absl::GetFlag(FLAGS_drain_timeout_s), " must be >= 0");
  }
  if (const double t = absl::GetFlag(FLAGS_throttle_tokens_per_s); !(t >= 0)) {
    return refuse("--throttle_tokens_per_s=", t, " must be >= 0 (0 = off)");
  }
  // A slower throttle holds one batch for minutes, and the drain with it.
  if (const double t = absl::GetFlag(FLAGS_throttle_tokens_per_s);
      !(t == 0 || (t >= 1 && std::isfinite(t)))) {
    return refuse("--throttle_tokens_per_s=", t,
                  " must be 0 (off) or a finite number >= 1 token/s");
  }
  if (const double g = absl::GetFlag(FLAGS_host_memory_cap_gib);
      !(g >= 0 && g <= static_cast<double>(kMaxHostMemoryCapGib))) {
    return refuse("--host_memory_cap_gib=", g, " must be in [0, ", kMaxHostMemoryCapGib,
                  "] (0 = no cap)");
  }
  if (const std::string ml = absl::GetFlag(FLAGS_metrics_listen); !ml.empty()) {
    DF_RETURN_IF_ERROR(MetricsHttpServer::ParseListen(ml).status());
  }
  if (const double t = absl::GetFlag(FLAGS_log_every_s); !(t >= 0 && std::isfinite(t))) {
    return refuse("--log_every_s=", t, " must be a finite number >= 0 (0 = off)");
  }
  if (const double t = absl::GetFlag(FLAGS_nccl_timeout_s); !(t > 0 && std::isfinite(t))) {
    return refuse("--nccl_timeout_s=", t, " must be a finite number > 0");
  }
  if (const double t = absl::GetFlag(FLAGS_nccl_setup_timeout_s); !(t > 0 && std::isfinite(t))) {
    return refuse("--nccl_setup_timeout_s=", t, " must be a finite number > 0");
  }
  // Time flags become clock durations (nanosecond int64s) and sleeps: a value
  // past these limits overflowed them (1e10 s never finished start-up, 1e300
  // served nothing and ignored SIGTERM) and means nothing a target needs.
  for (const auto& [name, value, most] :
       {std::tuple{"--stream_idle_timeout_s", absl::GetFlag(FLAGS_stream_idle_timeout_s),
                   kMaxTimeoutS},
        std::tuple{"--open_timeout_s", absl::GetFlag(FLAGS_open_timeout_s), kMaxTimeoutS},
        std::tuple{"--nccl_timeout_s", absl::GetFlag(FLAGS_nccl_timeout_s), kMaxTimeoutS},
        std::tuple{"--nccl_setup_timeout_s", absl::GetFlag(FLAGS_nccl_setup_timeout_s),
                   kMaxTimeoutS},
        std::tuple{"--log_every_s", absl::GetFlag(FLAGS_log_every_s), kMaxTimeoutS},
        std::tuple{"--drain_timeout_s", static_cast<double>(absl::GetFlag(FLAGS_drain_timeout_s)),
                   kMaxTimeoutS}}) {
    if (!(value >= 0 && value <= most)) {
      return refuse(name, "=", value, " must be in [0, ", most, "] seconds (", most / 86400,
                    " days at most)");
    }
  }
  // Before anything calls NCCL (a tensor-parallel engine does at load).
  DF_RETURN_IF_ERROR(
      UseNcclSocketIfname(absl::GetFlag(FLAGS_nccl_socket_ifname), "--nccl_socket_ifname"));
  return absl::OkStatus();
}

// --device / --devices: the GPUs to serve on (empty: the CPU engine).
absl::StatusOr<std::vector<int>> GpusFromFlags() {
  // Which backend: explicit --devices / cuda:N, else a GPU when there is one.
  const std::string device = absl::GetFlag(FLAGS_device);
  std::vector<int> gpus;
  if (const std::string list = absl::GetFlag(FLAGS_devices); !list.empty()) {
    for (absl::string_view part : absl::StrSplit(list, ',')) {
      int g = -1;
      if (!absl::SimpleAtoi(part, &g) || g < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--devices=", list, ": '", std::string(part), "' is not a GPU index"));
      }
      gpus.push_back(g);
    }
  } else if (device.rfind("cuda", 0) == 0) {
    int g = 0;
    if (device != "cuda" && (device.size() < 6 || device[4] != ':' ||
                             !absl::SimpleAtoi(device.substr(5), &g) || g < 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device=", device, " is not cpu, cuda:N or auto"));
    }
    gpus.push_back(g);
  } else if (device != "cpu" && device != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", device, " is not cpu, cuda:N or auto"));
  }
#if DRAFTFEED_HAVE_CUDA
  if (device == "auto" && gpus.empty() && CudaDeviceCount() > 0) gpus.push_back(0);
#else
  if (!gpus.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", device,
                     ": this build has no CUDA engine (built without nvcc); use --device=cpu"));
  }
#endif
  return gpus;
}

}  // namespace draftfeed
