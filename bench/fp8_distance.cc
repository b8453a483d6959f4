// How far an FP8 model's hidden states are from those of the bf16 model it
// was quantized from: the same batch through both (`M` and `M-fp8`, the
// latter quantized as --quantize fp8 does, or drawn then quantized on the GPU
// for random:* shapes), per captured layer, the relative rms distance over
// all tokens and the median token's cosine.
//   draftfeed-fp8-distance --model random:qwen3.6-27b --device cuda:0
//   draftfeed-fp8-distance --model small-random-moe --device cpu
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "bench/bench_batches.h"
#include "server/model/cpu_engine.h"
#include "server/model/tensor.h"
#if DRAFTFEED_HAVE_CUDA
#include "server/model/cuda_engine.h"
#endif

ABSL_FLAG(std::string, model, "random:qwen3.6-27b", "The bf16 model (its -fp8 variant beside it).");
ABSL_FLAG(std::string, device, "cuda:0", "cpu or cuda:N.");
ABSL_FLAG(int64_t, tokens, 8192, "Packed tokens in the batch.");
ABSL_FLAG(int32_t, min_len, 512, "Shortest sequence.");
ABSL_FLAG(int32_t, max_len, 4096, "Longest sequence.");
ABSL_FLAG(int32_t, capture, 5, "Captured layers: evenly spaced, the last one the final norm.");

namespace draftfeed {
namespace {

absl::StatusOr<std::vector<uint16_t>> Capture(const std::string& spec, const ForwardInput& in) {
  DF_ASSIGN_OR_RETURN(std::unique_ptr<Model> model, OpenModel(spec));
  const std::string device = absl::GetFlag(FLAGS_device);
  std::unique_ptr<Engine> engine;
  if (device == "cpu") {
    DF_ASSIGN_OR_RETURN(engine, CpuEngine::Create(model.get(), 0));
  } else {
#if DRAFTFEED_HAVE_CUDA
    CudaEngineOptions o;
    o.device = device.size() > 5 ? std::stoi(device.substr(5)) : 0;
    o.max_tokens = static_cast<int64_t>(in.token_ids.size());
    o.max_seqs = static_cast<int64_t>(in.seq_lens.size());
    o.max_layers = static_cast<int64_t>(in.layers.size());
    DF_ASSIGN_OR_RETURN(engine, CudaEngine::Create(model.get(), o));
#else
    return absl::UnimplementedError("built without CUDA: use --device cpu");
#endif
  }
  std::vector<uint16_t> out(in.token_ids.size() * in.layers.size() *
                            static_cast<size_t>(model->config.hidden_size));
  DF_RETURN_IF_ERROR(engine->Forward(in, std::as_writable_bytes(std::span(out))));
  return out;
}

int Run() {
  const std::string spec = absl::GetFlag(FLAGS_model);
  auto probe = OpenModel(spec);
  if (!probe.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(probe.status().message()).c_str());
    return 1;
  }
  const ModelConfig c = (*probe)->config;
  probe->reset();
  const int64_t tokens = absl::GetFlag(FLAGS_tokens);
  const std::vector<int32_t> lens = bench::MixedLengths(
      tokens, std::min<int32_t>(absl::GetFlag(FLAGS_min_len), static_cast<int32_t>(tokens)),
      std::min<int32_t>(absl::GetFlag(FLAGS_max_len), static_cast<int32_t>(tokens)), 0);
  const std::vector<int32_t> ids = bench::RandomTokens(tokens, c.vocab_size, 1);
  const std::vector<int32_t> layers = bench::SpacedLayers(c, absl::GetFlag(FLAGS_capture));
  const ForwardInput in{ids, lens, layers};
  // "NAME:SEED" keeps its seed after the -fp8 suffix.
  std::string fp8 = spec;
  const size_t colon = spec.find(':', spec.rfind("random:") == 0 ? 7 : 0);
  fp8.insert(colon == std::string::npos ? fp8.size() : colon, "-fp8");
  auto a = Capture(spec, in);
  auto b = a.ok() ? Capture(fp8, in) : a;
  if (!a.ok() || !b.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string((a.ok() ? b : a).status().message()).c_str());
    return 1;
  }
  const int64_t K = static_cast<int64_t>(layers.size()), H = c.hidden_size;
  std::printf("%s vs %s on %s, %lld tokens in %zu sequences\n", spec.c_str(), fp8.c_str(),
              absl::GetFlag(FLAGS_device).c_str(), static_cast<long long>(tokens), lens.size());
  std::printf("%8s %14s %16s %14s\n", "layer", "relative rms", "median cosine", "worst cosine");
  for (int64_t k = 0; k < K; ++k) {
    double d2 = 0, r2 = 0;
    std::vector<double> cos;
    for (int64_t t = 0; t < tokens; ++t) {
      double td = 0, tr = 0, tg = 0;
      for (int64_t i = 0; i < H; ++i) {
        const size_t at = static_cast<size_t>((t * K + k) * H + i);
        const double r = Bf16ToFloat((*a)[at]), g = Bf16ToFloat((*b)[at]);
        d2 += (g - r) * (g - r);
        r2 += r * r;
        td += r * g;
        tr += r * r;
        tg += g * g;
      }
      cos.push_back(td / std::sqrt(tr * tg + 1e-30));
    }
    std::sort(cos.begin(), cos.end());
    std::printf("%8d %14.5f %16.6f %14.6f\n", layers[static_cast<size_t>(k)],
                std::sqrt(d2 / (r2 + 1e-30)), cos[cos.size() / 2], cos.front());
  }
  return 0;
}

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "draftfeed-fp8-distance: an FP8 model's hidden states beside its bf16 model's.\n"
      "  draftfeed-fp8-distance --model random:qwen3.6-27b --device cuda:0");
  absl::ParseCommandLine(argc, argv);
  return draftfeed::Run();
}
