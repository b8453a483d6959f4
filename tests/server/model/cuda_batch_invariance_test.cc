// Batch invariance of the CUDA engine at real shapes (skips without a GPU or
// without the memory): one 1,500-token sequence alone, then first, middle and
// last among other sequences in batches of 5,200 tokens and middle in the
// 49,152-token budget, and again alone in a freshly created engine (its GEMM
// algorithms chosen anew). Its rows (hidden states at five layers, then the
// target outputs: argmax, top-8, probs over a 4,096-id draft vocabulary) must
// be bit-identical in every placement. Random weights amplify a first
// difference layer by layer, so the table printed per placement (differing
// tokens per captured layer) points at the layer where a difference starts.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/capture_encoding.h"
#include "common/target_outputs.h"
#include "common/status_macros.h"
#include "server/model/cuda_engine.h"
#include "server/model/sharding_plan.h"
#include "server/model/tensor_parallel_cuda_engine.h"
#include "server/model/model.h"

namespace draftfeed {
namespace {

constexpr int32_t kSequence = 1500;

std::vector<int32_t> Tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& t : ids) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return ids;
}

// A batch holding the sequence at `index` of `lens` (its entry == kSequence).
struct Placement {
  const char* name;
  std::vector<int32_t> lens;
  int index;
};

std::vector<Placement> Placements() {
  return {
      {"first of 5200", {kSequence, 2000, 1700}, 0},
      {"middle of 5200", {1800, kSequence, 1900}, 1},
      {"last of 5200", {3700, kSequence}, 1},
      {"middle of 49152", {8192, 8192, 4000, kSequence, 8192, 8192, 8192, 2692}, 3},
  };
}

struct Case {
  const char* model;
  CudaEngineOptions::Fp8Gemm fp8_gemm = CudaEngineOptions::Fp8Gemm::kAuto;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string n = info.param.model;
  if (info.param.fp8_gemm == CudaEngineOptions::Fp8Gemm::kCublasLt) n += "_cublaslt_fp8_gemm";
  for (char& ch : n) {
    if (ch == '-' || ch == ':' || ch == '.') ch = '_';
  }
  return n;
}

using MakeEngine = std::function<absl::StatusOr<std::unique_ptr<Engine>>()>;

bool HasRoom() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return false;
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  return free_b >= (size_t{120} << 30);
}

CudaEngineOptions InvarianceOptions() {
  CudaEngineOptions opt;
  opt.max_tokens = 49152;
  opt.max_seqs = 16;
  opt.max_layers = 5;
  return opt;
}

// The sequence in every placement on engines `make` creates (one, then a
// fresh one for the restart), against it alone.
void ExpectTheSameBitsWhereverPacked(const std::string& what, const ModelConfig& c,
                                     const MakeEngine& make) {
  auto engine = make();
  ASSERT_TRUE(engine.ok()) << engine.status();

  const int32_t L = static_cast<int32_t>(c.num_layers);
  const std::vector<int32_t> layers = {0, 1, 2, L / 2, kFinalLayerId};
  TargetOutputs outputs{.argmax = true, .top_k = 8};
  if ((*engine)->serves_target_outputs()) {
    std::vector<int32_t> all(static_cast<size_t>(c.vocab_size));
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), std::mt19937_64(3));
    outputs.draft_vocab.assign(all.begin(), all.begin() + 4096);
  } else {
    outputs = TargetOutputs{};
  }
  const std::vector<int32_t> seq = Tokens(kSequence, c.vocab_size, 7);

  auto run = [&](Engine& e, const std::vector<int32_t>& lens, int index,
                 std::vector<std::byte>& out) -> size_t {
    std::vector<int32_t> ids;
    size_t begin = 0;
    for (int i = 0; i < static_cast<int>(lens.size()); ++i) {
      if (i == index) {
        begin = ids.size();
        ids.insert(ids.end(), seq.begin(), seq.end());
      } else {
        const auto other = Tokens(lens[static_cast<size_t>(i)], c.vocab_size, 100 + i);
        ids.insert(ids.end(), other.begin(), other.end());
      }
    }
    ForwardInput in{ids, lens, layers};
    in.outputs = &outputs;
    out.assign(CaptureBytes(c, in), std::byte{0});
    const absl::Status s = e.Forward(in, out);
    EXPECT_TRUE(s.ok()) << s;
    return begin;
  };

  const size_t row = CaptureBytes(c, ForwardInput{seq, std::vector<int32_t>{kSequence}, layers,
                                                  CaptureEncoding::kBf16, &outputs}) /
                     kSequence;
  const size_t layer_bytes = static_cast<size_t>(c.hidden_size) * 2;
  std::vector<std::byte> alone;
  run(**engine, {kSequence}, 0, alone);

  // Differing tokens per captured layer and in the outputs, against `alone`.
  auto compare = [&](const char* where, const std::vector<std::byte>& got, size_t begin) {
    std::vector<int64_t> differing(layers.size() + 1, 0);
    for (size_t t = 0; t < static_cast<size_t>(kSequence); ++t) {
      const std::byte* a = alone.data() + t * row;
      const std::byte* b = got.data() + (begin + t) * row;
      for (size_t j = 0; j < layers.size(); ++j) {
        differing[j] += std::memcmp(a + j * layer_bytes, b + j * layer_bytes, layer_bytes) != 0;
      }
      const size_t tail = layers.size() * layer_bytes;
      differing.back() += std::memcmp(a + tail, b + tail, row - tail) != 0;
    }
    std::string table;
    for (size_t j = 0; j < layers.size(); ++j) {
      table += " L" + std::to_string(layers[j]) + "=" + std::to_string(differing[j]);
    }
    table += " outputs=" + std::to_string(differing.back());
    std::printf("%s, %s: differing tokens%s\n", what.c_str(), where, table.c_str());
    for (size_t j = 0; j < differing.size(); ++j) {
      EXPECT_EQ(differing[j], 0) << where << ": capture slot " << j << "\n" << table;
    }
  };

  std::vector<std::byte> again;
  run(**engine, {kSequence}, 0, again);
  compare("alone again", again, 0);
  for (const Placement& p : Placements()) {
    std::vector<std::byte> got;
    const size_t begin = run(**engine, p.lens, p.index, got);
    compare(p.name, got, begin);
  }
  engine->reset();
  auto fresh = make();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  run(**fresh, {kSequence}, 0, again);
  compare("alone, new engine", again, 0);
}

class CudaBatchInvariance : public ::testing::TestWithParam<Case> {};

TEST_P(CudaBatchInvariance, ASequenceGetsTheSameBitsWhereverItIsPacked) {
  if (!HasRoom()) GTEST_SKIP() << "needs a CUDA device with 120 GiB free";
  auto model = OpenModel(GetParam().model);
  ASSERT_TRUE(model.ok()) << model.status();
  CudaEngineOptions opt = InvarianceOptions();
  opt.fp8_gemm = GetParam().fp8_gemm;
  ExpectTheSameBitsWhereverPacked(
      GetParam().model, (*model)->config,
      [&]() -> absl::StatusOr<std::unique_ptr<Engine>> {
        DF_ASSIGN_OR_RETURN(auto e, CudaEngine::Create(model->get(), opt));
        return std::unique_ptr<Engine>(std::move(e));
      });
}

// Tensor parallel with both ranks on GPU 0 (the one-device kernel sums them
// in a fixed order): invariant too, a dense and an expert-parallel MoE shape.
TEST(CudaBatchInvarianceTensorParallel, ASequenceGetsTheSameBitsWhereverItIsPacked) {
  if (!HasRoom()) GTEST_SKIP() << "needs a CUDA device with 120 GiB free";
  for (const char* spec : {"random:qwen3-8b", "random:qwen3-30b-a3b"}) {
    SCOPED_TRACE(spec);
    auto model = OpenModel(spec);
    ASSERT_TRUE(model.ok()) << model.status();
    const ModelConfig& c = (*model)->config;
    ExpectTheSameBitsWhereverPacked(
        std::string(spec) + " tp2", c, [&]() -> absl::StatusOr<std::unique_ptr<Engine>> {
          DF_ASSIGN_OR_RETURN(ShardingPlan plan, PlanTensorParallel(c, 2));
          DF_ASSIGN_OR_RETURN(auto e, TensorParallelCudaEngine::Create(
                                          model->get(), std::move(plan), {0, 0},
                                          InvarianceOptions()));
          EXPECT_TRUE(e->batch_invariant());
          return std::unique_ptr<Engine>(std::move(e));
        });
  }
}

using Fp8Gemm = CudaEngineOptions::Fp8Gemm;
INSTANTIATE_TEST_SUITE_P(Shapes, CudaBatchInvariance,
                         ::testing::Values(Case{"random:qwen3.6-27b"},
                                           Case{"random:qwen3.6-27b-fp8"},
                                           Case{"random:qwen3.6-27b-fp8", Fp8Gemm::kCublasLt},
                                           Case{"random:qwen3.6-35b-a3b"},
                                           Case{"random:qwen3.6-35b-a3b-fp8"},
                                           Case{"random:qwen3-30b-a3b"},
                                           Case{"random:qwen3-8b"},
                                           Case{"random:qwen3-8b-fp8"}),
                         CaseName);

}  // namespace
}  // namespace draftfeed
