// Tensor parallelism on the GPU (skips without one): every architecture's
// sharded CUDA engine against the unsharded one and the CPU reference, at tp
// 2 and 4 with the ranks sharing one GPU (the plan proven on any one GPU),
// and with one rank per GPU through NCCL where the machine has the GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "server/model/cpu_engine.h"
#include "server/model/cuda_engine.h"
#include "server/model/sharding_plan.h"
#include "server/model/tensor.h"
#include "server/model/tensor_parallel_cuda_engine.h"

namespace draftfeed {
namespace {

struct Batch {
  std::vector<int32_t> ids, lens, layers;
  ForwardInput input() const { return {ids, lens, layers}; }
};

// Six packed sequences of odd lengths (several 64- and 128-row tiles and
// partial ones), every layer and the final norm captured.
Batch MakeBatch(const ModelConfig& c, uint64_t seed) {
  Batch b;
  b.lens = {1, 63, 64, 65, 200, 7};
  int64_t T = 0;
  for (int32_t l : b.lens) T += l;
  std::mt19937_64 rng(seed);
  for (int64_t i = 0; i < T; ++i) {
    b.ids.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(c.vocab_size)));
  }
  for (int32_t l = 0; l < c.num_layers; ++l) b.layers.push_back(l);
  b.layers.push_back(kFinalLayerId);
  return b;
}

CudaEngineOptions Options() {
  CudaEngineOptions o;
  o.max_tokens = 1024;
  o.max_seqs = 16;
  return o;
}

std::vector<uint16_t> Capture(Engine& e, const Batch& b) {
  std::vector<uint16_t> out(b.ids.size() * b.layers.size() *
                            static_cast<size_t>(e.model().config.hidden_size));
  const absl::Status s = e.Forward(b.input(), std::as_writable_bytes(std::span(out)));
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// Per captured slot, the median over tokens of |got - ref| / |ref| (L2 over
// the hidden state), and the median cosine.
struct SlotError {
  double median_rel = 0, median_cos = 0;
};
std::vector<SlotError> Errors(const std::vector<float>& ref, const std::vector<uint16_t>& got,
                              int64_t T, int64_t K, int64_t H) {
  std::vector<SlotError> out;
  for (int64_t k = 0; k < K; ++k) {
    std::vector<double> rel, cos;
    for (int64_t t = 0; t < T; ++t) {
      double d2 = 0, r2 = 0, g2 = 0, dot = 0;
      for (int64_t i = 0; i < H; ++i) {
        const double r = ref[static_cast<size_t>((t * K + k) * H + i)];
        const double g = Bf16ToFloat(got[static_cast<size_t>((t * K + k) * H + i)]);
        d2 += (g - r) * (g - r);
        r2 += r * r;
        g2 += g * g;
        dot += r * g;
      }
      rel.push_back(std::sqrt(d2 / (r2 + 1e-30)));
      cos.push_back(dot / std::sqrt(r2 * g2 + 1e-30));
    }
    std::nth_element(rel.begin(), rel.begin() + T / 2, rel.end());
    std::nth_element(cos.begin(), cos.begin() + T / 2, cos.end());
    out.push_back({rel[static_cast<size_t>(T / 2)], cos[static_cast<size_t>(T / 2)]});
  }
  return out;
}

std::unique_ptr<TensorParallelCudaEngine> MakeTp(const Model& m, int tp, MoeParallel moe,
                                                 const std::vector<int>& devices) {
  absl::StatusOr<ShardingPlan> plan = PlanTensorParallel(m.config, tp, moe);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return nullptr;
  auto e = TensorParallelCudaEngine::Create(&m, *std::move(plan), devices, Options());
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

struct Case {
  const char* model;
  int tp;
  MoeParallel moe;
};
std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string n = info.param.model;
  std::replace(n.begin(), n.end(), '-', '_');
  return n + "_tp" + std::to_string(info.param.tp) + "_" +
         std::string(MoeParallelName(info.param.moe));
}

class CudaTensorParallelTest : public ::testing::TestWithParam<Case> {};

// The sharded engine computes the unsharded engine's maths with the block
// sums regrouped: each rank's mixer and dense-MLP output is its partial
// product rounded to bf16, and the partials are summed (in fp32, rounded
// once) by the all-reduce, where the unsharded GEMM rounds the whole sum
// once. That is at most one more bf16 rounding (relative 2^-9) of every
// block output, and a block output is no larger than the residual it joins,
// so a token's relative error may grow by about 2^-9 per block over the
// unsharded engine's; the MoE partials are summed in fp32 (no rounding). The
// bound, per captured layer, on the median token (which routing flips,
// themselves caused by bf16 noise, cannot move: cuda_moe_engine_test):
// median_rel(tp) <= 1.25 x median_rel(unsharded) + 2^-9 x blocks so far;
// and the median cosine distance within 1.25x the unsharded engine's + 1e-4. A wrong
// slice, a missing or doubled sum, or a rank evaluating the wrong experts
// moves every token by far more (a doubled block output: relative ~1).
TEST_P(CudaTensorParallelTest, MatchesUnshardedWithinOneRoundingPerBlock) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const Case p = GetParam();
  auto model = OpenModel(p.model);
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelConfig& c = (*model)->config;
  const Batch b = MakeBatch(c, 11);
  const int64_t T = static_cast<int64_t>(b.ids.size()), K = static_cast<int64_t>(b.layers.size()),
                H = c.hidden_size;
  auto cpu = CpuEngine::Create(model->get(), 0);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::vector<float> ref(static_cast<size_t>(T * K * H));
  ASSERT_TRUE((*cpu)->ForwardFloat(b.input(), ref).ok());
  auto whole = CudaEngine::Create(model->get(), Options());
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::vector<uint16_t> unsharded = Capture(**whole, b);
  auto tp = MakeTp(**model, p.tp, p.moe, std::vector<int>(static_cast<size_t>(p.tp), 0));
  ASSERT_NE(tp, nullptr);
  const std::vector<uint16_t> sharded = Capture(*tp, b);

  const std::vector<SlotError> eu = Errors(ref, unsharded, T, K, H);
  const std::vector<SlotError> es = Errors(ref, sharded, T, K, H);
  for (int64_t k = 0; k < K; ++k) {
    const int32_t layer = b.layers[static_cast<size_t>(k)];
    const int blocks = 2 * (layer == kFinalLayerId ? c.num_layers : layer + 1);
    const double bound = 1.25 * eu[k].median_rel + blocks * std::ldexp(1.0, -9);
    EXPECT_LE(es[k].median_rel, bound)
        << p.model << " layer " << layer << ": unsharded median " << eu[k].median_rel;
    // Cosine distance grows as the error does: within 1.25x the unsharded
    // engine's plus 1e-4 (for bf16 models, whose unsharded distance is ~0,
    // that is cos >= 0.9999; FP8 ones start near 1e-3 from their activation
    // quantization).
    EXPECT_LE(1 - es[k].median_cos, 1.25 * (1 - eu[k].median_cos) + 1e-4)
        << p.model << " layer " << layer << ": cos " << es[k].median_cos << ", unsharded "
        << eu[k].median_cos;
  }
}

// The same forward through ForwardAsync (the target's path) gives the same
// bits as Forward, twice in a row (both capture buffers).
TEST_P(CudaTensorParallelTest, AsyncCaptureEqualsForward) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  const Case p = GetParam();
  auto model = OpenModel(p.model);
  ASSERT_TRUE(model.ok()) << model.status();
  const Batch b = MakeBatch((*model)->config, 12);
  auto tp = MakeTp(**model, p.tp, p.moe, std::vector<int>(static_cast<size_t>(p.tp), 0));
  ASSERT_NE(tp, nullptr);
  const std::vector<uint16_t> sync = Capture(*tp, b);
  for (int round = 0; round < 2; ++round) {
    std::vector<uint16_t> async(sync.size());
    std::promise<absl::Status> copied;
    const absl::Status s = tp->ForwardAsync(b.input(), std::as_writable_bytes(std::span(async)),
                                            [&](Engine::Copied c) { copied.set_value(c.status); });
    ASSERT_TRUE(s.ok()) << s;
    const absl::Status c = copied.get_future().get();
    EXPECT_TRUE(c.ok()) << c;
    EXPECT_EQ(async, sync) << "round " << round;
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, CudaTensorParallelTest,
                         ::testing::Values(Case{"tiny-random", 2, MoeParallel::kExpert},
                                           Case{"tiny-random", 4, MoeParallel::kExpert},
                                           Case{"tiny-random-qwen3", 2, MoeParallel::kExpert},
                                           Case{"tiny-random-qwen3", 4, MoeParallel::kExpert},
                                           Case{"small-random-qwen3", 2, MoeParallel::kExpert},
                                           Case{"tiny-random-moe", 2, MoeParallel::kExpert},
                                           Case{"tiny-random-moe", 4, MoeParallel::kExpert},
                                           Case{"tiny-random-moe", 2, MoeParallel::kSplit},
                                           Case{"tiny-random-qwen3-moe", 2, MoeParallel::kExpert},
                                           Case{"tiny-random-qwen3-moe", 2, MoeParallel::kSplit},
                                           Case{"small-random-qwen3-moe", 2, MoeParallel::kExpert},
                                           // FP8: weights cut with their 128x128 block scales
                                           // (every piece on a block edge at these widths).
                                           Case{"small-random-qwen3-fp8", 2, MoeParallel::kExpert},
                                           Case{"small-random-qwen3-fp8", 4, MoeParallel::kExpert},
                                           Case{"small-random-qwen3-moe-fp8", 2,
                                                MoeParallel::kExpert}),
                         CaseName);

// tp 1 runs the tensor-parallel code path with no sums: the plain engine's
// bits exactly.
TEST(CudaTensorParallel, TpOneIsThePlainEngine) {
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  for (const char* name : {"tiny-random", "tiny-random-moe"}) {
    auto model = OpenModel(name);
    ASSERT_TRUE(model.ok()) << model.status();
    const Batch b = MakeBatch((*model)->config, 13);
    auto whole = CudaEngine::Create(model->get(), Options());
    ASSERT_TRUE(whole.ok()) << whole.status();
    auto tp = MakeTp(**model, 1, MoeParallel::kExpert, {0});
    ASSERT_NE(tp, nullptr);
    EXPECT_EQ(tp->all_reduce_kind(), "none");
    EXPECT_EQ(Capture(*tp, b), Capture(**whole, b)) << name;
  }
}

// One rank per GPU through NCCL gives the same bits as the ranks sharing one
// GPU: with two ranks both sum a + b once in fp32 (bf16 partials widened
// exactly, one rounding), so the order cannot differ.
TEST(CudaTensorParallel, NcclAcrossGpusEqualsOneGpu) {
  if (CudaDeviceCount() < 2) GTEST_SKIP() << "needs two CUDA devices";
  // NVLink multicast stays off unless the caller chose otherwise: on a host
  // whose GPUs others share it can put them out of service.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  for (const char* name : {"tiny-random", "tiny-random-moe", "tiny-random-qwen3-moe"}) {
    auto model = OpenModel(name);
    ASSERT_TRUE(model.ok()) << model.status();
    const Batch b = MakeBatch((*model)->config, 14);
    auto one = MakeTp(**model, 2, MoeParallel::kExpert, {0, 0});
    auto two = MakeTp(**model, 2, MoeParallel::kExpert, {0, 1});
    ASSERT_NE(one, nullptr);
    ASSERT_NE(two, nullptr);
    EXPECT_EQ(two->all_reduce_kind(), "nccl");
    EXPECT_EQ(Capture(*two, b), Capture(*one, b)) << name;
  }
}

TEST(CudaTensorParallel, RefusesBadGroups) {
  auto model = OpenModel("tiny-random");
  ASSERT_TRUE(model.ok()) << model.status();
  auto plan = PlanTensorParallel((*model)->config, 2, MoeParallel::kExpert);
  ASSERT_TRUE(plan.ok());
  auto wrong_count = TensorParallelCudaEngine::Create(model->get(), *plan, {0}, Options());
  ASSERT_FALSE(wrong_count.ok());
  EXPECT_NE(wrong_count.status().message().find("needs 2 devices"), std::string::npos)
      << wrong_count.status();
  auto fp8 = OpenModel("tiny-random-fp8");
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  auto fp8_plan = PlanTensorParallel((*fp8)->config, 2, MoeParallel::kExpert);
  ASSERT_TRUE(fp8_plan.ok());
  // tiny-random's 128-wide projections cut in two would split scale blocks.
  auto refused = TensorParallelCudaEngine::Create(fp8->get(), *fp8_plan, {0, 0}, Options());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("off its 128x128 scale blocks"), std::string::npos)
      << refused.status();
}

}  // namespace
}  // namespace draftfeed
