#include "server/model/sharded_cpu_engine.h"
#include "server/model/fp8_quantize.h"

#include <algorithm>
#include <cmath>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/fp8_capture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/cpu_engine.h"
#include "server/model/fp8_quantize.h"
#include "server/model/model.h"

namespace draftfeed {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Model> Make(const std::string& spec) {
  absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(spec);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// A built-in's config with four KV heads and four GDN key heads (eight value
// heads), so that tp 4 divides every head count; the widths (F = 256, I = 64,
// I_s = 64, 8 experts) already divide 4.
std::unique_ptr<Model> MakeWide(const std::string& spec, uint64_t seed) {
  ModelConfig c = Make(spec)->config;
  c.num_kv_heads = 4;
  c.linear_num_key_heads = 4;
  c.linear_num_value_heads = 8;
  absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(c, seed);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

std::unique_ptr<ShardedCpuEngine> MakeSharded(const Model& m, int tp, MoeParallel moe,
                                              int threads) {
  absl::StatusOr<ShardingPlan> plan = PlanTensorParallel(m.config, tp, moe);
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<ShardedCpuEngine>> e =
      ShardedCpuEngine::Create(&m, *std::move(plan), threads);
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? std::move(*e) : nullptr;
}

struct Batch {
  std::vector<int32_t> tokens, lens, layers;
};

// Three packed sequences, every layer captured and the final norm.
Batch MakeBatch(const ModelConfig& c, uint64_t seed) {
  Batch b;
  b.lens = {37, 1, 90};
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 128; ++i) {
    b.tokens.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(c.vocab_size)));
  }
  for (int32_t l = 0; l < c.num_layers; ++l) b.layers.push_back(l);
  b.layers.push_back(kFinalLayerId);
  return b;
}

template <typename E>
std::vector<float> RunFloat(E& engine, const Batch& b) {
  std::vector<float> out(b.tokens.size() * b.layers.size() *
                         static_cast<size_t>(engine.model().config.hidden_size));
  const absl::Status st = engine.ForwardFloat({b.tokens, b.lens, b.layers}, out);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// Sharded and unsharded compute the same sums in a different grouping: a
// block's output is Σ over heads / columns / experts, which the ranks split
// into tp partial sums added in rank order. In fp32 each regrouped sum
// differs by a few ulps of the magnitudes summed (|rel| ~ 1e-7), and the
// difference is carried through the later layers (norms, softmax, the GDN
// recurrence) without growing much over four layers: measured at most 4e-6
// of a captured layer's max |state| (median 5e-7) over these cases. The
// bound is 2e-5 of it, several times above; a wrong slice (another head's
// rows, a missing all-reduce) is off by O(1) of it.
void ExpectClose(const std::vector<float>& ref, const std::vector<float>& got, const Batch& b,
                 int64_t hidden) {
  ASSERT_EQ(ref.size(), got.size());
  const int64_t k_total = static_cast<int64_t>(b.layers.size());
  const int64_t tokens = static_cast<int64_t>(b.tokens.size());
  for (int64_t k = 0; k < k_total; ++k) {
    float max_ref = 0.0f, max_err = 0.0f;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < hidden; ++j) {
        const size_t i = static_cast<size_t>((t * k_total + k) * hidden + j);
        max_ref = std::max(max_ref, std::abs(ref[i]));
        max_err = std::max(max_err, std::abs(ref[i] - got[i]));
      }
    }
    EXPECT_GT(max_ref, 0.0f);
    EXPECT_LE(max_err, 2e-5f * max_ref) << "capture " << b.layers[static_cast<size_t>(k)]
                                        << ": max error " << max_err << ", max |ref| " << max_ref;
  }
}

struct Case {
  std::string spec;
  bool wide;  // heads widened so that tp 4 divides them
  int tp;
  MoeParallel moe;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.spec << (c.wide ? " (4 KV and GDN key heads)" : "") << " tp " << c.tp << " "
      << MoeParallelName(c.moe);
}

class ShardedEqualsUnsharded : public ::testing::TestWithParam<Case> {};

TEST_P(ShardedEqualsUnsharded, WithinFp32Regrouping) {
  const Case& c = GetParam();
  std::unique_ptr<Model> m = c.wide ? MakeWide(c.spec, 11) : Make(c.spec);
  ASSERT_NE(m, nullptr);
  auto ref_engine = CpuEngine::Create(m.get(), 2);
  ASSERT_TRUE(ref_engine.ok()) << ref_engine.status();
  auto sharded = MakeSharded(*m, c.tp, c.moe, 4);
  ASSERT_NE(sharded, nullptr);
  const Batch b = MakeBatch(m->config, 3);
  const std::vector<float> ref = RunFloat(**ref_engine, b);
  const std::vector<float> got = RunFloat(*sharded, b);
  ExpectClose(ref, got, b, m->config.hidden_size);
  // The all-reduce sums in rank order: the same bits on every run and
  // whatever the threads per rank.
  auto other_threads = MakeSharded(*m, c.tp, c.moe, 1);
  ASSERT_NE(other_threads, nullptr);
  EXPECT_EQ(RunFloat(*sharded, b), got);
  EXPECT_EQ(RunFloat(*other_threads, b), got);
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  // The built-ins at tp 4 share each of their 2 KV (and GDN key) heads
  // between two ranks; the widened ones split 4 of them.
  for (const char* spec : {"tiny-random", "tiny-random-qwen3"}) {
    cases.push_back({spec, false, 2, MoeParallel::kExpert});
    cases.push_back({spec, false, 4, MoeParallel::kExpert});
    cases.push_back({spec, true, 4, MoeParallel::kExpert});
  }
  for (const char* spec : {"tiny-random-moe", "tiny-random-qwen3-moe"}) {
    for (MoeParallel moe : {MoeParallel::kExpert, MoeParallel::kSplit}) {
      cases.push_back({spec, false, 2, moe});
      cases.push_back({spec, false, 4, moe});
      cases.push_back({spec, true, 4, moe});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Models, ShardedEqualsUnsharded, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::string name = info.param.spec + (info.param.wide ? "_wide" : "") +
                                              "_tp" + std::to_string(info.param.tp) + "_" +
                                              std::string(MoeParallelName(info.param.moe));
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// FP8 models (QuantizeModelFp8, 128x128 blocks) cut with their block scales.
// A built-in widened so that tp 2 cuts every sliced axis on a block edge:
// hidden 256, 4 heads of 64 (q|gate rows 512, k and v 256), 4 GDN key heads
// of 64 and 8 value heads of 32, MLP / shared expert 256 wide.
std::unique_ptr<Model> MakeFp8BlockAligned(const std::string& spec, uint64_t seed) {
  ModelConfig c = Make(spec)->config;
  c.hidden_size = 256;
  c.num_heads = 4;
  c.head_dim = 64;
  c.num_kv_heads = 4;
  c.linear_num_key_heads = 4;
  c.linear_key_head_dim = 64;
  c.linear_num_value_heads = 8;
  if (c.intermediate_size > 0) c.intermediate_size = 256;
  if (c.shared_expert_intermediate_size > 0) c.shared_expert_intermediate_size = 256;
  if (c.moe_intermediate_size > 0) c.moe_intermediate_size = 128;
  absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(c, seed);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return nullptr;
  const absl::Status q = QuantizeModelFp8(**m);
  EXPECT_TRUE(q.ok()) << q;
  return q.ok() ? std::move(*m) : nullptr;
}

TEST(ShardedCpuEngineTest, Fp8ModelsCutWithTheirScalesEqualUnsharded) {
  for (const char* spec : {"tiny-random", "tiny-random-qwen3", "tiny-random-moe"}) {
    SCOPED_TRACE(spec);
    std::unique_ptr<Model> m = MakeFp8BlockAligned(spec, 5);
    ASSERT_NE(m, nullptr);
    auto ref_engine = CpuEngine::Create(m.get(), 2);
    ASSERT_TRUE(ref_engine.ok()) << ref_engine.status();
    // Both engines dequantize the same codes and scales: what differs is
    // only the regrouping of fp32 sums, as for bf16 models.
    auto sharded = MakeSharded(*m, 2, MoeParallel::kExpert, 2);
    ASSERT_NE(sharded, nullptr);
    const Batch b = MakeBatch(m->config, 3);
    ExpectClose(RunFloat(**ref_engine, b), RunFloat(*sharded, b), b, m->config.hidden_size);
  }
}

// Every rank's FP8 part, dequantized, is exactly the same part of the
// dequantized whole: the codes and the scales were cut together.
TEST(ShardedCpuEngineTest, Fp8SlicesDequantizeToSlicesOfTheDequantizedWhole) {
  for (const char* spec : {"tiny-random", "tiny-random-moe"}) {
    SCOPED_TRACE(spec);
    std::unique_ptr<Model> m = MakeFp8BlockAligned(spec, 7);
    ASSERT_NE(m, nullptr);
    absl::StatusOr<std::unique_ptr<Model>> deq = DequantizedFp8Copy(*m);
    ASSERT_TRUE(deq.ok()) << deq.status();
    for (MoeParallel moe : {MoeParallel::kExpert, MoeParallel::kSplit}) {
      absl::StatusOr<ShardingPlan> plan = PlanTensorParallel(m->config, 2, moe);
      ASSERT_TRUE(plan.ok()) << plan.status();
      for (int rank = 0; rank < 2; ++rank) {
        absl::StatusOr<RankWeights> q = SliceForRank(*plan, *m, rank);
        absl::StatusOr<RankWeights> f = SliceForRank(*plan, **deq, rank);
        // Split experts at tp 2 are 64 wide: refused, naming the expert tensor.
        if (moe == MoeParallel::kSplit && m->config.num_experts > 0) {
          ASSERT_FALSE(q.ok());
          EXPECT_THAT(q.status().message(), HasSubstr("experts"));
          continue;
        }
        ASSERT_TRUE(q.ok()) << q.status();
        ASSERT_TRUE(f.ok()) << f.status();
        int fp8_tensors = 0;
        for (const WeightSpec& s : q->specs) {
          const Tensor& tq = WeightSlot(q->weights, s);
          if (!tq.fp8()) continue;
          ++fp8_tensors;
          EXPECT_EQ(ToFloat(tq), ToFloat(WeightSlot(f->weights, s))) << s.name << " rank " << rank;
        }
        EXPECT_GT(fp8_tensors, 0);
      }
    }
  }
}

TEST(ShardedCpuEngineTest, Fp8CutOffTheScaleBlocksIsRefusedNamingTheTensor) {
  // tp 4 cuts o_proj's 256 input columns into pieces of 64: half a block.
  std::unique_ptr<Model> m = MakeFp8BlockAligned("tiny-random-qwen3", 5);
  ASSERT_NE(m, nullptr);
  absl::StatusOr<ShardingPlan> plan = PlanTensorParallel(m->config, 4, MoeParallel::kExpert);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<std::unique_ptr<ShardedCpuEngine>> e =
      ShardedCpuEngine::Create(m.get(), *std::move(plan), 2);
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(e.status().message(), HasSubstr("FP8 weight layers."));
  EXPECT_THAT(e.status().message(), HasSubstr("off its 128x128 scale blocks"));
}

// tp 1 is the unsharded engine: the same views, the same sums, the same bits.
TEST(ShardedCpuEngineTest, TpOneIsBitExact) {
  for (const char* spec :
       {"tiny-random", "tiny-random-qwen3", "tiny-random-moe", "tiny-random-qwen3-moe"}) {
    SCOPED_TRACE(spec);
    auto m = Make(spec);
    auto ref_engine = CpuEngine::Create(m.get(), 2);
    ASSERT_TRUE(ref_engine.ok());
    auto one = MakeSharded(*m, 1, MoeParallel::kExpert, 2);
    ASSERT_NE(one, nullptr);
    const Batch b = MakeBatch(m->config, 5);
    EXPECT_EQ(RunFloat(*one, b), RunFloat(**ref_engine, b));
  }
}

TEST(ShardedCpuEngineTest, CapturesAreTheFloatsEncoded) {
  auto m = Make("tiny-random-moe");
  auto e = MakeSharded(*m, 2, MoeParallel::kExpert, 2);
  ASSERT_NE(e, nullptr);
  const Batch b = MakeBatch(m->config, 7);
  const std::vector<float> f = RunFloat(*e, b);
  std::vector<std::byte> out(f.size() * 2);
  ASSERT_TRUE(e->Forward({b.tokens, b.lens, b.layers}, out).ok());
  for (size_t i = 0; i < f.size(); ++i) {
    const uint16_t bits = static_cast<uint16_t>(static_cast<uint16_t>(out[2 * i]) |
                                                (static_cast<uint16_t>(out[2 * i + 1]) << 8));
    ASSERT_EQ(bits, FloatToBf16(f[i])) << i;
  }
  // fp8_e4m3 is the same states encoded.
  std::vector<std::byte> fp8(
      CaptureBytes(m->config, {b.tokens, b.lens, b.layers, CaptureEncoding::kFp8E4m3}));
  ASSERT_TRUE(e->Forward({b.tokens, b.lens, b.layers, CaptureEncoding::kFp8E4m3}, fp8).ok());
  std::vector<std::byte> expected(fp8.size());
  ASSERT_TRUE(EncodeFp8Capture(f, static_cast<int64_t>(b.tokens.size()),
                               static_cast<int64_t>(b.layers.size()), m->config.hidden_size,
                               expected)
                  .ok());
  EXPECT_EQ(fp8, expected);
  EXPECT_EQ(e->device_name(), "cpu tp2");
  const Engine::ParallelLayout l = e->layout();
  EXPECT_EQ(l.tp, 2);
  EXPECT_EQ(l.moe_parallel, "ep");
  EXPECT_EQ(l.rank_weight_bytes, RankWeightBytes(e->plan(), *m));
}

TEST(ShardedCpuEngineTest, RefusesBadInputAndDeviceWeights) {
  auto m = Make("tiny-random");
  auto e = MakeSharded(*m, 2, MoeParallel::kExpert, 2);
  ASSERT_NE(e, nullptr);
  std::vector<int32_t> tokens = {1, 2, 99999}, lens = {3}, layers = {0};
  std::vector<float> out(3 * 128);
  const absl::Status st = e->ForwardFloat({tokens, lens, layers}, out);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  auto real = Make("random:qwen3-8b");
  absl::StatusOr<ShardingPlan> plan = PlanTensorParallel(real->config, 2);
  ASSERT_TRUE(plan.ok());
  auto refused = ShardedCpuEngine::Create(real.get(), *std::move(plan), 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("--device cuda:N"));
}

}  // namespace
}  // namespace draftfeed
