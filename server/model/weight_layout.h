// The one description of a decoder's structure: which blocks each layer is
// made of (from the config's features), and for each block kind its tensors,
// their shapes, their random-init rule and how the CUDA engine packs them.
// The loader checks checkpoints against it, the HF writer names tensors from
// it, the fingerprint and the random models walk it, and both engines load
// (and the CUDA engine uploads or fills) their weights from it, so none of
// them can drift apart.
//
// Adding a block kind (an MoE MLP, say), in short (docs/models.md, "Adding an
// architecture or a block kind", has every step, file and test):
//   1. a BlockKind enumerator and, if its tensors are new, LayerWeights members;
//   2. its entry in weight_layout.cc: BlockSpecs (tensors, shapes, init, the
//      tensor-parallel cut) and BlockDeviceBuffers (the CUDA layout, with its
//      index enum below);
//   3. BlocksOfLayer picks it from a config feature (e.g. ArchFeatures::mlp);
//   4. its forward in each engine (a case of the block switch) and its kernels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "server/model/config.h"
#include "server/model/model.h"
#include "server/model/tensor.h"

namespace draftfeed {

enum class BlockKind : uint8_t {
  kNorms,          // input_layernorm, post_attention_layernorm
  kAttention,      // self_attn.*: full causal attention (gated or not)
  kGatedDeltaNet,  // linear_attn.*
  kDenseMlp,       // mlp.*: SwiGLU
  kMoeMlp,         // mlp.*: router, routed experts and (kMoeSharedExpert) the shared expert
};

// The blocks of one layer, in forward order: norms, mixer, MLP.
struct LayerBlocks {
  BlockKind mixer;
  BlockKind mlp;
};
LayerBlocks BlocksOfLayer(const ModelConfig& config, int64_t layer);

// How a random model initialises a tensor.
struct RandomInit {
  enum class Dist : uint8_t {
    kNormal,      // offset + scale * N(0, 1) (the GPU fill: a unit-variance uniform)
    kLogUniform,  // log(U(lo, hi)): A_log, so that A = exp(A_log) spans HF's range
  };
  Dist dist = Dist::kNormal;
  double offset = 0.0, scale = 1.0;
  double lo = 1.0, hi = 16.0;
  // kNormal only: when > 0, row r (of a [rows, cols] tensor) has its scale
  // multiplied by exp(row_log_sigma * n_r), n_r ~ N(0, 1) drawn once per row
  // (a router whose experts have unequal norms; see MoeMlpSpecs).
  double row_log_sigma = 0.0;
};

// How tensor parallelism cuts a tensor over the ranks. Every spec declares
// one where it is made (weight_layout.cc); the sharding plan turns it into
// each rank's part and refuses a spec that declares none, so a new tensor
// cannot end up silently whole on every rank. The split is Megatron's: a
// block's input projections are column-parallel (their output rows cut by
// head or column, so a rank computes whole heads), its output projection
// row-parallel (its input columns cut to match, so a rank's block output is a
// partial sum).
enum class TpCut : uint8_t {
  kUndeclared,  // refused by PlanTensorParallel
  kReplicated,  // whole on every rank: embeddings, norms, the router, small gates
  kColumn,      // column-parallel: axis 0 (output rows) cut by head or column
  kRow,         // row-parallel: the last axis (input columns) cut as its producers are
  kSegmented,   // column-parallel over fused parts: `segments` along axis 0, each cut alone
  kExpert,      // stacked experts [E, ...]: whole experts per rank (--moe_parallel ep), or
                // every expert cut as `per_expert` says, one axis further in (split)
};
const char* TpCutName(TpCut cut);  // "undeclared", "replicated", "column", ...

// One part of a cut axis. shared_heads > 0: the part is cut by that many
// heads, and when tp is a multiple of them each head is one part, held by the
// ranks whose query (value) heads read it (KV heads, GDN key heads).
struct TpSegment {
  int64_t extent = 0;
  int64_t shared_heads = 0;
};

struct TensorParallelCut {
  TpCut kind = TpCut::kUndeclared;
  // kExpert only: how --moe_parallel split cuts each expert (kSegmented, kRow).
  TpCut per_expert = TpCut::kUndeclared;
  // kSegmented (and kExpert's kSegmented): the fused parts in order, their
  // extents summing to the axis. kColumn: empty (the whole axis in tp parts)
  // or one segment whose heads ranks may share.
  std::vector<TpSegment> segments;
  std::string note;         // for people: "q | k | v by heads", "per-head [q; gate] blocks"
  std::string shared_head;  // what a shared head is called: "KV head", "key head"
};

struct WeightSpec {
  std::string name;  // HF suffix after the model prefix, e.g. "layers.3.self_attn.k_proj.weight"
  std::vector<int64_t> shape;
  std::string origin;  // e.g. "num_key_value_heads=2, head_dim=64, hidden_size=128"
  int layer = -1;      // -1 for the global tensors
  Tensor ModelWeights::*global = nullptr;  // set when layer == -1
  Tensor LayerWeights::*member = nullptr;  // set when layer >= 0
  BlockKind block = BlockKind::kNorms;     // layer tensors only
  RandomInit init;
  bool device_f32 = false;  // the CUDA engine keeps it fp32 (GDN gate parameters), else bf16
  // A GEMM weight that fine-grained FP8 checkpoints quantize (attention and
  // GDN projections but in_proj_a/b, dense and shared-expert MLPs, every
  // expert); the rest (embeddings, norms, conv1d, gates, routers) stay bf16.
  bool fp8_eligible = false;
  // Stacked experts ([E, rows, cols]) only: the per-expert tensors that
  // checkpoints may hold instead of the fused `name` (e.g. {"gate_proj",
  // "up_proj"} for layers.N.mlp.experts.{e}.gate_proj.weight, then up_proj,
  // each [rows / parts, cols], stacked along dim 1 in this order).
  std::vector<std::string> expert_parts;
  TensorParallelCut tp_cut;  // declared by every spec (see TensorParallelCut)
  int64_t numel() const;
};

// Every decoder tensor (not lm_head): embed_tokens, the layers in order (each
// layer's blocks in forward order), the final norm. Expects a validated
// config. This order is canonical: the fingerprint and the random init walk it.
std::vector<WeightSpec> DecoderWeightSpecs(const ModelConfig& config);

// lm_head.weight, which lives outside the decoder prefix.
WeightSpec LmHeadSpec(const ModelConfig& config);

// The tensors of one block of `layer`, in canonical order.
std::vector<WeightSpec> BlockSpecs(const ModelConfig& config, BlockKind kind, int layer);

// How the CUDA engine lays a block out: each entry is one device buffer, the
// named tensors stacked row after row (a fused GEMM's weight operand, say
// [q_proj; k_proj; v_proj]). Indexed by the block's enum below.
using DeviceBuffer = std::vector<Tensor LayerWeights::*>;
const std::vector<DeviceBuffer>& BlockDeviceBuffers(BlockKind kind);

enum NormsBuffer { kInputNorm, kPostNorm };
enum AttentionBuffer { kAttnQkv, kAttnO, kAttnQNorm, kAttnKNorm };
enum GdnBuffer { kGdnInQkvBA, kGdnZ, kGdnConv, kGdnALog, kGdnDtBias, kGdnNorm, kGdnOut };
enum DenseMlpBuffer { kMlpGateUp, kMlpDown };
// kMoeRouter [E, D]; kMoeExpertsGateUp [E, 2I, D] (per expert gate rows then
// up rows); kMoeExpertsDown [E, D, I]; kMoeSharedGateUp [shared gate; shared
// up] [2*I_s, D]; kMoeSharedDown [D, I_s]; kMoeSharedGate [1, D]. The three
// shared buffers are null for kMoe (no shared expert).
enum MoeMlpBuffer {
  kMoeRouter,
  kMoeExpertsGateUp,
  kMoeExpertsDown,
  kMoeSharedGateUp,
  kMoeSharedDown,
  kMoeSharedGate
};

// The tensor of `weights` that `spec` names (`weights.layers` must be sized).
Tensor& WeightSlot(ModelWeights& weights, const WeightSpec& spec);
const Tensor& WeightSlot(const ModelWeights& weights, const WeightSpec& spec);

}  // namespace draftfeed
