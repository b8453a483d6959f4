#include "server/model/sharding_plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace draftfeed {
namespace {

struct Count {
  std::string name;
  int64_t value;
  // KV heads and GDN key heads: a tp that is a multiple of the count is
  // served too, each head held by the ranks whose heads read it.
  bool shareable = false;
};

bool Takes(const Count& n, int64_t tp) {
  return n.value % tp == 0 || (n.shareable && tp % n.value == 0);
}

// The counts tp must divide for `config`: every head count and width that is
// cut. Both groupings survive any tp that divides both of their counts: query
// head h reads KV head h / (Hq/Hkv) and GDN value head j key head j / (Nv/Nk),
// and with Hq/tp, Hkv/tp (Nv/tp, Nk/tp) heads per rank a rank's query (value)
// heads read exactly its own KV (key) heads.
std::vector<Count> SplitCounts(const ModelConfig& c, MoeParallel moe) {
  bool full = false, linear = false, moe_layer = false;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const LayerBlocks b = BlocksOfLayer(c, i);
    full |= b.mixer == BlockKind::kAttention;
    linear |= b.mixer == BlockKind::kGatedDeltaNet;
    moe_layer |= b.mlp == BlockKind::kMoeMlp;
  }
  std::vector<Count> counts;
  if (full) {
    counts.push_back({"num_attention_heads", c.num_heads});
    counts.push_back({"num_key_value_heads", c.num_kv_heads, true});
  }
  if (linear) {
    counts.push_back({"linear_num_key_heads", c.linear_num_key_heads, true});
    counts.push_back({"linear_num_value_heads", c.linear_num_value_heads});
  }
  if (c.has_dense_mlp()) counts.push_back({"intermediate_size", c.intermediate_size});
  if (moe_layer) {
    if (moe == MoeParallel::kExpert) {
      counts.push_back({"num_experts", c.num_experts});
    } else {
      counts.push_back({"moe_intermediate_size", c.moe_intermediate_size});
    }
    if (c.features.mlp == MlpKind::kMoeSharedExpert) {
      counts.push_back({"shared_expert_intermediate_size", c.shared_expert_intermediate_size});
    }
  }
  return counts;
}

absl::Status CheckDivides(const ModelConfig& c, int tp, MoeParallel moe) {
  const std::vector<Count> counts = SplitCounts(c, moe);
  std::vector<std::string> bad;
  int64_t largest = 1;
  for (const Count& n : counts) {
    largest = std::max(largest, n.value);
    if (!Takes(n, tp)) bad.push_back(absl::StrCat(n.name, "=", n.value));
  }
  if (bad.empty()) return absl::OkStatus();
  std::vector<int64_t> valid;
  for (int64_t t = 1; t <= largest; ++t) {
    if (std::all_of(counts.begin(), counts.end(), [&](const Count& n) { return Takes(n, t); })) {
      valid.push_back(t);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--tp ", tp, " does not divide ", absl::StrJoin(bad, ", "),
                   moe == MoeParallel::kSplit ? " (--moe_parallel split)" : "",
                   " (--tp values this model takes: ", absl::StrJoin(valid, ", "), ")"));
}

// The suffix after "layers.N." (the name shared by every layer's copy).
std::string_view Suffix(std::string_view name) {
  if (name.rfind("layers.", 0) != 0) return name;
  const size_t dot = name.find('.', 7);
  return dot == std::string_view::npos ? name : name.substr(dot + 1);
}

// Parts of a head count over tp ranks: tp, or one per head when the ranks
// outnumber the heads (a multiple of them, as CheckDivides ensures).
int64_t PartsOf(int64_t heads, int tp) { return heads % tp == 0 ? tp : heads; }

absl::Status BadCut(const WeightSpec& spec, const std::string& problem) {
  return absl::InvalidArgumentError(absl::StrCat("weight ", spec.name, " [",
                                                 absl::StrJoin(spec.shape, ", "), "] ", problem));
}

// A column-parallel, row-parallel or segmented cut of spec's declared parts
// (the whole axis when it declares none), along axis `first_axis` (the last
// axis for a row cut); `prefix` opens the rule ("per-expert ").
absl::StatusOr<TensorSlicing> CutAxis(WeightSpec spec, int tp, TpCut kind, int first_axis,
                                      const char* prefix) {
  const TensorParallelCut& cut = spec.tp_cut;
  const int ndim = static_cast<int>(spec.shape.size());
  const int axis = kind == TpCut::kRow ? ndim - 1 : first_axis;
  if (axis < first_axis || axis >= ndim) {
    return BadCut(spec, absl::StrCat("has no axis ", first_axis, " for its ", TpCutName(kind),
                                     " cut"));
  }
  if ((kind == TpCut::kRow && !cut.segments.empty()) ||
      (kind == TpCut::kColumn && cut.segments.size() > 1) ||
      (kind == TpCut::kSegmented && cut.segments.empty())) {
    return BadCut(spec, absl::StrCat("declares a ", TpCutName(kind), " cut of ",
                                     cut.segments.size(),
                                     " segments (row: none, column: at most one, segmented: "
                                     "one or more)"));
  }
  const int64_t extent = spec.shape[static_cast<size_t>(axis)];
  std::vector<TpSegment> segments = cut.segments;
  if (segments.empty()) segments.push_back({extent, 0});
  TensorSlicing s;
  s.replicated = false;
  s.axis = axis;
  int64_t sum = 0;
  std::string shared;
  for (const TpSegment& seg : segments) {
    const int64_t parts = seg.shared_heads > 0 ? PartsOf(seg.shared_heads, tp) : tp;
    if (seg.extent <= 0 || seg.extent % parts != 0) {
      return BadCut(spec, absl::StrCat("declares a segment of ", seg.extent, " along axis ", axis,
                                       ", which --tp ", tp, " does not cut into ", parts,
                                       " equal parts"));
    }
    if (parts < tp && shared.empty()) {
      shared = absl::StrCat("each ", cut.shared_head, " on ", tp / parts, " ranks");
    }
    s.segments.push_back(seg.extent);
    s.parts.push_back(parts);
    sum += seg.extent;
  }
  if (sum != extent) {
    return BadCut(spec, absl::StrCat("declares segments [", absl::StrJoin(s.segments, ", "),
                                     "] summing to ", sum, ", not its axis ", axis, " (", extent,
                                     ")"));
  }
  std::vector<std::string> details;
  if (!cut.note.empty()) details.push_back(cut.note);
  if (!shared.empty()) details.push_back(shared);
  const char* what = kind == TpCut::kRow         ? "columns"
                     : kind == TpCut::kSegmented ? "segmented rows"
                                                 : "rows";
  const std::string detail =
      details.empty() ? "" : absl::StrCat(" (", absl::StrJoin(details, ", "), ")");
  s.rule = absl::StrCat(prefix, what, detail);
  s.spec = std::move(spec);
  return s;
}

std::string AfterOf(BlockKind kind, const ModelConfig& c) {
  switch (kind) {
    case BlockKind::kAttention:
      return "self_attn.o_proj";
    case BlockKind::kGatedDeltaNet:
      return "linear_attn.out_proj";
    case BlockKind::kDenseMlp:
      return "mlp.down_proj";
    case BlockKind::kMoeMlp:
      return c.features.mlp == MlpKind::kMoeSharedExpert ? "mlp (experts + shared expert)"
                                                         : "mlp (experts)";
    case BlockKind::kNorms:
      break;
  }
  return "";
}

std::string Gib(int64_t bytes) {
  if (bytes < (int64_t{1} << 30)) {
    return absl::StrFormat("%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  }
  return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (1 << 30));
}

}  // namespace

std::string_view MoeParallelName(MoeParallel m) {
  return m == MoeParallel::kExpert ? "ep" : "split";
}

absl::StatusOr<MoeParallel> ParseMoeParallel(std::string_view value) {
  if (value == "ep") return MoeParallel::kExpert;
  if (value == "split") return MoeParallel::kSplit;
  return absl::InvalidArgumentError(
      absl::StrCat("--moe_parallel=", std::string(value),
                   " is not ep (experts spread over the ranks) or split (every expert cut)"));
}

std::vector<int64_t> TensorSlicing::RankShape(int tp) const {
  std::vector<int64_t> shape = spec.shape;
  if (replicated) return shape;
  int64_t extent = 0;
  for (size_t i = 0; i < segments.size(); ++i) extent += segments[i] / parts[i];
  shape[static_cast<size_t>(axis)] = extent;
  return shape;
}

int64_t TensorSlicing::RankNumel(int tp) const {
  int64_t n = 1;
  for (int64_t d : RankShape(tp)) n *= d;
  return n;
}

bool TensorSlicing::Contiguous() const {
  if (replicated) return true;
  int64_t outer = 1;
  for (int a = 0; a < axis; ++a) outer *= spec.shape[static_cast<size_t>(a)];
  return outer == 1 && segments.size() == 1;
}

int64_t ShardingPlan::ExpertBegin(int rank) const {
  return moe == MoeParallel::kExpert ? rank * experts_per_rank : 0;
}

int64_t ShardingPlan::RankWeightBytes(int64_t element_bytes) const {
  int64_t n = 0;
  for (const TensorSlicing& t : tensors) n += t.RankNumel(tp);
  return n * element_bytes;
}

int64_t ShardingPlan::WholeWeightBytes(int64_t element_bytes) const {
  int64_t n = 0;
  for (const TensorSlicing& t : tensors) n += t.spec.numel();
  return n * element_bytes;
}

int64_t ShardingPlan::ReplicatedWeightBytes(int64_t element_bytes) const {
  int64_t n = 0;
  for (const TensorSlicing& t : tensors) {
    if (t.replicated) n += t.spec.numel();
  }
  return n * element_bytes;
}

absl::StatusOr<TensorSlicing> SliceTensor(WeightSpec spec, int tp, MoeParallel moe) {
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("--tp ", tp, " must be >= 1"));
  const TpCut kind = spec.tp_cut.kind;  // read before spec is moved from
  switch (kind) {
    case TpCut::kUndeclared:
      break;
    case TpCut::kReplicated: {
      TensorSlicing whole;
      whole.rule = "replicated";
      whole.spec = std::move(spec);
      return whole;
    }
    case TpCut::kColumn:
    case TpCut::kRow:
    case TpCut::kSegmented:
      return CutAxis(std::move(spec), tp, kind, 0, "");
    case TpCut::kExpert: {
      const TpCut per_expert = spec.tp_cut.per_expert;
      if (per_expert != TpCut::kColumn && per_expert != TpCut::kRow &&
          per_expert != TpCut::kSegmented) {
        return BadCut(spec, absl::StrCat("declares an expert cut whose per-expert cut is ",
                                         TpCutName(per_expert),
                                         " (column, row or segmented: how --moe_parallel split "
                                         "cuts each expert)"));
      }
      if (moe == MoeParallel::kSplit) {
        return CutAxis(std::move(spec), tp, per_expert, 1, "per-expert ");
      }
      if (spec.shape.empty() || spec.shape[0] % tp != 0) {
        return BadCut(spec, absl::StrCat("has experts that --tp ", tp, " does not divide"));
      }
      const int64_t experts = spec.shape[0];
      TensorSlicing s;
      s.replicated = false;
      s.segments = {experts};
      s.parts = {tp};
      s.rule = "experts";
      s.spec = std::move(spec);
      return s;
    }
  }
  return BadCut(spec, absl::StrCat("declares no tensor-parallel cut (its WeightSpec's tp_cut is ",
                                   TpCutName(spec.tp_cut.kind),
                                   "; every tensor says column, row, segmented, replicated or "
                                   "expert where weight_layout.cc makes it)"));
}

absl::StatusOr<ShardingPlan> PlanTensorParallel(const ModelConfig& config, int tp,
                                                MoeParallel moe) {
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("--tp ", tp, " must be >= 1"));
  DF_RETURN_IF_ERROR(config.Validate());
  DF_RETURN_IF_ERROR(CheckDivides(config, tp, moe));
  ShardingPlan plan;
  plan.tp = tp;
  plan.moe = moe;
  plan.config = config;
  ModelConfig& r = plan.rank_config;
  r = config;
  const bool moe_model = config.features.mlp != MlpKind::kDenseSwiGlu;
  // Counts a layer kind never reads need not divide (and are left whole).
  for (const Count& n : SplitCounts(config, moe)) {
    if (n.name == "num_attention_heads") r.num_heads /= tp;
    if (n.name == "num_key_value_heads") r.num_kv_heads /= PartsOf(n.value, tp);
    if (n.name == "linear_num_key_heads") r.linear_num_key_heads /= PartsOf(n.value, tp);
    if (n.name == "linear_num_value_heads") r.linear_num_value_heads /= tp;
    if (n.name == "intermediate_size") r.intermediate_size /= tp;
    if (n.name == "moe_intermediate_size") r.moe_intermediate_size /= tp;
    if (n.name == "shared_expert_intermediate_size") r.shared_expert_intermediate_size /= tp;
  }
  plan.experts_per_rank =
      moe_model && moe == MoeParallel::kExpert ? config.num_experts / tp : config.num_experts;
  for (WeightSpec& spec : DecoderWeightSpecs(config)) {
    DF_ASSIGN_OR_RETURN(TensorSlicing t, SliceTensor(std::move(spec), tp, moe));
    plan.tensors.push_back(std::move(t));
  }
  if (tp > 1) {
    for (int64_t i = 0; i < config.num_layers; ++i) {
      const LayerBlocks b = BlocksOfLayer(config, i);
      for (BlockKind k : {b.mixer, b.mlp}) {
        plan.all_reduces.push_back({static_cast<int>(i), k, AfterOf(k, config)});
      }
    }
  }
  return plan;
}

int64_t RankWeightBytes(const ShardingPlan& plan, const Model& model) {
  int64_t bytes = 0;
  for (const TensorSlicing& t : plan.tensors) {
    const Tensor& w = WeightSlot(model.weights, t.spec);
    bytes += t.RankNumel(plan.tp) * static_cast<int64_t>(DTypeSize(w.dtype));
  }
  return bytes;
}

namespace {

// One contiguous range of a sliced tensor along its axis: [start, start + length).
struct Piece {
  int64_t start = 0, length = 0;
};

// A rank's ranges along t.axis in the order it stores them: one per segment
// (the whole axis when replicated).
std::vector<Piece> RankPieces(const TensorSlicing& t, int rank, int tp) {
  if (t.replicated) return {{0, t.spec.shape[static_cast<size_t>(t.axis)]}};
  std::vector<Piece> pieces;
  int64_t seg_begin = 0;
  for (size_t i = 0; i < t.segments.size(); ++i) {
    const int64_t n = t.segments[i] / t.parts[i];
    pieces.push_back({seg_begin + t.PartOf(rank, i, tp) * n, n});
    seg_begin += t.segments[i];
  }
  return pieces;
}

// For every index of the axes before `axis`, each piece in turn: the rank's
// part of a row-major tensor of `shape`, `elem`-byte elements.
std::unique_ptr<std::byte[]> GatherPieces(const std::byte* data, const std::vector<int64_t>& shape,
                                          size_t elem, int axis, const std::vector<Piece>& pieces,
                                          size_t out_bytes) {
  int64_t outer = 1, inner = 1;
  for (int a = 0; a < axis; ++a) outer *= shape[static_cast<size_t>(a)];
  for (size_t a = static_cast<size_t>(axis) + 1; a < shape.size(); ++a) inner *= shape[a];
  const int64_t extent = shape[static_cast<size_t>(axis)];
  auto buf = std::make_unique<std::byte[]>(out_bytes);
  std::byte* dst = buf.get();
  for (int64_t o = 0; o < outer; ++o) {
    for (const Piece& p : pieces) {
      const size_t bytes = static_cast<size_t>(p.length * inner) * elem;
      std::memcpy(dst, data + static_cast<size_t>((o * extent + p.start) * inner) * elem, bytes);
      dst += bytes;
    }
  }
  return buf;
}

// An FP8 weight's 128x128 block scales cut as its pieces are. A piece along
// one of the block axes (the last two) must cover whole blocks of the weight,
// at a block boundary of the rank's part too (a partial block only at the
// axis's end), or its rows or columns would need another block's scale: such
// a cut is refused, naming the tensor. Other axes (the experts of a stacked
// [E, rows, cols] weight) cut the scales as they cut the weight.
// Whether rank pieces of t along its axis cover whole 128x128 blocks (see
// CheckBlockScaleCuts); a cut along an axis before the last two (the experts
// of a stacked [E, rows, cols] weight) always does.
absl::Status CheckPieces(const TensorSlicing& t, const std::vector<Piece>& pieces, int tp) {
  const int ndim = static_cast<int>(t.spec.shape.size());
  if (t.replicated || t.axis < ndim - 2) return absl::OkStatus();
  const int64_t extent = t.spec.shape[static_cast<size_t>(t.axis)];
  int64_t local = 0;
  for (const Piece& p : pieces) {
    const bool ends_axis = p.start + p.length == extent;
    if (p.start % kFp8BlockSize != 0 || local % kFp8BlockSize != 0 ||
        (p.length % kFp8BlockSize != 0 && !ends_axis)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "FP8 weight ", t.spec.name, " [", absl::StrJoin(t.spec.shape, ", "), "]: --tp ", tp,
          " cuts its axis ", t.axis, " (", t.rule, ") into pieces of ", p.length, " at ", p.start,
          ", off its 128x128 scale blocks; serve it with a --tp whose pieces are multiples of "
          "128, or the bf16 checkpoint"));
    }
    local += p.length;
  }
  return absl::OkStatus();
}

// An FP8 weight's 128x128 block scales cut as its pieces are (CheckPieces
// must hold): along a block axis each piece's blocks, along another axis the
// piece itself.
absl::StatusOr<BlockScales> SliceBlockScales(const TensorSlicing& t, const BlockScales& whole,
                                             const std::vector<Piece>& pieces, int tp,
                                             std::vector<std::unique_ptr<std::byte[]>>& gathered) {
  if (!whole.valid() || whole.shape != Fp8ScaleShape(t.spec.shape)) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 weight ", t.spec.name, " has no block scales of the shape it needs"));
  }
  if (t.replicated) return whole;
  DF_RETURN_IF_ERROR(CheckPieces(t, pieces, tp));
  const bool block_axis = t.axis >= static_cast<int>(t.spec.shape.size()) - 2;
  std::vector<Piece> scale_pieces;
  for (const Piece& p : pieces) {
    if (!block_axis) {
      scale_pieces.push_back(p);
      continue;
    }
    const int64_t first = p.start / kFp8BlockSize;
    const int64_t end = (p.start + p.length + kFp8BlockSize - 1) / kFp8BlockSize;
    scale_pieces.push_back({first, end - first});
  }
  BlockScales part;
  part.dtype = whole.dtype;
  part.shape = whole.shape;
  int64_t axis_extent = 0;
  for (const Piece& p : scale_pieces) axis_extent += p.length;
  part.shape[static_cast<size_t>(t.axis)] = axis_extent;
  gathered.push_back(GatherPieces(whole.data, whole.shape, DTypeSize(whole.dtype), t.axis,
                                  scale_pieces, part.nbytes()));
  part.data = gathered.back().get();
  return part;
}

}  // namespace

absl::Status CheckBlockScaleCuts(const ShardingPlan& plan, const Model& model) {
  if (model.weights.layers.size() != static_cast<size_t>(plan.config.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("model has ", model.weights.layers.size(),
                                                   " layers of weights, config says ",
                                                   plan.config.num_layers));
  }
  for (const TensorSlicing& t : plan.tensors) {
    if (!WeightSlot(model.weights, t.spec).fp8()) continue;
    for (int rank = 0; rank < plan.tp; ++rank) {
      DF_RETURN_IF_ERROR(CheckPieces(t, RankPieces(t, rank, plan.tp), plan.tp));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<RankWeights> SliceForRank(const ShardingPlan& plan, const Model& model, int rank) {
  if (rank < 0 || rank >= plan.tp) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside [0, tp=", plan.tp, ")"));
  }
  if (model.weights_on_device_random) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model ", model.id, " has its weights on the GPU only; there is nothing to slice"));
  }
  if (model.weights.layers.size() != static_cast<size_t>(plan.config.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat("model has ", model.weights.layers.size(),
                                                   " layers of weights, config says ",
                                                   plan.config.num_layers));
  }
  RankWeights out;
  out.weights.layers.resize(model.weights.layers.size());
  for (size_t l = 0; l < model.weights.layers.size(); ++l) {
    out.weights.layers[l].kind = model.weights.layers[l].kind;
  }
  for (const TensorSlicing& t : plan.tensors) {
    const Tensor& whole = WeightSlot(model.weights, t.spec);
    if (!whole.valid()) {
      return absl::InvalidArgumentError(absl::StrCat("weight ", t.spec.name, " is missing"));
    }
    if (whole.shape != t.spec.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("weight ", t.spec.name, " has shape ", whole.ShapeString(), ", expected [",
                       absl::StrJoin(t.spec.shape, ", "), "] (", t.spec.origin, ")"));
    }
    if (whole.dtype != DType::kBF16 && whole.dtype != DType::kF16 && whole.dtype != DType::kF32 &&
        !whole.fp8()) {
      return absl::InvalidArgumentError(
          absl::StrCat("weight ", t.spec.name, " is ", std::string(DTypeName(whole.dtype)),
                       "; tensor parallelism slices BF16, F16, F32 and FP8 weights only"));
    }
    WeightSpec spec = t.spec;
    spec.shape = t.RankShape(plan.tp);
    if (!t.replicated && plan.tp > 1) {
      absl::StrAppend(&spec.origin, "; ", t.rule, " of tp ", plan.tp, ", rank ", rank);
    }
    Tensor part;
    part.dtype = whole.dtype;
    part.shape = spec.shape;
    const std::vector<Piece> pieces = RankPieces(t, rank, plan.tp);
    if (t.Contiguous()) {
      const int64_t offset = t.replicated ? 0 : t.PartOf(rank, 0, plan.tp) * part.numel();
      part.data = whole.data + static_cast<size_t>(offset) * DTypeSize(whole.dtype);
    } else {
      out.gathered.push_back(GatherPieces(whole.data, t.spec.shape, DTypeSize(whole.dtype), t.axis,
                                          pieces, part.nbytes()));
      part.data = out.gathered.back().get();
    }
    if (whole.fp8()) {
      DF_ASSIGN_OR_RETURN(part.scale_inv,
                          SliceBlockScales(t, whole.scale_inv, pieces, plan.tp, out.gathered));
    }
    WeightSlot(out.weights, spec) = std::move(part);
    out.specs.push_back(std::move(spec));
  }
  return out;
}

std::string DescribePlan(const ShardingPlan& plan, const Model* model) {
  const ModelConfig& c = plan.config;
  const bool moe_model = c.features.mlp != MlpKind::kDenseSwiGlu;
  std::string out = absl::StrCat("tensor parallel: tp ", plan.tp);
  if (moe_model) {
    absl::StrAppend(&out, ", moe ", std::string(MoeParallelName(plan.moe)),
                    plan.moe == MoeParallel::kExpert
                        ? absl::StrCat(" (", plan.experts_per_rank, " experts per rank)")
                        : "");
  }
  absl::StrAppend(&out, "\n  decoder weights in bf16: ", Gib(plan.RankWeightBytes(2)),
                  " per rank, ", Gib(plan.WholeWeightBytes(2)), " whole, ",
                  Gib(plan.ReplicatedWeightBytes(2)), " replicated on every rank\n");
  if (model != nullptr) {
    absl::StrAppend(&out, "  as stored: ", Gib(RankWeightBytes(plan, *model)), " per rank\n");
    bool fp8 = false;
    for (const TensorSlicing& t : plan.tensors)
      fp8 = fp8 || WeightSlot(model->weights, t.spec).fp8();
    if (fp8 && model->weights.layers.size() == static_cast<size_t>(c.num_layers)) {
      const absl::Status cuts = CheckBlockScaleCuts(plan, *model);
      absl::StrAppend(&out, "  FP8 block scales: ",
                      cuts.ok() ? "every cut on a 128x128 block edge"
                                : absl::StrCat("refused: ", cuts.message()),
                      "\n");
    }
  }
  // Each distinct tensor suffix once, in the canonical order.
  std::vector<std::string> seen;
  for (const TensorSlicing& t : plan.tensors) {
    const std::string suffix(Suffix(t.spec.name));
    if (std::find(seen.begin(), seen.end(), suffix) != seen.end()) continue;
    seen.push_back(suffix);
    absl::StrAppend(&out, "  ", suffix, " [", absl::StrJoin(t.spec.shape, ", "), "] -> [",
                    absl::StrJoin(t.RankShape(plan.tp), ", "), "]: ", t.rule, "\n");
  }
  std::vector<std::string> after;
  for (const AllReducePoint& p : plan.all_reduces) {
    if (std::find(after.begin(), after.end(), p.after) == after.end()) after.push_back(p.after);
  }
  absl::StrAppend(
      &out, "  all-reduces: ", plan.all_reduces.size(),
      plan.all_reduces.empty() ? "" : absl::StrCat(", after ", absl::StrJoin(after, ", ")),
      "\n  captures leave from rank ", plan.capture_rank, "\n");
  return out;
}

}  // namespace draftfeed
