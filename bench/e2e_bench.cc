// draftfeed-e2e-bench: how much of the engine's rate reaches a trainer in
// another process. In one run: (a) the engine alone, in this process (the
// forward on the device, and the forward with its capture copied to pinned
// host memory); then (b) draftfeed-target started as a subprocess on the same
// device, model and budget, consumed here through the C++ client
// (draftfeed::Feed), as a trainer would. Rates are medians over windows of
// --batches back-to-back batches, after --warmup batches.
//
//   draftfeed-e2e-bench --model random:qwen3.6-27b --device cuda:0
//   draftfeed-e2e-bench --model tiny-random --device cpu --tokens 2048 --min_len 64 --max_len 512
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/bench_batches.h"
#include "common/target_outputs.h"
#include "draftfeed/client.h"
#include "server/model/cpu_engine.h"
#if DRAFTFEED_HAVE_CUDA
#include "common/host_buffer_pool.h"
#include "server/model/cuda_engine.h"
#endif

ABSL_FLAG(std::string, model, "random:qwen3.6-27b", "Model spec or checkpoint directory.");
ABSL_FLAG(std::string, device, "cuda:0", "cuda:N or cpu (both the engine and the target).");
ABSL_FLAG(int64_t, tokens, 16384, "Packed tokens per batch (also the target's token budget).");
ABSL_FLAG(int32_t, min_len, 512, "Shortest sequence in a batch.");
ABSL_FLAG(int32_t, max_len, 8192, "Longest sequence in a batch.");
ABSL_FLAG(int32_t, capture, 5, "Captured layers: evenly spaced, the last one the final norm.");
ABSL_FLAG(int32_t, batches, 6, "Batches per timed window.");
ABSL_FLAG(int32_t, repeats, 3, "Timed windows (the median is reported).");
ABSL_FLAG(int32_t, warmup, 2, "Untimed batches first (plans, pools, clocks).");
ABSL_FLAG(int32_t, threads, 0, "CPU engine threads, here and in the target (0 = all cores).");
ABSL_FLAG(int32_t, credits, 4, "Credits the trainer asks of the target.");
ABSL_FLAG(int32_t, prefetch, 4, "Trainer prefetch window in batches.");
ABSL_FLAG(bool, verify, true, "Trainer verifies each batch's checksum (as a trainer should).");
ABSL_FLAG(std::string, target_bin, "",
          "draftfeed-target to start (default: the one beside this binary).");
ABSL_FLAG(std::vector<std::string>, target_args, {},
          "More flags for the target, comma-separated (e.g. --target_args=--tp=2,--moe_parallel=ep "
          "with --target_devices).");
ABSL_FLAG(std::string, target_devices, "",
          "The target's --devices instead of --device (e.g. 0,1 with --target_args=--tp=2: a "
          "tensor-parallel target beside the one-GPU engine).");
ABSL_FLAG(double, startup_timeout_s, 600, "Seconds to wait for the target to serve.");
ABSL_FLAG(double, min_ratio, 0, "Exit 1 when end-to-end / engine-only is below this.");
ABSL_FLAG(uint64_t, seed, 0, "Sequence-length and token seed.");
ABSL_FLAG(std::string, encoding, "bf16",
          "Capture encoding on the wire: bf16, or fp8_e4m3 (the trainer gets it dequantized to "
          "bf16 on the way in unless --fp8_raw).");
ABSL_FLAG(bool, fp8_raw, false, "With --encoding fp8_e4m3: the trainer keeps the fp8 bytes.");
ABSL_FLAG(int32_t, draft_vocab, 0,
          "Target outputs on both paths: draft-vocabulary probabilities over this many ids (a "
          "seeded sample of the vocabulary); 0: none.");
ABSL_FLAG(int32_t, top_k, 0, "Target outputs: top-k ids and log-probs; 0: none.");
ABSL_FLAG(bool, argmax, false, "Target outputs: the full-vocabulary argmax.");
ABSL_FLAG(std::string, probs_encoding, "bf16", "Draft probabilities: bf16 or fp8_e4m3.");

namespace draftfeed {
namespace {

using Clock = std::chrono::steady_clock;

struct Batch {
  std::vector<int32_t> ids, lens;
};

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Tokens/s of each window of `per_window` consecutive batches, given the
// time each batch finished; the first window starts when batch `warmup - 1`
// finished, so start-up latency is not counted.
std::vector<double> WindowRates(const std::vector<Clock::time_point>& finished, int warmup,
                                int per_window, int64_t tokens) {
  std::vector<double> rates;
  for (size_t end = warmup - 1 + per_window; end < finished.size(); end += per_window) {
    const double s = Seconds(finished[end - per_window], finished[end]);
    rates.push_back(static_cast<double>(per_window * tokens) / s);
  }
  return rates;
}

std::string Rates(const std::vector<double>& r) {
  return absl::StrJoin(
      r, ", ", [](std::string* out, double v) { absl::StrAppend(out, static_cast<int64_t>(v)); });
}

// The target outputs the flags ask for (empty: hidden states only), made once.
const TargetOutputs& Outputs(const ModelConfig& c) {
  static const TargetOutputs outputs = [&] {
    TargetOutputs o{.argmax = absl::GetFlag(FLAGS_argmax), .top_k = absl::GetFlag(FLAGS_top_k)};
    std::vector<int32_t> all(static_cast<size_t>(c.vocab_size));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), std::mt19937_64(absl::GetFlag(FLAGS_seed) + 2));
    all.resize(static_cast<size_t>(std::clamp<int64_t>(absl::GetFlag(FLAGS_draft_vocab), 0,
                                                       c.vocab_size)));
    o.draft_vocab = std::move(all);
    o.probs_encoding = absl::GetFlag(FLAGS_probs_encoding) == "fp8_e4m3"
                           ? CaptureEncoding::kFp8E4m3
                           : CaptureEncoding::kBf16;
    return o;
  }();
  return outputs;
}

// A batch's forward input with the flags' target outputs.
ForwardInput Input(const ModelConfig& c, const std::vector<int32_t>& ids,
                   const std::vector<int32_t>& lens, const std::vector<int32_t>& layers,
                   CaptureEncoding enc) {
  ForwardInput in{ids, lens, layers, enc};
  in.outputs = &Outputs(c);
  return in;
}

CaptureEncoding Encoding() {
  return absl::GetFlag(FLAGS_encoding) == "fp8_e4m3" ? CaptureEncoding::kFp8E4m3
                                                     : CaptureEncoding::kBf16;
}

// (a) The engine alone. Returns per-window rates of the forward on the
// device; `copied` gets those of the forward with its copy to pinned memory.
absl::StatusOr<std::vector<double>> EngineOnly(const Model& model, const std::string& device,
                                               const std::vector<Batch>& batches,
                                               const std::vector<int32_t>& layers,
                                               std::vector<double>* copied) {
  const int warmup = absl::GetFlag(FLAGS_warmup), per = absl::GetFlag(FLAGS_batches);
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const CaptureEncoding enc = Encoding();
  const size_t bytes =
      static_cast<size_t>(tokens) *
      static_cast<size_t>(CaptureBytesPerToken(enc, static_cast<int64_t>(layers.size()),
                                               model.config.hidden_size) +
                          LayoutOf(Outputs(model.config)).bytes);
  std::vector<Clock::time_point> finished;
  if (device == "cpu") {
    auto engine = CpuEngine::Create(&model, absl::GetFlag(FLAGS_threads));
    if (!engine.ok()) return engine.status();
    std::vector<std::byte> out(bytes);
    for (const Batch& b : batches) {
      const ForwardInput in = Input(model.config, b.ids, b.lens, layers, enc);
      if (absl::Status s =
              (*engine)->Forward(in, std::span(out).first(CaptureBytes(model.config, in)));
          !s.ok()) {
        return s;
      }
      finished.push_back(Clock::now());
    }
    *copied = WindowRates(finished, warmup, per, tokens);  // the CPU engine writes host memory
    return *copied;
  }
#if DRAFTFEED_HAVE_CUDA
  CudaEngineOptions opt;
  opt.device = std::stoi(device.substr(5));
  opt.max_tokens = tokens;
  opt.max_seqs = std::min<int64_t>(tokens, 4096);  // as draftfeed-target sizes it
  opt.max_layers = static_cast<int64_t>(layers.size());
  auto engine = CudaEngine::Create(&model, opt);
  if (!engine.ok()) return engine.status();
  for (const Batch& b : batches) {
    if (absl::Status s = (*engine)->ForwardOnDevice(Input(model.config, b.ids, b.lens, layers, enc));
        !s.ok()) {
      return s;
    }
    finished.push_back(Clock::now());
  }
  std::vector<double> on_device = WindowRates(finished, warmup, per, tokens);

  // The target's path inside the engine: ForwardAsync into pinned buffers,
  // three in rotation (one filled, one copied into, one being "delivered").
  HostBufferPool pinned(0, PinnedHostAllocator());
  std::vector<std::shared_ptr<std::byte>> bufs;
  for (int i = 0; i < 3; ++i) {
    bufs.push_back(pinned.Acquire(bytes));
    if (bufs.back() == nullptr) return absl::ResourceExhaustedError("cannot pin host memory");
  }
  std::mutex mu;
  std::condition_variable cv;
  size_t done = 0;
  absl::Status copy_status;
  finished.assign(batches.size(), Clock::time_point{});
  for (size_t i = 0; i < batches.size(); ++i) {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return done + 2 >= i; });  // buffer i % 3 is free again
    }
    const ForwardInput in = Input(model.config, batches[i].ids, batches[i].lens, layers, enc);
    absl::Status s =
        (*engine)->ForwardAsync(in, std::span(bufs[i % 3].get(), CaptureBytes(model.config, in)),
                                [&, i](Engine::Copied copied) {
                                  std::lock_guard<std::mutex> lock(mu);
                                  finished[i] = Clock::now();
                                  if (!copied.status.ok()) copy_status = copied.status;
                                  ++done;
                                  cv.notify_all();
                                });
    if (!s.ok()) return s;
  }
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done == batches.size(); });
  if (!copy_status.ok()) return copy_status;
  *copied = WindowRates(finished, warmup, per, tokens);
  return on_device;
#else
  return absl::UnimplementedError("built without CUDA: use --device cpu");
#endif
}

// The target as a subprocess; SIGTERM and reaped on destruction.
class TargetProcess {
 public:
  ~TargetProcess() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    int status = 0;
    waitpid(pid_, &status, 0);
  }
  absl::Status Start(const std::vector<std::string>& args, const std::string& port_file) {
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, argv[0], nullptr, nullptr, argv.data(), environ) != 0) {
      pid_ = 0;
      return absl::NotFoundError(absl::StrCat("cannot start ", args[0]));
    }
    const auto deadline =
        Clock::now() + std::chrono::duration<double>(absl::GetFlag(FLAGS_startup_timeout_s));
    while (Clock::now() < deadline) {
      int port = 0;
      std::ifstream in(port_file);
      if (in >> port && port > 0) {
        address_ = absl::StrCat("127.0.0.1:", port);
        return absl::OkStatus();
      }
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        return absl::InternalError("the target exited before serving (see its stderr above)");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return absl::DeadlineExceededError("the target did not start serving in time");
  }
  const std::string& address() const { return address_; }

 private:
  pid_t pid_ = 0;
  std::string address_;
};

struct EndToEnd {
  std::vector<double> rates;
  double forward_ms = 0, queue_ms = 0, send_ms = 0;
};

// (b) A trainer in this process, the target in another.
absl::StatusOr<EndToEnd> ThroughTarget(const ModelConfig& c, const std::string& device,
                                       const std::vector<Batch>& batches,
                                       const std::vector<int32_t>& layers, int64_t batch_bytes) {
  std::string bin = absl::GetFlag(FLAGS_target_bin);
  if (bin.empty()) {
    bin =
        (std::filesystem::canonical("/proc/self/exe").parent_path() / "draftfeed-target").string();
  }
  const std::string dir =
      std::filesystem::temp_directory_path() / absl::StrCat("draftfeed-e2e-", getpid());
  std::filesystem::create_directories(dir);
  const std::string port_file = dir + "/port";
  TargetProcess target;
  std::vector<std::string> args = {bin,
                                   "--model=" + absl::GetFlag(FLAGS_model),
                                   absl::GetFlag(FLAGS_target_devices).empty()
                                       ? "--device=" + device
                                       : "--devices=" + absl::GetFlag(FLAGS_target_devices),
                                   "--listen=127.0.0.1:0",
                                   "--port_file=" + port_file,
                                   absl::StrCat("--max_batch_tokens=", absl::GetFlag(FLAGS_tokens)),
                                   absl::StrCat("--max_capture_layers=", layers.size()),
                                   absl::StrCat("--threads=", absl::GetFlag(FLAGS_threads))};
  for (const std::string& a : absl::GetFlag(FLAGS_target_args)) args.push_back(a);
  absl::Status started = target.Start(args, port_file);
  std::filesystem::remove_all(dir);
  if (!started.ok()) return started;

  FeedOptions opt;
  opt.targets = {target.address()};
  opt.layers = layers;
  opt.prefetch = absl::GetFlag(FLAGS_prefetch);
  opt.prefetch_bytes = (opt.prefetch + 1) * batch_bytes;  // the batch count is the bound
  opt.credits_per_target = absl::GetFlag(FLAGS_credits);
  opt.verify_checksum = absl::GetFlag(FLAGS_verify);
  opt.client_name = "draftfeed-e2e-bench";
  opt.encoding = static_cast<draftfeed::Encoding>(Encoding());
  opt.fp8_raw = absl::GetFlag(FLAGS_fp8_raw);
  const TargetOutputs& outputs = Outputs(c);
  opt.target_outputs = {.argmax = outputs.argmax,
                        .top_k = outputs.top_k,
                        .draft_vocab = outputs.draft_vocab,
                        .probs_encoding = static_cast<draftfeed::Encoding>(outputs.probs_encoding)};
  auto feed = Feed::Open(opt);
  if (!feed.ok()) return feed.status();
  // Next() refuses when nothing is outstanding, so batch i is awaited only
  // once it has been submitted.
  std::mutex mu;
  std::condition_variable cv;
  size_t submitted = 0;
  absl::Status submit_status;
  std::thread submitter([&] {
    for (const Batch& b : batches) {
      absl::StatusOr<uint64_t> id = (*feed)->Submit(b.ids, b.lens);
      std::lock_guard<std::mutex> lock(mu);
      if (!id.ok()) {
        submit_status = id.status();
        submitted = batches.size();  // nothing more will come
        cv.notify_all();
        return;
      }
      ++submitted;
      cv.notify_all();
    }
  });
  std::vector<Clock::time_point> finished;
  std::vector<double> forward, queue, send;
  absl::Status status;
  for (size_t i = 0; i < batches.size(); ++i) {
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return submitted > i; });
      if (!submit_status.ok()) break;
    }
    absl::StatusOr<HiddenBatch> b = (*feed)->Next();
    if (!b.ok()) {
      // The submitter may be blocked in Submit: closing the feed frees it.
      status = b.status();
      (void)(*feed)->Close();
      break;
    }
    finished.push_back(Clock::now());
    forward.push_back(b->forward_ms);
    queue.push_back(b->queue_ms);
    send.push_back(b->send_ms);
  }
  submitter.join();
  (void)(*feed)->Close();
  if (!status.ok()) return status;
  if (!submit_status.ok()) return submit_status;
  EndToEnd r;
  r.rates = WindowRates(finished, absl::GetFlag(FLAGS_warmup), absl::GetFlag(FLAGS_batches),
                        absl::GetFlag(FLAGS_tokens));
  r.forward_ms = bench::Median(forward);
  r.queue_ms = bench::Median(queue);
  r.send_ms = bench::Median(send);
  return r;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "draftfeed-e2e-bench: error: %s\n", std::string(s.message()).c_str());
  return 1;
}

int Run() {
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device != "cpu" && device.rfind("cuda:", 0) != 0) {
    return Fail(absl::InvalidArgumentError("--device is cpu or cuda:N"));
  }
  const int warmup = absl::GetFlag(FLAGS_warmup), per = absl::GetFlag(FLAGS_batches);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  if (warmup < 1 || per < 1 || repeats < 1) {
    return Fail(absl::InvalidArgumentError("--warmup, --batches and --repeats must be >= 1"));
  }
  auto model = OpenModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return Fail(model.status());
  const ModelConfig& c = (*model)->config;
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const std::vector<int32_t> layers = bench::SpacedLayers(c, absl::GetFlag(FLAGS_capture));
  std::vector<Batch> batches;
  size_t seqs = 0;
  for (int i = 0; i < warmup + repeats * per; ++i) {
    const uint64_t seed = absl::GetFlag(FLAGS_seed) + 1000 * i;
    batches.push_back({bench::RandomTokens(tokens, c.vocab_size, seed + 1),
                       bench::MixedLengths(tokens, absl::GetFlag(FLAGS_min_len),
                                           absl::GetFlag(FLAGS_max_len), seed)});
    seqs += batches.back().lens.size();
  }
  if (absl::GetFlag(FLAGS_encoding) != "bf16" && absl::GetFlag(FLAGS_encoding) != "fp8_e4m3") {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("--encoding is bf16 or fp8_e4m3, got '", absl::GetFlag(FLAGS_encoding), "'")));
  }
  const int64_t batch_bytes =
      tokens * (CaptureBytesPerToken(Encoding(), static_cast<int64_t>(layers.size()), c.hidden_size) +
                LayoutOf(Outputs(c)).bytes);
  if (!Outputs(c).empty()) {
    std::printf("target outputs: argmax %s, top_k %d, draft vocab %zu (%s): %lld bytes a token\n",
                Outputs(c).argmax ? "yes" : "no", Outputs(c).top_k, Outputs(c).draft_vocab.size(),
                absl::GetFlag(FLAGS_probs_encoding).c_str(),
                static_cast<long long>(LayoutOf(Outputs(c)).bytes));
  }
  std::printf(
      "e2e: %s on %s; %lld-token batches (%.1f sequences of %d..%d on average), layers "
      "[%s], %.0f MB of %s states per batch; %d warm-up + %d windows of %d batches\n",
      (*model)->id.c_str(), device.c_str(), static_cast<long long>(tokens),
      static_cast<double>(seqs) / batches.size(), absl::GetFlag(FLAGS_min_len),
      absl::GetFlag(FLAGS_max_len), absl::StrJoin(layers, ",").c_str(), batch_bytes / 1e6,
      absl::GetFlag(FLAGS_encoding).c_str(), warmup, repeats, per);
  std::fflush(stdout);

  std::vector<double> copied;
  auto engine = EngineOnly(**model, device, batches, layers, &copied);
  if (!engine.ok()) return Fail(engine.status());
  const double engine_rate = bench::Median(*engine);
  std::printf("engine only (forward, capture on the device): %.0f tokens/s median (%s)\n",
              engine_rate, Rates(*engine).c_str());
  std::printf("engine + async copy into pinned host memory:  %.0f tokens/s median (%s)\n",
              bench::Median(copied), Rates(copied).c_str());
  std::fflush(stdout);

  auto e2e = ThroughTarget(c, device, batches, layers, batch_bytes);
  if (!e2e.ok()) return Fail(e2e.status());
  const double e2e_rate = bench::Median(e2e->rates);
  const double ratio = e2e_rate / engine_rate;
  std::printf(
      "trainer in another process (gRPC, C++ client, checksums %s): %.0f tokens/s median "
      "(%s) = %.3f of engine only\n",
      absl::GetFlag(FLAGS_verify) ? "verified" : "not verified", e2e_rate,
      Rates(e2e->rates).c_str(), ratio);
  std::printf("target per batch (median): forward %.1f ms, queue %.1f ms, send %.1f ms\n",
              e2e->forward_ms, e2e->queue_ms, e2e->send_ms);
  std::printf(
      "RESULT engine_tokens_per_s=%.0f copied_tokens_per_s=%.0f e2e_tokens_per_s=%.0f "
      "ratio=%.4f\n",
      engine_rate, bench::Median(copied), e2e_rate, ratio);
  return ratio < absl::GetFlag(FLAGS_min_ratio) ? 1 : 0;
}

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "draftfeed-e2e-bench [flags]: engine-only tokens/s against tokens/s delivered to a "
      "trainer in another process by draftfeed-target.");
  absl::ParseCommandLine(argc, argv);
  return draftfeed::Run();
}
