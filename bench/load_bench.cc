#include "bench/load_bench.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "bench/bench_batches.h"
#include "server/model/cuda_engine.h"
#include "server/model/mapped_file.h"
#include "server/model/model.h"
#include "server/model/staged_read.h"
#include "server/model/weight_layout.h"

ABSL_FLAG(std::string, out, "", "write-random: the checkpoint directory to write.");
ABSL_FLAG(int32_t, shards, 4, "write-random: safetensors shards.");
ABSL_FLAG(int32_t, repeats, 3, "load: cold raw reads and cold loads timed (medians reported).");
ABSL_FLAG(int32_t, read_threads, 0, "load: threads of the raw read (0 = DefaultReadThreads()).");
ABSL_FLAG(int32_t, load_threads, 0, "load: the engine's upload threads (0 = its default).");

namespace draftfeed::bench {
namespace {

namespace fs = std::filesystem;
constexpr double kGB = 1e9;

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Element i of a tensor drawn as its RandomInit says, from a counter-based
// hash so that threads fill disjoint ranges independently. Normal draws are a
// unit-variance uniform (as the GPU fill draws them); row scales are left out
// (the load never runs the weights).
uint16_t Draw(const RandomInit& init, uint64_t key) {
  const double u = static_cast<double>(SplitMix(key) >> 11) * 0x1.0p-53;  // [0, 1)
  const double v = init.dist == RandomInit::Dist::kLogUniform
                       ? std::log(init.lo + (init.hi - init.lo) * u)
                       : init.offset + init.scale * (u - 0.5) * std::sqrt(12.0);
  return FloatToBf16(static_cast<float>(v));
}

// The checkpoint's files: what the loader reads.
std::vector<std::string> CheckpointFiles(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (e.is_regular_file() &&
        (absl::EndsWith(name, ".safetensors") || absl::EndsWith(name, ".json"))) {
      out.push_back(e.path().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Evicts every file; the fraction of their bytes still cached afterwards.
double EvictAll(const std::vector<std::string>& files) {
  double cached = 0, total = 0;
  for (const std::string& f : files) {
    if (absl::Status s = EvictFromPageCache(f); !s.ok()) {
      std::fprintf(stderr, "warning: %s\n", std::string(s.message()).c_str());
    }
    const double size = static_cast<double>(fs::file_size(f));
    absl::StatusOr<double> r = ResidentFraction(f);
    cached += size * (r.ok() ? *r : 1.0);
    total += size;
  }
  return total > 0 ? cached / total : 0;
}

}  // namespace

int WriteRandomCheckpoint(const std::string& spec) {
  const std::string dir = absl::GetFlag(FLAGS_out);
  if (dir.empty()) {
    std::fprintf(stderr, "error: write-random needs --out DIR\n");
    return 2;
  }
  auto shape = MakeRandomModel(spec);
  if (!shape.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(shape.status().message()).c_str());
    return 1;
  }
  const ModelConfig& c = (*shape)->config;
  if (c.quantization.enabled) {
    std::fprintf(stderr, "error: write-random writes bf16 checkpoints; %s is FP8\n", spec.c_str());
    return 2;
  }
  const auto t0 = std::chrono::steady_clock::now();
  Model m;
  m.id = spec;
  m.config = c;
  m.weights.layers.resize(static_cast<size_t>(c.num_layers));
  for (size_t i = 0; i < m.weights.layers.size(); ++i) m.weights.layers[i].kind = c.layer_types[i];
  std::vector<WeightSpec> specs = DecoderWeightSpecs(c);
  if (!c.tie_word_embeddings) specs.push_back(LmHeadSpec(c));
  std::vector<int64_t> begin;
  int64_t total = 0;
  for (const WeightSpec& s : specs) {
    begin.push_back(total);
    total += s.numel();
  }
  auto buffer = std::make_shared<std::vector<uint16_t>>(static_cast<size_t>(total));
  const int64_t threads = std::max<unsigned>(1, std::thread::hardware_concurrency());
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      const int64_t lo = total * w / threads, hi = total * (w + 1) / threads;
      size_t k =
          static_cast<size_t>(std::upper_bound(begin.begin(), begin.end(), lo) - begin.begin() - 1);
      for (int64_t i = lo; i < hi; ++i) {
        while (k + 1 < specs.size() && i >= begin[k + 1]) ++k;
        (*buffer)[static_cast<size_t>(i)] = Draw(specs[k].init, static_cast<uint64_t>(i));
      }
    });
  }
  for (std::thread& t : pool) t.join();
  for (size_t k = 0; k < specs.size(); ++k) {
    Tensor& t = WeightSlot(m.weights, specs[k]);
    t.dtype = DType::kBF16;
    t.shape = specs[k].shape;
    t.data = reinterpret_cast<const std::byte*>(buffer->data() + begin[k]);
  }
  if (c.tie_word_embeddings) m.weights.lm_head = m.weights.embed_tokens;
  m.storage = buffer;
  const double drawn = Since(t0);
  HfWriteOptions w;
  w.num_shards = absl::GetFlag(FLAGS_shards);
  if (absl::Status s = WriteHfCheckpoint(m, dir, w); !s.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::printf(
      "wrote %s: %s shape, %.2f GB of bf16 in %d shards (drawn in %.1f s, written in %.1f s)\n",
      dir.c_str(), spec.c_str(), total * 2 / kGB, w.num_shards, drawn, Since(t0) - drawn);
  return 0;
}

int RunLoadBench(const std::string& dir, int device) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    std::fprintf(stderr, "error: load needs --model DIR, a checkpoint directory (got %s)\n",
                 dir.c_str());
    return 2;
  }
  const std::vector<std::string> files = CheckpointFiles(dir);
  uint64_t bytes = 0;
  for (const std::string& f : files) bytes += fs::file_size(f);
  // The CUDA context exists before a target loads its model; not timed.
  if (cudaSetDevice(device) != cudaSuccess || cudaFree(nullptr) != cudaSuccess) {
    std::fprintf(stderr, "error: cannot use CUDA device %d\n", device);
    return 1;
  }
  StagedReadOptions raw;
  raw.threads = absl::GetFlag(FLAGS_read_threads);
  CudaEngineOptions opt;
  opt.device = device;
  opt.max_tokens = 2048;  // a small workspace: the weights are what is timed
  opt.max_seqs = 64;
  opt.max_layers = 4;
  opt.load_threads = absl::GetFlag(FLAGS_load_threads);
  std::printf("checkpoint %s: %zu files, %.2f GB\n", dir.c_str(), files.size(), bytes / kGB);

  std::vector<double> raw_s, load_s;
  double worst_cached = 0;
  for (int r = 0; r < std::max(1, absl::GetFlag(FLAGS_repeats)); ++r) {
    worst_cached = std::max(worst_cached, EvictAll(files));
    absl::StatusOr<StagedReadStats> read = ReadFilesRaw(files, raw);
    if (!read.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(read.status().message()).c_str());
      return 1;
    }
    raw_s.push_back(read->seconds);

    worst_cached = std::max(worst_cached, EvictAll(files));
    const auto t0 = std::chrono::steady_clock::now();
    auto model = LoadModel(dir);
    if (!model.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(model.status().message()).c_str());
      return 1;
    }
    const double opened = Since(t0);
    auto engine = CudaEngine::Create(model->get(), opt);
    if (!engine.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(engine.status().message()).c_str());
      return 1;
    }
    load_s.push_back(Since(t0));
    std::printf(
        "repeat %d: raw read %.2f s (%.2f GB/s, %d threads); load %.2f s (LoadModel %.2f s, "
        "engine %.2f s; %.2f GB of weights on the GPU)\n",
        r, read->seconds, read->bytes / kGB / read->seconds, read->threads, load_s.back(), opened,
        load_s.back() - opened, (*engine)->weight_bytes() / kGB);
  }
  const double raw_med = Median(raw_s), load_med = Median(load_s);
  if (worst_cached < 0.01) {
    std::printf("page cache: evicted before every timed pass (at most %.2f%% still cached)\n",
                100 * worst_cached);
  } else {
    std::printf(
        "page cache: eviction NOT possible here (up to %.1f%% still cached after "
        "POSIX_FADV_DONTNEED): both times are partly of a warm cache\n",
        100 * worst_cached);
  }
  std::printf(
      "load: median raw read %.2f s (%.2f GB/s), median load onto cuda:%d %.2f s "
      "(%.2f GB/s): ratio %.3f over %zu repeats (goal <= 1.25)\n",
      raw_med, bytes / kGB / raw_med, device, load_med, bytes / kGB / load_med, load_med / raw_med,
      raw_s.size());
  return 0;
}

}  // namespace draftfeed::bench
