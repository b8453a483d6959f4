// Chunked prefill on the CPU engines: a batch run in the forwards
// PlanForwardChunks cuts (each carrying the sequence it splits) equals the
// batch in one forward, bit for bit where the cuts fall on the GDN's 64-token
// chunks (the planner's cuts always do), for every model family and at tp 2;
// at awkward cuts (1 token in, inside the conv window, either side of a GDN
// chunk) within a tolerance for the hybrid models' delta rule and exactly
// for the others. The engine refuses chunked input it cannot resume.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "server/model/cpu_engine.h"
#include "server/model/model.h"
#include "server/model/sharded_cpu_engine.h"
#include "server/model/sharding_plan.h"
#include "server/service/forward_chunks.h"
#include "tests/server/service/test_tokens.h"

namespace draftfeed {
namespace {

using testing::RandomTokens;
using Lens = std::vector<int32_t>;

constexpr const char* kFamilies[] = {"tiny-random:0", "tiny-random-qwen3:0", "tiny-random-moe:0",
                                     "tiny-random-qwen3-moe:0"};

std::vector<int32_t> AllLayers(const ModelConfig& c) {
  std::vector<int32_t> layers;
  for (int32_t i = 0; i < c.num_layers; ++i) layers.push_back(i);
  layers.push_back(-1);
  return layers;
}

// Any engine with ForwardFloat (CpuEngine, ShardedCpuEngine).
template <typename E>
std::vector<float> OnePass(E& engine, const std::vector<int32_t>& tokens, const Lens& lens,
                           const std::vector<int32_t>& layers) {
  std::vector<float> out(tokens.size() * layers.size() *
                         static_cast<size_t>(engine.model().config.hidden_size));
  const absl::Status s = engine.ForwardFloat({tokens, lens, layers}, out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

// The batch in `chunks`, their captures joined in token order.
template <typename E>
std::vector<float> InChunks(E& engine, const std::vector<int32_t>& tokens,
                            const std::vector<ForwardChunk>& chunks,
                            const std::vector<int32_t>& layers) {
  const size_t row = layers.size() * static_cast<size_t>(engine.model().config.hidden_size);
  std::vector<float> out(tokens.size() * row);
  for (const ForwardChunk& c : chunks) {
    ForwardInput in{std::span<const int32_t>(tokens).subspan(static_cast<size_t>(c.token_begin),
                                                              static_cast<size_t>(c.tokens())),
                    c.seq_lens, layers};
    in.resume_tokens = c.resume_tokens;
    in.carry_last = c.carry_last;
    const absl::Status s = engine.ForwardFloat(
        in, std::span<float>(out).subspan(static_cast<size_t>(c.token_begin) * row,
                                          static_cast<size_t>(c.tokens()) * row));
    EXPECT_TRUE(s.ok()) << s;
  }
  return out;
}

// One sequence of `len` tokens cut at `cuts` (token counts from its start),
// each piece a forward of its own, with `before` and `after` tokens of other
// sequences packed in the first and last forwards.
std::vector<ForwardChunk> CutOne(int32_t before, int32_t len, int32_t after,
                                 const std::vector<int32_t>& cuts) {
  std::vector<ForwardChunk> chunks;
  int32_t done = 0;
  int64_t token = 0;
  std::vector<int32_t> ends = cuts;
  ends.push_back(len);
  for (size_t i = 0; i < ends.size(); ++i) {
    ForwardChunk c;
    c.token_begin = token;
    if (i == 0 && before > 0) c.seq_lens.push_back(before);
    c.seq_lens.push_back(ends[i] - done);
    if (i + 1 == ends.size() && after > 0) c.seq_lens.push_back(after);
    c.resume_tokens = done;
    c.carry_last = i + 1 < ends.size();
    for (int32_t l : c.seq_lens) token += l;
    c.token_end = token;
    done = ends[i];
    chunks.push_back(c);
  }
  return chunks;
}

double MaxRelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0, scale = 0;
  for (float w : want) scale = std::max(scale, static_cast<double>(std::fabs(w)));
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
  }
  return worst / std::max(scale, 1e-30);
}

// A CPU engine that carries sequences of up to 4,096 tokens.
std::unique_ptr<CpuEngine> CarryingEngine(const Model& model) {
  auto engine = *CpuEngine::Create(&model, 2);
  EXPECT_TRUE(engine->ReserveCarry(4096).ok());
  return engine;
}

TEST(ChunkedPrefill, PlannedChunksEqualOnePassBitForBit) {
  for (const char* spec : kFamilies) {
    SCOPED_TRACE(spec);
    auto model = *MakeRandomModel(spec);
    auto engine = CarryingEngine(*model);
    const ModelConfig& c = model->config;
    const Lens lens = {37, 700, 5, 130, 200};
    int64_t n = 0;
    for (int32_t l : lens) n += l;
    const auto tokens = RandomTokens(static_cast<int>(n), static_cast<int>(c.vocab_size), 11);
    const auto layers = AllLayers(c);
    const auto want = OnePass(*engine, tokens, lens, layers);
    for (int64_t budget : {64, 128, 200, 1000}) {
      SCOPED_TRACE(budget);
      const auto chunks = PlanForwardChunks(lens, budget);
      EXPECT_EQ(InChunks(*engine, tokens, chunks, layers), want);
    }
  }
}

TEST(ChunkedPrefill, ShardedEngineCarriesEachRanksShare) {
  auto model = *MakeRandomModel("tiny-random:0");
  auto plan = PlanTensorParallel(model->config, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto engine = ShardedCpuEngine::Create(model.get(), *plan, 2);
  ASSERT_TRUE(engine.ok()) << engine.status();
  ASSERT_TRUE((*engine)->ReserveCarry(1024).ok());
  const Lens lens = {10, 500, 9};
  const auto tokens = RandomTokens(519, static_cast<int>(model->config.vocab_size), 3);
  const auto layers = AllLayers(model->config);
  EXPECT_EQ(InChunks(**engine, tokens, PlanForwardChunks(lens, 128), layers),
            OnePass(**engine, tokens, lens, layers));
}

TEST(ChunkedPrefill, AwkwardCutsStayWithinTheDeltaRulesRounding) {
  // 1 and 2 tokens in (the conv window of 4 reaches back over both cuts), 63
  // and 65 (either side of a GDN chunk edge), 64 and 128 (on it), 200.
  const std::vector<std::vector<int32_t>> cut_sets = {{1, 2}, {3, 63}, {65}, {64, 128}, {200, 201}};
  for (const char* spec : kFamilies) {
    SCOPED_TRACE(spec);
    auto model = *MakeRandomModel(spec);
    auto engine = CarryingEngine(*model);
    const ModelConfig& c = model->config;
    const bool has_gdn = std::count(c.layer_types.begin(), c.layer_types.end(),
                                    LayerKind::kLinearAttention) > 0;
    const Lens lens = {9, 300, 7};
    const auto tokens = RandomTokens(316, static_cast<int>(c.vocab_size), 5);
    const auto layers = AllLayers(c);
    const auto want = OnePass(*engine, tokens, lens, layers);
    for (const auto& cuts : cut_sets) {
      SCOPED_TRACE(::testing::Message() << "cut at " << cuts[0]);
      const auto got = InChunks(*engine, tokens, CutOne(9, 300, 7, cuts), layers);
      const bool aligned = std::all_of(cuts.begin(), cuts.end(), [](int32_t x) { return x % 64 == 0; });
      if (!has_gdn || aligned) {
        EXPECT_EQ(got, want);  // attention, conv and MLPs are the same sums in the same order
      } else {
        // A cut off a 64-token edge regroups the delta rule's chunks: the
        // same recurrence in fp32, evaluated in a different order, so
        // differences are fp32 roundings (~1e-7 relative) grown through the
        // layers; 1e-4 of the largest state leaves room for that and none
        // for a wrong state (a dropped carry is O(1)).
        EXPECT_LT(MaxRelativeError(got, want), 1e-4);
        EXPECT_NE(got, want) << "an unaligned cut changed nothing: is the carry in use?";
      }
    }
  }
}

TEST(ChunkedPrefill, EngineRefusesChunksItCannotResume) {
  auto model = *MakeRandomModel("tiny-random:0");
  auto engine = *CpuEngine::Create(model.get(), 1);
  const auto tokens = RandomTokens(100, 4096, 1);
  const std::vector<int32_t> layers = {0};
  const Lens lens = {100};
  std::vector<float> out(100 * 128);
  ForwardInput in{tokens, lens, layers};
  in.carry_last = true;
  absl::Status s = engine->ForwardFloat(in, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("carries no sequence"), std::string::npos) << s;

  ASSERT_TRUE(engine->ReserveCarry(150).ok());
  ASSERT_TRUE(engine->ForwardFloat(in, out).ok());
  in.resume_tokens = 64;  // it carries 100
  s = engine->ForwardFloat(in, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("resumes a sequence 64 tokens in, but the CPU engine carries 100"),
            std::string::npos)
      << s;
  in.resume_tokens = 100;  // 100 + 100 is over the 150 reserved
  s = engine->ForwardFloat(in, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("200 tokens is over the 150"), std::string::npos) << s;

  engine->DropCarry();  // the stream went away mid-sequence
  in.resume_tokens = 100;
  in.carry_last = false;
  s = engine->ForwardFloat(in, out);
  EXPECT_NE(s.message().find("carries 0"), std::string::npos) << s;
}

}  // namespace
}  // namespace draftfeed
