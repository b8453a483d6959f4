// The cost of --check_weights over a large checkpoint on this machine:
//
//   draftfeed-weight-check-bench --model random:qwen3-8b --layers 8 --dir /tmp/wc
//
// Writes the built-in shape (cut to --layers) as a synthetic checkpoint in
// --dir (unless one is there: its values are a hash of their position,
// finite, FP8 codes and scales as a quantizer leaves them), loads it (mmap)
// and times CheckWeightsFinite from a cold page cache (the file evicted with
// POSIX_FADV_DONTNEED), from the page cache through a fresh mapping, and over
// pages already mapped, at 1 thread and at every hardware thread.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "server/model/mapped_file.h"
#include "server/model/model.h"
#include "server/model/weight_check.h"
#include "server/model/weight_layout.h"

ABSL_FLAG(std::string, model, "random:qwen3-8b", "A built-in real shape (random:...[-fp8]).");
ABSL_FLAG(int32_t, layers, 8, "Decoder layers kept of the shape (its size: the file's).");
ABSL_FLAG(std::string, dir, "/tmp/draftfeed-weight-check-bench", "Where the checkpoint is.");
ABSL_FLAG(int32_t, repeats, 3, "Timed passes of each kind (the fastest is reported).");

namespace draftfeed {
namespace {

namespace fs = std::filesystem;

uint64_t SplitMix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  return x ^ (x >> 31);
}

// Host buffers for every tensor of `m` (a device-random shape), filled in
// parallel: bf16 in [-1, 1), e4m3 codes that are never NaN, scales 1e-3.
void FillHostWeights(Model& m, std::vector<std::vector<uint8_t>>& keep) {
  std::vector<WeightSpec> specs = DecoderWeightSpecs(m.config);
  specs.push_back(LmHeadSpec(m.config));
  for (const WeightSpec& spec : specs) {
    Tensor& t = WeightSlot(m.weights, spec);
    if (t.dtype == DType::kInvalid) continue;
    std::vector<uint8_t>& bytes = keep.emplace_back(t.nbytes());
    const int64_t n = t.numel();
    const bool fp8 = t.fp8();
    const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    std::vector<std::thread> pool;
    for (int k = 0; k < threads; ++k) {
      pool.emplace_back([&, k] {
        for (int64_t i = n * k / threads; i < n * (k + 1) / threads; ++i) {
          const uint64_t h = SplitMix(static_cast<uint64_t>(i) * 1315423911u + spec.name.size());
          if (fp8) {
            bytes[i] = static_cast<uint8_t>(h % 0x7f) | static_cast<uint8_t>(h & 0x80);
          } else {
            const float v = static_cast<float>(static_cast<double>(h >> 11) * 0x1.0p-52 - 1.0);
            const uint16_t b = FloatToBf16(v);
            std::memcpy(&bytes[2 * i], &b, 2);
          }
        }
      });
    }
    for (std::thread& th : pool) th.join();
    t.data = reinterpret_cast<const std::byte*>(bytes.data());
    if (fp8) {
      std::vector<uint8_t>& scales = keep.emplace_back(t.scale_inv.nbytes());
      const float s = 1e-3f;
      for (size_t i = 0; i < scales.size(); i += 4) std::memcpy(&scales[i], &s, 4);
      t.scale_inv.data = reinterpret_cast<const std::byte*>(scales.data());
    }
  }
  m.weights_on_device_random = false;
}

int WriteIfMissing(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "config.json")) return 0;
  auto made = MakeRandomModel(absl::GetFlag(FLAGS_model));
  if (!made.ok()) return std::fprintf(stderr, "%s\n", made.status().ToString().c_str()), 1;
  Model& m = **made;
  const int layers = absl::GetFlag(FLAGS_layers);
  m.config.num_layers = layers;
  m.config.layer_types.resize(layers);
  m.weights.layers.resize(layers);
  std::vector<std::vector<uint8_t>> keep;
  FillHostWeights(m, keep);
  const auto t0 = std::chrono::steady_clock::now();
  if (absl::Status s = WriteHfCheckpoint(m, dir, {}); !s.ok()) {
    return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 1;
  }
  std::printf("wrote %s in %.1fs\n", dir.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return 0;
}

int Run() {
  const std::string dir = absl::GetFlag(FLAGS_dir);
  if (int rc = WriteIfMissing(dir); rc != 0) return rc;
  const int all = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().string());
  // cold: evicted from the page cache (a first start-up); cached: in the page
  // cache, freshly mapped (a restart: every page still faults in); mapped:
  // scanned once already in this mapping (the scan's own speed).
  for (const char* mode : {"cold", "cached", "mapped"}) {
    const bool cold = std::string(mode) == "cold", mapped = std::string(mode) == "mapped";
    for (const int threads : {1, all}) {
      WeightCheckStats best;
      std::unique_ptr<Model> model;
      for (int r = 0; r < absl::GetFlag(FLAGS_repeats); ++r) {
        if (!mapped || model == nullptr) {
          // Pages mapped by a process stay cached: unmap before evicting.
          model.reset();
          if (cold) {
            for (const std::string& f : files) (void)EvictFromPageCache(f);
          }
          auto opened = OpenModel(dir);
          if (!opened.ok()) {
            return std::fprintf(stderr, "%s\n", opened.status().ToString().c_str()), 1;
          }
          model = *std::move(opened);
          if (mapped) (void)CheckWeightsFinite(*model);  // every page in
        }
        WeightCheckStats stats;
        if (absl::Status s = CheckWeightsFinite(*model, &stats, threads); !s.ok()) {
          return std::fprintf(stderr, "%s\n", s.ToString().c_str()), 1;
        }
        if (r == 0 || stats.seconds < best.seconds) best = stats;
      }
      std::printf("%s, %d thread(s): %lld tensors, %.2f GiB in %.3fs = %.2f GiB/s\n", mode,
                  best.threads, static_cast<long long>(best.tensors),
                  static_cast<double>(best.bytes) / (1 << 30), best.seconds,
                  static_cast<double>(best.bytes) / (1 << 30) / best.seconds);
    }
  }
  return 0;
}

}  // namespace
}  // namespace draftfeed

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("draftfeed-weight-check-bench [--model --layers --dir]");
  absl::ParseCommandLine(argc, argv);
  return draftfeed::Run();
}
