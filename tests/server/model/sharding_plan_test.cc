#include "server/model/sharding_plan.h"

#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/model.h"

namespace draftfeed {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Model> Make(const std::string& spec) {
  absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(spec);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

ShardingPlan Plan(const ModelConfig& c, int tp, MoeParallel moe = MoeParallel::kExpert) {
  absl::StatusOr<ShardingPlan> p = PlanTensorParallel(c, tp, moe);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : ShardingPlan{};
}

std::string Refusal(const ModelConfig& c, int tp, MoeParallel moe = MoeParallel::kExpert) {
  absl::StatusOr<ShardingPlan> p = PlanTensorParallel(c, tp, moe);
  EXPECT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(p.status().message());
}

const TensorSlicing& Find(const ShardingPlan& plan, const std::string& name) {
  for (const TensorSlicing& t : plan.tensors) {
    if (t.spec.name == name) return t;
  }
  ADD_FAILURE() << name << " is not in the plan";
  return plan.tensors.front();
}

TEST(ShardingPlanTest, RefusesTpBelowOne) {
  auto m = Make("tiny-random");
  EXPECT_EQ(Refusal(m->config, 0), "--tp 0 must be >= 1");
  EXPECT_EQ(Refusal(m->config, -2), "--tp -2 must be >= 1");
}

TEST(ShardingPlanTest, RefusalNamesEveryCountTpDoesNotDivide) {
  // tiny-random: 4 query heads, 2 KV heads, 2 GDN key heads, 4 value heads,
  // F = 256. KV and key heads may be shared by ranks (tp a multiple of them).
  auto hybrid = Make("tiny-random");
  EXPECT_TRUE(PlanTensorParallel(hybrid->config, 4).ok());
  EXPECT_EQ(Refusal(hybrid->config, 3),
            "--tp 3 does not divide num_attention_heads=4, num_key_value_heads=2, "
            "linear_num_key_heads=2, linear_num_value_heads=4, intermediate_size=256 (--tp values "
            "this model takes: 1, 2, 4)");
  EXPECT_EQ(Refusal(hybrid->config, 8),
            "--tp 8 does not divide num_attention_heads=4, linear_num_value_heads=4 (--tp values "
            "this model takes: 1, 2, 4)");
  // Qwen3 has no GDN layers: their counts are not asked about.
  ModelConfig dense = Make("tiny-random-qwen3")->config;
  dense.num_heads = 6;
  dense.num_kv_heads = 3;
  dense.intermediate_size = 192;
  EXPECT_EQ(Refusal(dense, 4),
            "--tp 4 does not divide num_attention_heads=6, num_key_value_heads=3 (--tp values this "
            "model takes: 1, 3, 6)");
}

TEST(ShardingPlanTest, MoeRefusalsFollowTheStrategy) {
  // tiny-random-moe: 8 experts of width 64, a shared expert of width 64, no dense MLP.
  ModelConfig c = Make("tiny-random-moe")->config;
  c.num_kv_heads = 4;
  c.linear_num_key_heads = 4;
  c.linear_num_value_heads = 8;
  c.num_experts = 6;
  EXPECT_EQ(Refusal(c, 4),
            "--tp 4 does not divide num_experts=6 (--tp values this model takes: 1, 2)");
  EXPECT_TRUE(PlanTensorParallel(c, 4, MoeParallel::kSplit).ok());
  c.moe_intermediate_size = 90;
  c.shared_expert_intermediate_size = 48;
  EXPECT_EQ(Refusal(c, 4, MoeParallel::kSplit),
            "--tp 4 does not divide moe_intermediate_size=90 (--moe_parallel split) (--tp values "
            "this model takes: 1, 2)");
  EXPECT_EQ(Refusal(c, 8, MoeParallel::kSplit),
            "--tp 8 does not divide num_attention_heads=4, moe_intermediate_size=90 "
            "(--moe_parallel split) (--tp values this model takes: 1, 2)");
}

TEST(ShardingPlanTest, ParsesTheMoeFlag) {
  EXPECT_EQ(*ParseMoeParallel("ep"), MoeParallel::kExpert);
  EXPECT_EQ(*ParseMoeParallel("split"), MoeParallel::kSplit);
  absl::StatusOr<MoeParallel> bad = ParseMoeParallel("tp");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "--moe_parallel=tp is not ep (experts spread over the ranks) or split (every expert "
            "cut)");
}

TEST(ShardingPlanTest, TpOneIsTheIdentity) {
  auto m = Make("tiny-random-moe");
  const ShardingPlan p = Plan(m->config, 1);
  EXPECT_TRUE(p.all_reduces.empty());
  EXPECT_EQ(p.rank_config.ToJson(), m->config.ToJson());
  for (const TensorSlicing& t : p.tensors) EXPECT_EQ(t.RankShape(1), t.spec.shape) << t.spec.name;
  EXPECT_EQ(p.RankWeightBytes(2), p.WholeWeightBytes(2));
}

TEST(ShardingPlanTest, RulesOfEachTensorKind) {
  auto m = Make("tiny-random");  // layers 0-2 GDN, layer 3 full attention
  const ShardingPlan p = Plan(m->config, 2);
  EXPECT_EQ(p.rank_config.num_heads, 2);
  EXPECT_EQ(p.rank_config.num_kv_heads, 1);
  EXPECT_EQ(p.rank_config.linear_num_key_heads, 1);
  EXPECT_EQ(p.rank_config.linear_num_value_heads, 2);
  EXPECT_EQ(p.rank_config.intermediate_size, 128);
  // Gated q_proj: [4 heads x (64 q + 64 gate), 128] -> two heads' blocks.
  EXPECT_EQ(Find(p, "layers.3.self_attn.q_proj.weight").RankShape(2),
            (std::vector<int64_t>{256, 128}));
  EXPECT_TRUE(Find(p, "layers.3.self_attn.q_proj.weight").Contiguous());
  EXPECT_EQ(Find(p, "layers.3.self_attn.o_proj.weight").RankShape(2),
            (std::vector<int64_t>{128, 128}));
  EXPECT_FALSE(Find(p, "layers.3.self_attn.o_proj.weight").Contiguous());
  EXPECT_TRUE(Find(p, "layers.3.self_attn.q_norm.weight").replicated);
  // GDN q | k | v = 64 | 64 | 128 channels, each segment halved.
  const TensorSlicing& qkv = Find(p, "layers.0.linear_attn.in_proj_qkv.weight");
  EXPECT_EQ(qkv.segments, (std::vector<int64_t>{64, 64, 128}));
  EXPECT_EQ(qkv.RankShape(2), (std::vector<int64_t>{128, 128}));
  EXPECT_FALSE(qkv.Contiguous());
  EXPECT_EQ(Find(p, "layers.0.linear_attn.conv1d.weight").segments,
            (std::vector<int64_t>{64, 64, 128}));
  EXPECT_EQ(Find(p, "layers.0.linear_attn.A_log").RankShape(2), (std::vector<int64_t>{2}));
  EXPECT_TRUE(Find(p, "layers.0.linear_attn.norm.weight").replicated);
  EXPECT_EQ(Find(p, "layers.0.linear_attn.out_proj.weight").axis, 1);
  EXPECT_EQ(Find(p, "layers.0.mlp.down_proj.weight").RankShape(2),
            (std::vector<int64_t>{128, 128}));
  EXPECT_TRUE(Find(p, "embed_tokens.weight").replicated);
  EXPECT_TRUE(Find(p, "layers.0.input_layernorm.weight").replicated);
  // Two all-reduces per layer: after the mixer and after the MLP.
  ASSERT_EQ(p.all_reduces.size(), 8u);
  EXPECT_EQ(p.all_reduces[0].after, "linear_attn.out_proj");
  EXPECT_EQ(p.all_reduces[1].after, "mlp.down_proj");
  EXPECT_EQ(p.all_reduces[6].after, "self_attn.o_proj");
  EXPECT_EQ(p.capture_rank, 0);
}

TEST(ShardingPlanTest, RanksBeyondTheKvHeadsShareThem) {
  auto m = Make("tiny-random");  // 4 query heads on 2 KV heads; 4 GDN value heads on 2 key heads
  const ShardingPlan p = Plan(m->config, 4);
  EXPECT_EQ(p.rank_config.num_heads, 1);
  EXPECT_EQ(p.rank_config.num_kv_heads, 1);
  EXPECT_EQ(p.rank_config.linear_num_key_heads, 1);
  EXPECT_EQ(p.rank_config.linear_num_value_heads, 1);
  const TensorSlicing& k = Find(p, "layers.3.self_attn.k_proj.weight");
  EXPECT_EQ(k.RankShape(4), (std::vector<int64_t>{64, 128}));
  EXPECT_EQ(k.rule, "rows (each KV head on 2 ranks)");
  // Query heads 0, 1 read KV head 0 and 2, 3 KV head 1: ranks 0, 1 hold head 0.
  EXPECT_EQ(k.PartOf(0, 0, 4), 0);
  EXPECT_EQ(k.PartOf(1, 0, 4), 0);
  EXPECT_EQ(k.PartOf(2, 0, 4), 1);
  EXPECT_EQ(k.PartOf(3, 0, 4), 1);
  const TensorSlicing& qkv = Find(p, "layers.0.linear_attn.in_proj_qkv.weight");
  EXPECT_EQ(qkv.parts, (std::vector<int64_t>{2, 2, 4}));
  EXPECT_EQ(qkv.RankShape(4), (std::vector<int64_t>{32 + 32 + 32, 128}));
}

TEST(ShardingPlanTest, MoeStrategiesCutExpertsOrTheirWidth) {
  auto m = Make("tiny-random-moe");
  const ShardingPlan ep = Plan(m->config, 2, MoeParallel::kExpert);
  EXPECT_EQ(ep.experts_per_rank, 4);
  EXPECT_EQ(ep.ExpertBegin(1), 4);
  EXPECT_EQ(ep.rank_config.num_experts, 8);  // the router scores all of them
  EXPECT_EQ(ep.rank_config.moe_intermediate_size, 64);
  EXPECT_EQ(ep.rank_config.shared_expert_intermediate_size, 32);
  EXPECT_EQ(Find(ep, "layers.0.mlp.experts.gate_up_proj").RankShape(2),
            (std::vector<int64_t>{4, 128, 128}));
  EXPECT_TRUE(Find(ep, "layers.0.mlp.experts.gate_up_proj").Contiguous());
  EXPECT_TRUE(Find(ep, "layers.0.mlp.gate.weight").replicated);
  EXPECT_TRUE(Find(ep, "layers.0.mlp.shared_expert_gate.weight").replicated);
  EXPECT_EQ(Find(ep, "layers.0.mlp.shared_expert.down_proj.weight").RankShape(2),
            (std::vector<int64_t>{128, 32}));
  EXPECT_EQ(ep.all_reduces[1].after, "mlp (experts + shared expert)");

  const ShardingPlan split = Plan(m->config, 2, MoeParallel::kSplit);
  EXPECT_EQ(split.experts_per_rank, 8);
  EXPECT_EQ(split.ExpertBegin(1), 0);
  EXPECT_EQ(split.rank_config.moe_intermediate_size, 32);
  const TensorSlicing& gu = Find(split, "layers.0.mlp.experts.gate_up_proj");
  EXPECT_EQ(gu.axis, 1);
  EXPECT_EQ(gu.segments, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(gu.RankShape(2), (std::vector<int64_t>{8, 64, 128}));
  EXPECT_EQ(Find(split, "layers.0.mlp.experts.down_proj").RankShape(2),
            (std::vector<int64_t>{8, 128, 32}));
}

TEST(ShardingPlanTest, RefusesATensorThatDeclaresNoCut) {
  // A tensor added to weight_layout.cc without saying how it is cut: the
  // plan used to keep anything it did not recognise whole on every rank.
  WeightSpec spec;
  spec.name = "layers.2.mlp.mystery_proj.weight";
  spec.shape = {8, 16};
  spec.layer = 2;
  spec.member = &LayerWeights::gate_proj;
  for (int tp : {1, 2}) {
    absl::StatusOr<TensorSlicing> t = SliceTensor(spec, tp, MoeParallel::kExpert);
    ASSERT_FALSE(t.ok()) << "tp " << tp;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(t.status().message(),
              "weight layers.2.mlp.mystery_proj.weight [8, 16] declares no tensor-parallel cut "
              "(its WeightSpec's tp_cut is undeclared; every tensor says column, row, "
              "segmented, replicated or expert where weight_layout.cc makes it)");
  }
  // Declared, the same spec is cut as it says.
  spec.tp_cut.kind = TpCut::kColumn;
  absl::StatusOr<TensorSlicing> rows = SliceTensor(spec, 2, MoeParallel::kExpert);
  ASSERT_TRUE(rows.ok()) << rows.status();
  EXPECT_EQ(rows->RankShape(2), (std::vector<int64_t>{4, 16}));
  spec.tp_cut.kind = TpCut::kRow;
  absl::StatusOr<TensorSlicing> cols = SliceTensor(spec, 2, MoeParallel::kExpert);
  ASSERT_TRUE(cols.ok()) << cols.status();
  EXPECT_EQ(cols->RankShape(2), (std::vector<int64_t>{8, 8}));
}

TEST(ShardingPlanTest, RefusesADeclaredCutThatDoesNotFitTheTensor) {
  WeightSpec spec;
  spec.name = "layers.0.linear_attn.in_proj_qkv.weight";
  spec.shape = {96, 16};
  spec.layer = 0;
  spec.tp_cut = {.kind = TpCut::kSegmented, .segments = {{32, 0}, {32, 0}}};
  absl::StatusOr<TensorSlicing> t = SliceTensor(spec, 2, MoeParallel::kExpert);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().message(),
            "weight layers.0.linear_attn.in_proj_qkv.weight [96, 16] declares segments [32, 32] "
            "summing to 64, not its axis 0 (96)");
  spec.tp_cut.segments = {{32, 0}, {32, 0}, {32, 0}};
  t = SliceTensor(spec, 3, MoeParallel::kExpert);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("declares a segment of 32 along axis 0, which --tp 3"
                                              " does not cut into 3 equal parts"));
  // An expert tensor must say how split cuts each expert, even under ep.
  spec.tp_cut = {.kind = TpCut::kExpert};
  t = SliceTensor(spec, 2, MoeParallel::kExpert);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(t.status().message(), HasSubstr("per-expert cut is undeclared"));
}

TEST(ShardingPlanTest, EveryBuiltinTensorDeclaresItsCut) {
  int shapes = 0;
  for (const BuiltinModel& b : BuiltinModels()) {
    // "tiny-random[:SEED]"; the FP8 entry ("NAME-fp8[:SEED]") is a variant of the others.
    const std::string spec_name = b.spec.substr(0, b.spec.find('['));
    if (spec_name.rfind("NAME", 0) == 0) continue;
    absl::StatusOr<std::unique_ptr<Model>> m = MakeRandomModel(spec_name);
    ASSERT_TRUE(m.ok()) << b.spec << ": " << m.status();
    ++shapes;
    std::vector<WeightSpec> specs = DecoderWeightSpecs((*m)->config);
    specs.push_back(LmHeadSpec((*m)->config));
    for (const WeightSpec& spec : specs) {
      EXPECT_NE(spec.tp_cut.kind, TpCut::kUndeclared) << b.spec << ": " << spec.name;
    }
  }
  EXPECT_GE(shapes, 10);  // the table's shapes, dense, hybrid and MoE
}

// The whole tensor's flat index of element `local` of rank `rank`'s part,
// worked out from the rule independently of SliceForRank's gather.
int64_t WholeIndex(const TensorSlicing& t, int tp, int rank, int64_t local) {
  const std::vector<int64_t> part = t.RankShape(tp);
  std::vector<int64_t> idx(part.size());
  for (size_t a = part.size(); a-- > 0;) {
    idx[a] = local % part[a];
    local /= part[a];
  }
  if (!t.replicated) {
    int64_t x = idx[static_cast<size_t>(t.axis)], seg_begin = 0, cum = 0;
    for (size_t i = 0; i < t.segments.size(); ++i) {
      const int64_t n = t.segments[i] / t.parts[i];
      const int64_t part = rank / (tp / t.parts[i]);  // ranks share a part in runs
      if (x < cum + n) {
        idx[static_cast<size_t>(t.axis)] = seg_begin + part * n + (x - cum);
        break;
      }
      cum += n;
      seg_begin += t.segments[i];
    }
  }
  int64_t flat = 0;
  for (size_t a = 0; a < idx.size(); ++a) flat = flat * t.spec.shape[a] + idx[a];
  return flat;
}

// How many ranks hold whole-tensor element `flat`: tp for a replicated
// tensor, tp / parts of its segment otherwise.
int Holders(const TensorSlicing& t, int tp, int64_t flat) {
  if (t.replicated) return tp;
  int64_t inner = 1;
  for (size_t a = static_cast<size_t>(t.axis) + 1; a < t.spec.shape.size(); ++a) {
    inner *= t.spec.shape[a];
  }
  int64_t x = (flat / inner) % t.spec.shape[static_cast<size_t>(t.axis)];
  for (size_t i = 0; i < t.segments.size(); ++i) {
    if (x < t.segments[i]) return static_cast<int>(tp / t.parts[i]);
    x -= t.segments[i];
  }
  return 0;
}

// Every rank's part is what the rule says, and the parts tile their tensor:
// each element held once, or by every rank sharing its head.
void CheckSlices(const Model& m, int tp, MoeParallel moe) {
  const ShardingPlan p = Plan(m.config, tp, moe);
  std::vector<RankWeights> ranks;
  for (int r = 0; r < tp; ++r) {
    absl::StatusOr<RankWeights> w = SliceForRank(p, m, r);
    ASSERT_TRUE(w.ok()) << w.status();
    ranks.push_back(*std::move(w));
  }
  for (const TensorSlicing& t : p.tensors) {
    const Tensor& whole = WeightSlot(m.weights, t.spec);
    const size_t elem = DTypeSize(whole.dtype);
    std::vector<int> covered(static_cast<size_t>(t.spec.numel()), 0);
    for (int r = 0; r < tp; ++r) {
      const Tensor& part = WeightSlot(ranks[static_cast<size_t>(r)].weights, t.spec);
      ASSERT_EQ(part.shape, t.RankShape(tp)) << t.spec.name;
      ASSERT_EQ(part.dtype, whole.dtype);
      // Contiguous parts are views into the model's storage.
      if (t.Contiguous()) {
        EXPECT_GE(part.data, whole.data) << t.spec.name;
        EXPECT_LT(part.data, whole.data + whole.nbytes()) << t.spec.name;
      }
      for (int64_t i = 0; i < part.numel(); ++i) {
        const int64_t w = WholeIndex(t, tp, r, i);
        ASSERT_EQ(std::memcmp(part.data + i * elem, whole.data + w * elem, elem), 0)
            << t.spec.name << " rank " << r << " element " << i;
        ++covered[static_cast<size_t>(w)];
      }
    }
    for (int64_t w = 0; w < t.spec.numel(); ++w) {
      ASSERT_EQ(covered[static_cast<size_t>(w)], Holders(t, tp, w)) << t.spec.name << " " << w;
    }
  }
}

TEST(ShardingPlanTest, SlicesAreTheRuleAndTileEachTensor) {
  for (const char* spec :
       {"tiny-random", "tiny-random-qwen3", "tiny-random-moe", "tiny-random-qwen3-moe"}) {
    SCOPED_TRACE(spec);
    auto m = Make(spec);
    for (int tp : {2, 4}) {  // at 4, the 2 KV (and GDN key) heads are shared by rank pairs
      CheckSlices(*m, tp, MoeParallel::kExpert);
      CheckSlices(*m, tp, MoeParallel::kSplit);
    }
  }
}

TEST(ShardingPlanTest, SliceRefusesDeviceWeightsAndBadRanks) {
  auto real = Make("random:qwen3-8b");
  const ShardingPlan p = Plan(real->config, 2);
  absl::StatusOr<RankWeights> w = SliceForRank(p, *real, 0);
  EXPECT_EQ(w.status().code(), absl::StatusCode::kFailedPrecondition);
  auto m = Make("tiny-random");
  EXPECT_THAT(SliceForRank(Plan(m->config, 2), *m, 2).status().message(),
              HasSubstr("rank 2 is outside [0, tp=2)"));
}

TEST(ShardingPlanTest, SliceRefusesFp8CutsOffTheScaleBlocks) {
  // tiny-random's widths (hidden 128) cut in two give 64-wide pieces: each
  // would need half of a 128x128 block's scale.
  auto m = Make("tiny-random-fp8");
  absl::StatusOr<RankWeights> w = SliceForRank(Plan(m->config, 2), *m, 0);
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(w.status().message(), HasSubstr("off its 128x128 scale blocks"));
  EXPECT_THAT(w.status().message(), HasSubstr("FP8 weight layers."));
}

// The real FP8 shapes (random:*-fp8 carry the checkpoints' dtypes and
// scale shapes): which cuts fall on the 128x128 scale blocks, as the README
// states. The refusals are the widths that do not: 35B-A3B's 512-wide shared
// expert at tp 8 (64-row pieces) and its experts split 8 ways; Qwen3-30B-A3B's
// 768-wide experts split 4 or 8 ways (192, 96).
TEST(ShardingPlanTest, RealFp8ShapesCutOnTheirScaleBlocks) {
  struct Want {
    const char* spec;
    int tp;
    MoeParallel moe;
    const char* refused;  // null: the cut is clean; else a substring of the refusal
  };
  const Want wants[] = {
      {"random:qwen3.6-27b-fp8", 2, MoeParallel::kExpert, nullptr},
      {"random:qwen3.6-27b-fp8", 4, MoeParallel::kExpert, nullptr},
      {"random:qwen3.6-27b-fp8", 8, MoeParallel::kExpert, nullptr},
      {"random:qwen3.6-35b-a3b-fp8", 2, MoeParallel::kSplit, nullptr},
      {"random:qwen3.6-35b-a3b-fp8", 4, MoeParallel::kExpert, nullptr},
      {"random:qwen3.6-35b-a3b-fp8", 4, MoeParallel::kSplit, nullptr},
      {"random:qwen3.6-35b-a3b-fp8", 8, MoeParallel::kExpert, "shared_expert.gate_proj"},
      {"random:qwen3.6-35b-a3b-fp8", 8, MoeParallel::kSplit, "experts.gate_up_proj"},
      {"random:qwen3.5-122b-a10b-fp8", 8, MoeParallel::kExpert, nullptr},
      {"random:qwen3.5-122b-a10b-fp8", 8, MoeParallel::kSplit, nullptr},
      {"random:qwen3-30b-a3b-fp8", 8, MoeParallel::kExpert, nullptr},
      {"random:qwen3-30b-a3b-fp8", 2, MoeParallel::kSplit, nullptr},
      {"random:qwen3-30b-a3b-fp8", 4, MoeParallel::kSplit, "pieces of 192"},
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(::testing::Message() << w.spec << " tp " << w.tp << " " << MoeParallelName(w.moe));
    auto m = Make(w.spec);
    absl::StatusOr<ShardingPlan> plan = PlanTensorParallel(m->config, w.tp, w.moe);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const absl::Status s = CheckBlockScaleCuts(*plan, *m);
    if (w.refused == nullptr) {
      EXPECT_TRUE(s.ok()) << s;
    } else {
      EXPECT_THAT(s.message(), HasSubstr(w.refused));
      EXPECT_THAT(s.message(), HasSubstr("off its 128x128 scale blocks"));
    }
  }
  // The bf16 models have nothing to check.
  auto bf16 = Make("random:qwen3.6-35b-a3b");
  absl::StatusOr<ShardingPlan> plan = PlanTensorParallel(bf16->config, 8, MoeParallel::kSplit);
  ASSERT_TRUE(plan.ok());
  EXPECT_TRUE(CheckBlockScaleCuts(*plan, *bf16).ok());
}

// Per-rank bytes: each split tensor's 1/tp plus every replicated tensor
// whole, so tp ranks hold the model plus tp - 1 extra copies of the
// replicated part. On the real shapes, as the README's table prints them.
TEST(ShardingPlanTest, MemoryArithmeticOnRealShapes) {
  for (const char* spec : {"random:qwen3.6-27b", "random:qwen3.6-35b-a3b",
                           "random:qwen3.5-122b-a10b", "random:qwen3-30b-a3b"}) {
    SCOPED_TRACE(spec);
    auto m = Make(spec);
    const int64_t whole = Plan(m->config, 1).WholeWeightBytes(2);
    for (int tp : {1, 2, 4, 8}) {
      for (MoeParallel moe : {MoeParallel::kExpert, MoeParallel::kSplit}) {
        absl::StatusOr<ShardingPlan> p = PlanTensorParallel(m->config, tp, moe);
        ASSERT_TRUE(p.ok()) << p.status();  // every real shape takes tp 1 to 8
        EXPECT_EQ(p->WholeWeightBytes(2), whole);
        // Shared KV / GDN key heads: each extra holder is one more copy.
        int64_t shared_copies = 0;
        for (const TensorSlicing& t : p->tensors) {
          if (t.replicated) continue;
          int64_t outer_inner = t.spec.numel() / t.spec.shape[static_cast<size_t>(t.axis)];
          for (size_t i = 0; i < t.segments.size(); ++i) {
            shared_copies += t.segments[i] * outer_inner * (tp / t.parts[i] - 1);
          }
        }
        EXPECT_EQ(p->RankWeightBytes(2) * tp,
                  whole + p->ReplicatedWeightBytes(2) * (tp - 1) + 2 * shared_copies);
        // The device-random tensors are bf16, so as stored equals bf16.
        EXPECT_EQ(RankWeightBytes(*p, *m), p->RankWeightBytes(2));
      }
    }
  }
  // Why TP exists: the 122B shape does not fit one 141 GB H200 in bf16, its
  // tp 2 rank does (the embedding and norms are replicated, ~2 GB).
  auto big = Make("random:qwen3.5-122b-a10b");
  const int64_t h200 = int64_t{139} << 30;  // the usable memory one H200 reports
  EXPECT_GT(Plan(big->config, 1).RankWeightBytes(2), h200);
  EXPECT_LT(Plan(big->config, 2).RankWeightBytes(2), h200);
}

TEST(ShardingPlanTest, DescribeNamesTheLayout) {
  auto m = Make("tiny-random-moe");
  const std::string d = DescribePlan(Plan(m->config, 2), m.get());
  EXPECT_THAT(d, HasSubstr("tensor parallel: tp 2, moe ep (4 experts per rank)"));
  EXPECT_THAT(d, HasSubstr("mlp.experts.gate_up_proj [8, 128, 128] -> [4, 128, 128]: experts"));
  EXPECT_THAT(d,
              HasSubstr("linear_attn.in_proj_qkv.weight [256, 128] -> [128, 128]: segmented rows"));
  EXPECT_THAT(d, HasSubstr("captures leave from rank 0"));
}

}  // namespace
}  // namespace draftfeed
