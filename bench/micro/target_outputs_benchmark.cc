// The target outputs from one chunk of fp32 logits as the CUDA engine runs
// them: 1,024 tokens x Qwen3.6's 248,320 ids (1 GB), a 32,000-id draft
// vocabulary (EAGLE-3's), argmax, bf16 probs, and top_k 0 or 256. GB/s count
// the logits read once (the outputs, 66 KB a token, are left out): the op is
// meant to run at HBM speed, whatever top_k. The lm_head GEMM before it
// (1,024 x 248,320 x 5,120, ~3.5 ms at the bf16 ceiling's 75%) is not timed.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "bench/micro/gpu_benchmark.h"
#include "benchmark/benchmark.h"
#include "kernels/target_outputs.cuh"

namespace draftfeed::bench {
namespace {

constexpr int64_t kChunkTokens = 1024;
constexpr int64_t kDraft = 32000;

void BM_TargetOutputs(benchmark::State& state) {
  const int32_t top_k = static_cast<int32_t>(state.range(0));
  const int64_t V = qwen36_27b::kVocab;
  DeviceArray<float> logits(kChunkTokens * V);
  // Logits of a trained model's scale (a few units), in random order over ids.
  FillRandom(logits, 1, 3.0f);
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(7);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(kDraft);
  DeviceArray<int32_t> draft(ids);
  DeviceArray<uint8_t> index(static_cast<int64_t>(cuda::DraftIndexBytes(V, kDraft)));
  if (SetupError() == cudaSuccess) {
    NoteSetup(cuda::BuildDraftIndex(draft.get(), kDraft, V, index.get(), nullptr));
  }
  // The wire layout (common/target_outputs.h) after no hidden capture.
  cuda::TargetOutputOffsets off;
  off.argmax = 0;
  int64_t row = 4;
  if (top_k > 0) {
    off.top_k_ids = row;
    off.top_k_logprobs = row + 4 * top_k;
    row += 8 * top_k;
  }
  off.probs = row;
  row += 2 * kDraft;
  DeviceArray<uint8_t> out(kChunkTokens * row);
  TimeKernel(state, {static_cast<double>(logits.bytes())}, [&] {
    return cuda::TargetOutputsFromLogits(logits.get(), kChunkTokens, V, V, index.get(), kDraft,
                                         top_k, off, out.get(), row, nullptr);
  });
}
DF_GPU_BENCHMARK(BM_TargetOutputs)->ArgName("top_k")->Arg(0)->Arg(256);

}  // namespace
}  // namespace draftfeed::bench
