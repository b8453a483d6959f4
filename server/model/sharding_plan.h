// Tensor parallelism: which part of every decoder tensor each of tp ranks
// holds, the counts a rank computes with, and where the ranks' partial
// outputs are summed. Engine-free, so the CPU threads-as-ranks engine and a
// multi-GPU engine run the same plan.
//
// The split is Megatron's: a mixer's heads and an MLP's columns are cut so
// that every rank computes whole heads (whole SwiGLU columns, whole experts)
// from the replicated residual stream, and the block's output projection is
// cut along its input, so each rank's block output is a partial sum; one
// all-reduce after every mixer and every MLP restores the replicated stream.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/model/config.h"
#include "server/model/model.h"
#include "server/model/tensor.h"
#include "server/model/weight_layout.h"

namespace draftfeed {

// How an MoE MLP's routed experts are spread over the ranks.
enum class MoeParallel : uint8_t {
  // Rank r holds experts [r*E/tp, (r+1)*E/tp) whole and evaluates the tokens
  // routed to them; the router runs on every rank over all experts.
  kExpert,
  // Every rank holds every expert's slice of moe_intermediate_size (gate/up
  // rows, down columns), like a dense MLP.
  kSplit,
};
std::string_view MoeParallelName(MoeParallel m);  // "ep", "split" (the flag's spelling)
// Parses --moe_parallel; the error names the flag and the accepted values.
absl::StatusOr<MoeParallel> ParseMoeParallel(std::string_view value);

// One tensor's cut. Replicated tensors are whole on every rank. Otherwise the
// tensor is cut along `axis`, whose extent is the concatenation of `segments`
// (a fused tensor's head-indexed parts, e.g. GDN in_proj_qkv's [q | k | v]);
// segment i is cut into parts[i] equal parts and rank r keeps part
// r * parts[i] / tp of each, in order, for every index of the axes before
// `axis`. parts[i] is tp, except for KV heads (and GDN key heads) when tp is
// a multiple of their count: then each head is one part, held by the tp /
// heads ranks whose query (value) heads read it.
struct TensorSlicing {
  WeightSpec spec;  // the whole tensor
  bool replicated = true;
  int axis = 0;
  std::vector<int64_t> segments;  // sum == spec.shape[axis]; empty when replicated
  std::vector<int64_t> parts;     // per segment, each dividing tp
  std::string rule;               // for people: "rows", "columns", "segmented rows (q|k|v)", ...

  // Which part of segment i rank r holds.
  int64_t PartOf(int rank, size_t segment, int tp) const { return rank * parts[segment] / tp; }

  // The shape every rank's part has (parts are equal).
  std::vector<int64_t> RankShape(int tp) const;
  int64_t RankNumel(int tp) const;
  // A rank's part is one contiguous range of the whole (row slices of a
  // row-major tensor): a view into the mapped file. Column and segmented
  // slices are gathered into a buffer of the rank's own.
  bool Contiguous() const;
};

// A point where the ranks' partial block outputs are summed.
struct AllReducePoint {
  int layer = 0;
  BlockKind block = BlockKind::kAttention;
  std::string after;  // the tensor whose partial products are summed, e.g. "self_attn.o_proj"
};

struct ShardingPlan {
  int tp = 1;
  MoeParallel moe = MoeParallel::kExpert;
  ModelConfig config;  // the whole model's
  // The counts one rank computes with: heads, GDN heads, intermediate sizes
  // divided by tp. num_experts stays whole (the router scores all experts);
  // rank r evaluates experts [ExpertBegin(r), ExpertBegin(r) + experts_per_rank).
  ModelConfig rank_config;
  int64_t experts_per_rank = 0;
  std::vector<TensorSlicing> tensors;       // DecoderWeightSpecs order
  std::vector<AllReducePoint> all_reduces;  // forward order; empty when tp == 1
  // Captured layers are read from this rank (every rank holds the replicated
  // residual stream after each all-reduce).
  int capture_rank = 0;

  int64_t ExpertBegin(int rank) const;
  // Whether ranks hold different experts (ep over more than one rank).
  bool ExpertParallel() const {
    return experts_per_rank > 0 && experts_per_rank < config.num_experts;
  }
  // The MoE strategy as engines report it ("ep", "split"): empty for a dense
  // model or a single rank.
  std::string MoeLayoutName() const {
    return config.features.mlp != MlpKind::kDenseSwiGlu && tp > 1
               ? std::string(MoeParallelName(moe))
               : std::string();
  }
  // Bytes of decoder weights (lm_head excluded: only target outputs read
  // it, on the capture rank, uploaded when a stream first asks)
  // with every element `element_bytes` wide: one rank's, the whole model's,
  // and the part every rank holds whole. When no KV or GDN key head is
  // shared by ranks, RankWeightBytes * tp == WholeWeightBytes +
  // ReplicatedWeightBytes * (tp - 1).
  int64_t RankWeightBytes(int64_t element_bytes) const;
  int64_t WholeWeightBytes(int64_t element_bytes) const;
  int64_t ReplicatedWeightBytes(int64_t element_bytes) const;
};

// The plan of `config` (validated) over tp ranks. INVALID_ARGUMENT when tp < 1
// or when tp does not divide a count that is split (for KV heads and GDN key
// heads: neither divides nor is a multiple of it), naming every such count
// with its value and the tps this model takes; or when a tensor's declared cut
// is missing or does not fit it (SliceTensor).
absl::StatusOr<ShardingPlan> PlanTensorParallel(const ModelConfig& config, int tp,
                                                MoeParallel moe = MoeParallel::kExpert);

// One tensor's cut over tp ranks, as its spec declares it (spec.tp_cut).
// INVALID_ARGUMENT naming the tensor when it declares none (TpCut::kUndeclared:
// no tensor is replicated by omission) or declares parts that do not fit its
// shape or do not cut into tp equal parts.
absl::StatusOr<TensorSlicing> SliceTensor(WeightSpec spec, int tp, MoeParallel moe);

// One rank's bytes of `model`'s decoder weights as stored (each tensor's own
// dtype; device-random models carry dtypes too).
int64_t RankWeightBytes(const ShardingPlan& plan, const Model& model);

// FP8 weights are cut with their 128x128 block scales, so each rank's piece
// of a sliced row or column axis must start on a block edge and cover whole
// blocks (a partial block only at the axis's end), in the whole tensor and
// in the rank's part. INVALID_ARGUMENT naming the first FP8 tensor of
// `model` (host or device-random) whose cut does not; OK otherwise.
absl::Status CheckBlockScaleCuts(const ShardingPlan& plan, const Model& model);

// One rank's tensors: views into the model's storage where the part is
// contiguous, else gathered into buffers owned here. `weights` is valid while
// both this and the model live.
struct RankWeights {
  ModelWeights weights;                                // sliced tensors in their LayerWeights slots
  std::vector<WeightSpec> specs;                       // DecoderWeightSpecs with the rank's shapes
  std::vector<std::unique_ptr<std::byte[]>> gathered;  // owned column / segmented parts
};
// FAILED_PRECONDITION for a model whose weights live on the GPU only;
// INVALID_ARGUMENT naming a tensor that is missing or of the wrong shape, or
// an FP8 one cut off its scale blocks (CheckBlockScaleCuts).
absl::StatusOr<RankWeights> SliceForRank(const ShardingPlan& plan, const Model& model, int rank);

// A few lines for people (--print_plan, the start-up line's detail): tp, the
// MoE strategy, per-rank and whole weight bytes in bf16 and as stored, every
// distinct rule, the all-reduce points and the capture rank.
std::string DescribePlan(const ShardingPlan& plan, const Model* model = nullptr);

}  // namespace draftfeed
