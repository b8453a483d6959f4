// draftfeed-bench: engine and GEMM benchmarks on one GPU.
//
//   draftfeed-bench engine --model random:qwen3.6-27b --tokens 16384 --iters 5
//   draftfeed-bench engine --capture 3 --draft_vocab 32000 --argmax   (EAGLE-3's feed)
//   draftfeed-bench gemm --model random:qwen3.6-27b --tokens 16384
//   draftfeed-bench write-random --model random:qwen3-8b --out DIR --shards 4
//   draftfeed-bench load --model DIR --device 0 --repeats 3
//
// `engine` prints tokens/s, achieved TFLOP/s (matmul + attention FLOPs),
// with target outputs asked (--draft_vocab, --top_k, --argmax) the same batch
// hidden-only and with them, interleaved, and their ratio, then
// a per-op-family time table from a profiled run, and GPU memory. `gemm`
// times cuBLASLt alone at the model's projection shapes: the ceiling.
// `write-random` and `load` (load_bench.h): a cold checkpoint load onto the
// GPU against reading the same files raw.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_batches.h"
#include "bench/load_bench.h"
#include "bench/long_sequence_bench.h"
#include "common/status_macros.h"
#include "common/target_outputs.h"
#include "server/model/cuda_engine.h"
#include "server/model/cuda_gemm.h"
#include "server/model/model.h"
#include "server/model/weight_layout.h"
#include "server/service/flags_help.h"
#include "server/service/version.h"

ABSL_FLAG(std::string, model, "random:qwen3.6-27b", "Model spec or checkpoint directory.");
ABSL_FLAG(int64_t, tokens, 16384, "Packed tokens per batch.");
ABSL_FLAG(int32_t, min_len, 512, "Shortest sequence in the batch.");
ABSL_FLAG(int32_t, max_len, 8192, "Longest sequence in the batch.");
ABSL_FLAG(int32_t, capture, 5, "Captured layers: evenly spaced, the last one the final norm.");
ABSL_FLAG(int32_t, iters, 5, "Timed iterations (median reported).");
ABSL_FLAG(int32_t, device, 0, "CUDA device.");
ABSL_FLAG(uint64_t, seed, 0, "Sequence-length and token seed.");
ABSL_FLAG(bool, fp8_expert_gemms, true,
          "FP8 MoE models: FP8 grouped expert GEMMs (else experts dequantized to bf16).");
ABSL_FLAG(std::string, fp8_gemm, "auto",
          "FP8 models' dense projections: auto (as draftfeed-target's --fp8_gemm: draftfeed's "
          "Hopper FP8 GEMM where it runs), draftfeed, or cublaslt (cuBLASLt's block-scaled GEMM).");
ABSL_FLAG(int32_t, draft_vocab, 0,
          "Target outputs: draft-vocabulary probabilities over this many ids (the most "
          "frequent-looking: a seeded sample of the vocabulary); 0: none.");
ABSL_FLAG(int32_t, top_k, 0, "Target outputs: top-k ids and log-probs; 0: none.");
ABSL_FLAG(bool, argmax, false, "Target outputs: the full-vocabulary argmax.");
ABSL_FLAG(std::string, probs_encoding, "bf16", "Draft probabilities: bf16 or fp8_e4m3.");
ABSL_FLAG(int64_t, sequence_tokens, 131072, "long: the one sequence's tokens.");
ABSL_FLAG(int64_t, forward_tokens, 16384, "long: tokens of one forward (--max_batch_tokens).");
ABSL_FLAG(bool, one_pass, false, "long: also run the sequence in one forward and compare.");

namespace draftfeed {
namespace {

using bench::Median;
using bench::MixedLengths;

// FLOPs of one forward: 2·T·(matmul params) + causal attention 2·Σ L²·hd·Hq.
// The matmul params are the layers' 2-D tensors in weight_layout, so the count
// follows each block's real shapes (q_proj's gate rows included).
double ForwardFlops(const ModelConfig& c, const std::vector<int32_t>& lens) {
  double T = 0, attn = 0;
  for (int32_t l : lens) T += l;
  double params = 0;
  for (const WeightSpec& w : DecoderWeightSpecs(c)) {
    if (w.layer >= 0 && w.shape.size() == 2) params += static_cast<double>(w.numel());
  }
  for (LayerKind k : c.layer_types) {
    if (k != LayerKind::kFullAttention) continue;
    for (int32_t l : lens) attn += 2.0 * l * double(l) * c.head_dim * c.num_heads;
  }
  return 2 * T * params + attn;
}

int RunEngineBench() {
  auto model = OpenModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  const ModelConfig& c = (*model)->config;
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const std::vector<int32_t> lens =
      MixedLengths(tokens, absl::GetFlag(FLAGS_min_len), absl::GetFlag(FLAGS_max_len),
                   absl::GetFlag(FLAGS_seed));
  const std::vector<int32_t> ids =
      bench::RandomTokens(tokens, c.vocab_size, absl::GetFlag(FLAGS_seed) + 1);
  const std::vector<int32_t> layers = bench::SpacedLayers(c, absl::GetFlag(FLAGS_capture));
  const int32_t k = static_cast<int32_t>(layers.size());

  size_t free0 = 0, total = 0;
  cudaSetDevice(absl::GetFlag(FLAGS_device));
  cudaMemGetInfo(&free0, &total);
  CudaEngineOptions opt;
  opt.fp8_expert_gemms = absl::GetFlag(FLAGS_fp8_expert_gemms);
  if (const std::string g = absl::GetFlag(FLAGS_fp8_gemm); g == "draftfeed") {
    opt.fp8_gemm = CudaEngineOptions::Fp8Gemm::kDraftfeed;
  } else if (g == "cublaslt") {
    opt.fp8_gemm = CudaEngineOptions::Fp8Gemm::kCublasLt;
  } else if (g != "auto") {
    std::fprintf(stderr, "error: --fp8_gemm=%s: accepted: auto, draftfeed, cublaslt\n", g.c_str());
    return 1;
  }
  opt.device = absl::GetFlag(FLAGS_device);
  opt.max_tokens = tokens;
  opt.max_seqs = static_cast<int64_t>(lens.size());
  opt.max_layers = k;
  const auto t_load = std::chrono::steady_clock::now();
  auto engine = CudaEngine::Create(model->get(), opt);
  if (!engine.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(engine.status().message()).c_str());
    return 1;
  }
  std::printf(
      "model %s: %lld layers, hidden %lld; weights %.2f GiB, workspace %.2f GiB, "
      "set up in %.1fs\n",
      (*model)->id.c_str(), static_cast<long long>(c.num_layers),
      static_cast<long long>(c.hidden_size), (*engine)->weight_bytes() / 1073741824.0,
      (*engine)->workspace_bytes() / 1073741824.0,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count());
  std::printf("batch: %lld tokens in %zu sequences (%d..%d), %d captured layers\n",
              static_cast<long long>(tokens), lens.size(), absl::GetFlag(FLAGS_min_len),
              absl::GetFlag(FLAGS_max_len), k);
  ForwardInput in{ids, lens, layers};
  TargetOutputs outputs{.argmax = absl::GetFlag(FLAGS_argmax), .top_k = absl::GetFlag(FLAGS_top_k)};
  if (const int32_t vd = absl::GetFlag(FLAGS_draft_vocab); vd > 0) {
    std::vector<int32_t> all(static_cast<size_t>(c.vocab_size));
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int32_t>(i);
    std::mt19937_64 rng(absl::GetFlag(FLAGS_seed) + 2);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(static_cast<size_t>(std::min<int64_t>(vd, c.vocab_size)));
    outputs.draft_vocab = std::move(all);
  }
  outputs.probs_encoding = absl::GetFlag(FLAGS_probs_encoding) == "fp8_e4m3"
                               ? CaptureEncoding::kFp8E4m3
                               : CaptureEncoding::kBf16;
  ForwardInput with = in;
  with.outputs = &outputs;
  auto run = [&](const ForwardInput& x) -> absl::StatusOr<double> {
    const auto t0 = std::chrono::steady_clock::now();
    DF_RETURN_IF_ERROR((*engine)->ForwardOnDevice(x));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  // Warm-up (plans, clocks; with outputs, lm_head's upload and buffers).
  for (const ForwardInput* x : {&in, &with}) {
    if (x == &with && outputs.empty()) break;
    if (absl::StatusOr<double> s = run(*x); !s.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(s.status().message()).c_str());
      return 1;
    }
  }
  std::vector<double> secs, secs_with;
  for (int i = 0; i < absl::GetFlag(FLAGS_iters); ++i) {
    // Interleaved, so that clocks and heat weigh on both alike.
    for (const ForwardInput* x : {&in, &with}) {
      if (x == &with && outputs.empty()) break;
      absl::StatusOr<double> s = run(*x);
      if (!s.ok()) {
        std::fprintf(stderr, "error: %s\n", std::string(s.status().message()).c_str());
        return 1;
      }
      (x == &in ? secs : secs_with).push_back(*s);
    }
  }
  if (!outputs.empty()) {
    const double m_with = Median(secs_with), m = Median(secs);
    const int64_t hidden_bytes = CaptureBytesPerToken(CaptureEncoding::kBf16, k, c.hidden_size);
    std::printf(
        "target outputs (argmax %s, top_k %d, draft vocab %zu %s): median %.1f ms per batch = "
        "%.0f tokens/s, %.3fx the hidden-only %.0f tokens/s; bytes per token %lld hidden + "
        "%lld outputs\n",
        outputs.argmax ? "yes" : "no", outputs.top_k, outputs.draft_vocab.size(),
        std::string(EncodingName(outputs.probs_encoding)).c_str(), m_with * 1e3, tokens / m_with,
        m / m_with, tokens / m, static_cast<long long>(hidden_bytes),
        static_cast<long long>(LayoutOf(outputs).bytes));
  }
  size_t free1 = 0;
  cudaMemGetInfo(&free1, &total);
  const double med = Median(secs);
  const double flops = ForwardFlops(c, lens);
  std::printf("engine: median %.1f ms per batch = %.0f tokens/s, %.0f TFLOP/s (of %zu runs)\n",
              med * 1e3, tokens / med, flops / med / 1e12, secs.size());
  std::printf("memory: %.2f GiB used on the GPU by this process (weights %.2f GiB + %.2f GiB)\n",
              (free0 - free1) / 1073741824.0, (*engine)->weight_bytes() / 1073741824.0,
              (free0 - free1 - (*engine)->weight_bytes()) / 1073741824.0);

  // Profiled run: per op family (a sync after every op, so the total exceeds the median).
  (*engine)->set_profile(true);
  if (absl::Status s = (*engine)->ForwardOnDevice(in); !s.ok()) return 1;
  (*engine)->set_profile(false);
  double sum = 0;
  for (const auto& [name, ms] : (*engine)->last_op_times().ms) sum += ms;
  std::printf("per op family (profiled run, %.1f ms in all):\n", sum);
  for (const auto& [name, ms] : (*engine)->last_op_times().ms) {
    std::printf("  %-12s %9.2f ms  %5.1f%%\n", name.c_str(), ms, 100.0 * ms / sum);
  }
  return 0;
}

int GemmProbe() {
  auto model = OpenModel(absl::GetFlag(FLAGS_model));
  if (!model.ok()) return 1;
  const ModelConfig& c = (*model)->config;
  const int64_t M = absl::GetFlag(FLAGS_tokens), D = c.hidden_size, F = c.intermediate_size;
  struct Shape {
    const char* name;
    int64_t n, k;
  };
  std::vector<Shape> shapes = {{"gate_up", 2 * F, D}, {"down", D, F}};
  if (c.features.linear_attention) {
    const int64_t C = 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                      c.linear_num_value_heads * c.linear_value_head_dim;
    const int64_t Z = c.linear_num_value_heads * c.linear_value_head_dim;
    shapes.push_back({"gdn_in", C + 2 * c.linear_num_value_heads, D});
    shapes.push_back({"gdn_z", Z, D});
    shapes.push_back({"gdn_out", D, Z});
  }
  const int64_t q_rows = c.num_heads * c.head_dim * (c.features.gated_attention ? 2 : 1);
  shapes.push_back({"attn_qkv", q_rows + 2 * c.num_kv_heads * c.head_dim, D});
  shapes.push_back({"attn_o", D, c.num_heads * c.head_dim});
  cudaSetDevice(absl::GetFlag(FLAGS_device));
  void* ws = nullptr;
  cudaMalloc(&ws, 64 << 20);
  CublasLtGemm gemm;
  if (!gemm.Init(ws, 64 << 20).ok()) return 1;
  int64_t max_elems = 0;
  for (const Shape& s : shapes) max_elems = std::max({max_elems, s.n * s.k, M * s.n, M * s.k});
  __nv_bfloat16 *x, *w, *y;
  cudaMalloc(&x, max_elems * 2);
  cudaMalloc(&w, max_elems * 2);
  cudaMalloc(&y, max_elems * 2);
  cudaMemset(x, 0x3c, max_elems * 2);
  cudaMemset(w, 0x3c, max_elems * 2);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (const Shape& s : shapes) {
    std::vector<double> ms;
    for (int i = 0; i < 12; ++i) {
      cudaEventRecord(a);
      if (!gemm.Run(x, w, y, M, s.n, s.k, nullptr).ok()) return 1;
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float t = 0;
      cudaEventElapsedTime(&t, a, b);
      if (i >= 2) ms.push_back(t);
    }
    const double m = Median(ms);
    std::printf("gemm %-9s %6lld x %6lld x %6lld: %.3f ms, %.0f TFLOP/s\n", s.name,
                static_cast<long long>(M), static_cast<long long>(s.n), static_cast<long long>(s.k),
                m, 2.0 * M * s.n * s.k / (m * 1e-3) / 1e12);
  }
  return 0;
}

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "draftfeed-bench engine|long|gemm|write-random|load [flags]: prefill throughput of the "
      "CUDA engine, one long sequence in forward chunks (chunked prefill), the cuBLASLt GEMM "
      "ceiling at the model's shapes, a real-size random checkpoint written to --out, or a cold "
      "load of the --model checkpoint against reading its files raw.");
  // absl's own --help finds no flag here (it looks for a file named as the program) and exits
  // 1: this lists every flag of bench/ and exits 0.
  const auto help = [] {
    return absl::StrCat(absl::ProgramUsageMessage(), "\n\n",
                        draftfeed::FlagsHelp({}, [](absl::string_view file) {
                          return absl::StrContains(file, "bench/");
                        }));
  };
  if (std::optional<int> rc = draftfeed::HandleHelpOrVersion(
          argc, argv, "draftfeed-bench", std::string(draftfeed::kDraftfeedVersion), help)) {
    return *rc;
  }
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string cmd = args.size() > 1 ? args[1] : "";
  if (cmd == "engine") return draftfeed::RunEngineBench();
  if (cmd == "gemm") return draftfeed::GemmProbe();
  if (cmd == "long") {
    return draftfeed::bench::RunLongSequenceBench(
        {.model = absl::GetFlag(FLAGS_model),
         .sequence_tokens = absl::GetFlag(FLAGS_sequence_tokens),
         .forward_tokens = absl::GetFlag(FLAGS_forward_tokens),
         .capture = absl::GetFlag(FLAGS_capture),
         .iters = absl::GetFlag(FLAGS_iters),
         .device = absl::GetFlag(FLAGS_device),
         .one_pass = absl::GetFlag(FLAGS_one_pass)});
  }
  if (cmd == "write-random")
    return draftfeed::bench::WriteRandomCheckpoint(absl::GetFlag(FLAGS_model));
  if (cmd == "load") {
    return draftfeed::bench::RunLoadBench(absl::GetFlag(FLAGS_model), absl::GetFlag(FLAGS_device));
  }
  std::fprintf(stderr,
               "usage: draftfeed-bench engine|long|gemm|write-random|load [--model ...] (see "
               "--help)\n");
  return 2;
}
