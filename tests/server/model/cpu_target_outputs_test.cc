// The CPU engines' target outputs: each token's argmax, top-k and draft-vocabulary softmax
// after its hidden states in its row, against the same quantities computed here in double
// from the engine's own fp32 final-norm state and the model's lm_head. The engine's logits
// are fp32 sums of H products (|error| ~ 1e-6 of Σ|x·w| here), so ids are compared where the
// reference's gaps exceed 1e-4 and values within a few fp32 roundings of the encoded output.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include <gtest/gtest.h>

#include "common/fp8_e4m3.h"
#include "common/target_outputs.h"
#include "server/model/cpu_engine.h"
#include "server/model/sharded_cpu_engine.h"
#include "server/model/sharding_plan.h"
#include "server/model/tensor.h"
#include "tests/test_data_dir.h"

namespace draftfeed {
namespace {

struct Reference {
  std::vector<double> logits;  // [T, V]
  int64_t vocab = 0;
};

Reference Logits(const Model& m, const std::vector<float>& final_states) {
  const int64_t d = m.config.hidden_size, v = m.config.vocab_size;
  const std::vector<float> head = ToFloat(m.weights.lm_head);
  const auto t_count = static_cast<int64_t>(final_states.size()) / d;
  Reference r{std::vector<double>(static_cast<size_t>(t_count * v)), v};
  for (int64_t t = 0; t < t_count; ++t) {
    for (int64_t i = 0; i < v; ++i) {
      double s = 0;
      for (int64_t k = 0; k < d; ++k) s += double(final_states[t * d + k]) * head[i * d + k];
      r.logits[t * v + i] = s;
    }
  }
  return r;
}

template <typename T>
T Read(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

float Bf16(uint16_t bits) {
  const uint32_t wide = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

struct Case {
  std::vector<int32_t> tokens, lens;
};

Case MakeCase(const ModelConfig& c, std::vector<int32_t> lens, uint64_t seed) {
  Case k{{}, std::move(lens)};
  std::mt19937_64 rng(seed);
  const int total = std::accumulate(k.lens.begin(), k.lens.end(), 0);
  for (int i = 0; i < total; ++i) k.tokens.push_back(int32_t(rng() % uint64_t(c.vocab_size)));
  return k;
}

std::vector<int32_t> ShuffledIds(int64_t vocab, int64_t n, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(seed));
  ids.resize(static_cast<size_t>(n));
  return ids;
}

std::vector<std::byte> Rows(Engine& e, const Case& k, std::vector<int32_t> layers,
                            const TargetOutputs* outputs,
                            CaptureEncoding enc = CaptureEncoding::kBf16) {
  ForwardInput in{k.tokens, k.lens, layers, enc};
  in.outputs = outputs;
  std::vector<std::byte> out(CaptureBytes(e.model().config, in));
  const absl::Status st = e.Forward(in, out);
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// Checks every token's outputs in `rows` (the hidden states take `hidden` bytes of each).
void ExpectOutputs(const Reference& ref, const TargetOutputs& o, const std::vector<std::byte>& rows,
                   int64_t hidden) {
  const TargetOutputsLayout l = LayoutOf(o);
  const int64_t row = hidden + l.bytes, v = ref.vocab;
  const auto tokens = static_cast<int64_t>(rows.size()) / row;
  ASSERT_EQ(tokens * row, static_cast<int64_t>(rows.size()));
  int64_t checked_argmax = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const double* lg = ref.logits.data() + t * v;
    const std::byte* out = rows.data() + t * row + hidden;
    std::vector<int32_t> order(static_cast<size_t>(v));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [lg](int32_t a, int32_t b) { return lg[a] > lg[b]; });
    if (o.argmax && lg[order[0]] - lg[order[1]] > 1e-4) {
      EXPECT_EQ(Read<int32_t>(out + l.argmax), order[0]) << "token " << t;
      ++checked_argmax;
    }
    if (o.top_k > 0) {
      const double m = lg[order[0]];
      double sum = 0;
      for (int64_t i = 0; i < v; ++i) sum += std::exp(lg[i] - m);
      const double lse = m + std::log(sum);
      for (int32_t i = 0; i < o.top_k; ++i) {
        const auto id = Read<int32_t>(out + l.top_k_ids + 4 * i);
        if (lg[order[i]] - lg[order[i + 1]] > 1e-4 &&
            (i == 0 || lg[order[i - 1]] - lg[order[i]] > 1e-4)) {
          EXPECT_EQ(id, order[i]) << "token " << t << " rank " << i;
        }
        ASSERT_GE(id, 0);
        ASSERT_LT(id, v);
        EXPECT_NEAR(Read<float>(out + l.top_k_logprobs + 4 * i), lg[id] - lse, 1e-4);
      }
    }
    if (!o.draft_vocab.empty()) {
      double md = -INFINITY;
      for (int32_t id : o.draft_vocab) md = std::max(md, lg[id]);
      double sum = 0;
      for (int32_t id : o.draft_vocab) sum += std::exp(lg[id] - md);
      const bool fp8 = o.probs_encoding == CaptureEncoding::kFp8E4m3;
      const float scale = fp8 ? Read<float>(out + l.probs_scale) : 1.0f;
      for (size_t j = 0; j < o.draft_vocab.size(); ++j) {
        const double p = std::exp(lg[o.draft_vocab[j]] - md) / sum;
        const double got =
            fp8 ? double(E4m3ToFloat(Read<uint8_t>(out + l.probs + int64_t(j)))) * scale
                : Bf16(Read<uint16_t>(out + l.probs + 2 * int64_t(j)));
        // bf16: half an ulp (2^-9 relative); e4m3: half a step (2^-4 relative, or 2^-10 of
        // the scale below the normals); each plus the fp32 softmax's own rounding.
        const double bound = fp8 ? std::max(p / 16, scale * std::ldexp(1.0, -10)) + 1e-6 * p
                                 : p * std::ldexp(1.0, -8) + 1e-9;
        EXPECT_NEAR(got, p, bound) << "token " << t << " column " << j;
      }
    }
  }
  if (o.argmax) {
    EXPECT_GT(checked_argmax, tokens / 2);
  }
}

class CpuTargetOutputs : public ::testing::TestWithParam<std::string> {};

TEST_P(CpuTargetOutputs, MatchLmHeadOfTheFinalState) {
  auto model = OpenModel(GetParam());
  ASSERT_TRUE(model.ok()) << model.status();
  const Model& m = **model;
  auto engine = CpuEngine::Create(&m, 2);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_TRUE((*engine)->serves_target_outputs());
  const Case k = MakeCase(m.config, {1, 40, 23}, 11);
  std::vector<float> final_states(k.tokens.size() * size_t(m.config.hidden_size));
  const std::vector<int32_t> final_layer = {kFinalLayerId};
  ASSERT_TRUE((*engine)->ForwardFloat({k.tokens, k.lens, final_layer}, final_states).ok());
  const Reference ref = Logits(m, final_states);
  const int64_t vocab = m.config.vocab_size;
  const std::vector<int32_t> layers = {1, kFinalLayerId};
  const std::vector<std::byte> plain = Rows(**engine, k, layers, nullptr);
  const int64_t hidden = 2 * 2 * m.config.hidden_size;
  for (CaptureEncoding probs : {CaptureEncoding::kBf16, CaptureEncoding::kFp8E4m3}) {
    const TargetOutputs o{.argmax = true,
                          .top_k = 7,
                          .draft_vocab = ShuffledIds(vocab, std::min<int64_t>(vocab, 97), 3),
                          .probs_encoding = probs};
    const std::vector<std::byte> rows = Rows(**engine, k, layers, &o);
    ExpectOutputs(ref, o, rows, hidden);
    // The hidden states are the hidden-only run's, byte for byte.
    for (size_t t = 0; t < k.tokens.size(); ++t) {
      ASSERT_EQ(std::memcmp(rows.data() + t * (hidden + LayoutOf(o).bytes),
                            plain.data() + t * hidden, size_t(hidden)),
                0)
          << "token " << t;
    }
    // Outputs alone (no layers) are the same bytes as beside the layers.
    const std::vector<std::byte> alone = Rows(**engine, k, {}, &o);
    for (size_t t = 0; t < k.tokens.size(); ++t) {
      ASSERT_EQ(std::memcmp(alone.data() + t * LayoutOf(o).bytes,
                            rows.data() + t * (hidden + LayoutOf(o).bytes) + hidden,
                            size_t(LayoutOf(o).bytes)),
                0);
    }
  }
  // fp8 hidden states with outputs after them.
  const TargetOutputs o{.top_k = 3};
  const std::vector<std::byte> fp8 = Rows(**engine, k, layers, &o, CaptureEncoding::kFp8E4m3);
  const std::vector<std::byte> fp8_plain =
      Rows(**engine, k, layers, nullptr, CaptureEncoding::kFp8E4m3);
  const int64_t fp8_hidden =
      CaptureBytesPerToken(CaptureEncoding::kFp8E4m3, 2, m.config.hidden_size);
  for (size_t t = 0; t < k.tokens.size(); ++t) {
    ASSERT_EQ(std::memcmp(fp8.data() + t * (fp8_hidden + 24), fp8_plain.data() + t * fp8_hidden,
                          size_t(fp8_hidden)),
              0);
  }
  ExpectOutputs(ref, o, fp8, fp8_hidden);
}

INSTANTIATE_TEST_SUITE_P(
    Models, CpuTargetOutputs,
    ::testing::Values("tiny-random", "tiny-random-qwen3", "tiny-random-moe",
                      "tiny-random-qwen3-moe",
                      (testing::TestDataDir() / "models/qwen3").string(),  // tied lm_head
                      (testing::TestDataDir() / "models/qwen35_text_fp8").string(),
                      (testing::TestDataDir() / "models/qwen3_moe_fp8").string()));

TEST(CpuTargetOutputsTest, ASequenceGetsTheSameBitsAloneAndPacked) {
  auto model = OpenModel("tiny-random:3");
  ASSERT_TRUE(model.ok());
  auto engine = CpuEngine::Create(model->get(), 2);
  ASSERT_TRUE(engine.ok());
  const TargetOutputs o{.argmax = true, .top_k = 4, .draft_vocab = ShuffledIds(4096, 300, 1)};
  const Case packed = MakeCase((*model)->config, {30, 50, 20}, 5);
  const Case alone{{packed.tokens.begin() + 30, packed.tokens.begin() + 80}, {50}};
  const std::vector<std::byte> a = Rows(**engine, alone, {2}, &o);
  const std::vector<std::byte> p = Rows(**engine, packed, {2}, &o);
  const size_t row = a.size() / 50;
  EXPECT_EQ(std::memcmp(a.data(), p.data() + 30 * row, a.size()), 0);
}

TEST(CpuTargetOutputsTest, ShardedEngineAgrees) {
  auto model = OpenModel("tiny-random:2");
  ASSERT_TRUE(model.ok());
  const Model& m = **model;
  auto whole = CpuEngine::Create(&m, 2);
  auto plan = PlanTensorParallel(m.config, 2);
  ASSERT_TRUE(whole.ok() && plan.ok());
  auto sharded = ShardedCpuEngine::Create(&m, *std::move(plan), 2);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  EXPECT_TRUE((*sharded)->serves_target_outputs());
  const Case k = MakeCase(m.config, {33, 7}, 9);
  std::vector<float> final_states(k.tokens.size() * size_t(m.config.hidden_size));
  const std::vector<int32_t> final_layer = {kFinalLayerId};
  ASSERT_TRUE((*whole)->ForwardFloat({k.tokens, k.lens, final_layer}, final_states).ok());
  const TargetOutputs o{.argmax = true, .top_k = 5, .draft_vocab = ShuffledIds(4096, 64, 8)};
  ExpectOutputs(Logits(m, final_states), o, Rows(**sharded, k, {0}, &o), 2 * m.config.hidden_size);
}

TEST(CpuTargetOutputsTest, AModelWithoutLmHeadRefusesThem) {
  auto model = OpenModel("tiny-random:1");
  ASSERT_TRUE(model.ok());
  (*model)->weights.lm_head = Tensor{};
  auto engine = CpuEngine::Create(model->get(), 1);
  ASSERT_TRUE(engine.ok());
  EXPECT_FALSE((*engine)->serves_target_outputs());
  const TargetOutputs o{.argmax = true};
  const Case k = MakeCase((*model)->config, {4}, 1);
  ForwardInput in{k.tokens, k.lens, {}};
  in.outputs = &o;
  std::vector<std::byte> out(CaptureBytes((*model)->config, in));
  const absl::Status st = (*engine)->Forward(in, out);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("no lm_head"), std::string::npos) << st;
}

TEST(CpuTargetOutputsTest, BadRequestsNameTheField) {
  auto model = OpenModel("tiny-random:1");
  ASSERT_TRUE(model.ok());
  auto engine = CpuEngine::Create(model->get(), 1);
  ASSERT_TRUE(engine.ok());
  const Case k = MakeCase((*model)->config, {4}, 1);
  for (const auto& [o, want] : std::vector<std::pair<TargetOutputs, std::string>>{
           {{.top_k = 300}, "top_k is 300"},
           {{.draft_vocab = {1, 4096}}, "draft_vocab[1] is 4096"},
           {{.draft_vocab = {7, 7}}, "lists id 7 twice"}}) {
    ForwardInput in{k.tokens, k.lens, {}};
    in.outputs = &o;
    std::vector<std::byte> out(k.tokens.size() * 4);
    const absl::Status st = (*engine)->Forward(in, out);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find(want), std::string::npos) << st;
  }
}

}  // namespace
}  // namespace draftfeed
