// Model configuration, validated once from a Hugging Face config.json into an
// immutable struct; every later stage trusts it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace draftfeed {

enum class Arch : uint8_t {
  kQwen35Hybrid,  // model_type qwen3_5 / qwen3_5_text: Gated DeltaNet + gated attention
  kQwen3Dense,    // model_type qwen3
  kQwen35Moe,     // model_type qwen3_5_moe / qwen3_5_moe_text: the hybrid with MoE MLPs
  kQwen3Moe,      // model_type qwen3_moe: Qwen3 attention with MoE MLPs
};
std::string_view ArchName(Arch arch);  // "qwen3_5", "qwen3", "qwen3_5_moe", "qwen3_moe"

enum class LayerKind : uint8_t { kLinearAttention, kFullAttention };

// How RMSNorm applies its weight: Qwen3.5 stores w near 0 and scales by (1 + w),
// Qwen3 stores w near 1 and scales by w.
enum class NormConvention : uint8_t { kOffsetOne, kPlain };

enum class MlpKind : uint8_t {
  kDenseSwiGlu,  // down_proj(SiLU(gate_proj(x)) * up_proj(x))
  // Routed experts: softmax router over num_experts, top num_experts_per_tok,
  // a SwiGLU expert each, summed by routing weight (Qwen3-MoE).
  kMoe,
  // kMoe plus an always-on SwiGLU shared expert scaled by
  // sigmoid(shared_expert_gate(x)) (Qwen3.5-MoE).
  kMoeSharedExpert,
};

// What an architecture's decoder is built from. FeaturesOf is the one place
// that maps an Arch to them; every stage after the load reads these, never
// `arch` (which stays for names: the JSON dialect, ArchName).
struct ArchFeatures {
  NormConvention norm = NormConvention::kOffsetOne;  // residual-stream and q/k norms
  // q_proj has twice the query rows, a sigmoid output gate interleaved per
  // head (rows [2hd*h, 2hd*h + hd) query, the next hd its gate).
  bool gated_attention = true;
  bool qk_norm = true;           // per-head RMSNorm of q and k before RoPE
  bool linear_attention = true;  // layers may be Gated DeltaNet; the linear_* fields apply
  // The MoE layers' MLP (the others are kDenseSwiGlu: ModelConfig::MlpOfLayer).
  MlpKind mlp = MlpKind::kDenseSwiGlu;
};
ArchFeatures FeaturesOf(Arch arch);

// A fine-grained FP8 checkpoint's quantization_config: e4m3 weights with one
// scale per block_rows x block_cols block, activations quantized at run time
// (per token and 128-wide group). The only scheme accepted (quant_method
// "fp8", fmt "e4m3", activation_scheme "dynamic", weight_block_size
// [128, 128]); which modules are FP8 is read from the tensors themselves
// (an F8_E4M3 weight with a weight_scale_inv), never from
// modules_to_not_convert, which is kept only to be written back.
struct Fp8Quantization {
  bool enabled = false;
  int64_t block_rows = 128, block_cols = 128;
  std::vector<std::string> modules_to_not_convert;
};

// Upper bounds on a config's sizes, far above any released model (at most
// 128 layers, widths of tens of thousands, 512 experts), so that sizes
// multiplied together (every expert of every layer, in fp32 bytes) stay inside
// int64 and a corrupted number is refused by name instead of allocated.
inline constexpr int64_t kMaxConfigLayers = 1024;
inline constexpr int64_t kMaxConfigWidth = int64_t{1} << 18;        // any width, head count or dim
inline constexpr int64_t kMaxConfigExperts = int64_t{1} << 14;      // num_experts
inline constexpr int64_t kMaxConfigVocab = (int64_t{1} << 31) - 1;  // token ids are int32

struct ModelConfig {
  // Set both with SetArch.
  Arch arch = Arch::kQwen35Hybrid;
  ArchFeatures features = FeaturesOf(Arch::kQwen35Hybrid);
  void SetArch(Arch a) {
    arch = a;
    features = FeaturesOf(a);
  }
  // True when the checkpoint is the multimodal Qwen3_5ForConditionalGeneration
  // (decoder fields under text_config, weights under model.language_model.).
  bool multimodal = false;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e7;
  // Fraction of head_dim that is rotated. Qwen3.5 defaults to 0.25 (never 1.0);
  // Qwen3 rotates the whole head.
  double partial_rotary_factor = 0.25;
  bool tie_word_embeddings = false;
  // Gated DeltaNet (features.linear_attention only).
  int64_t linear_conv_kernel = 4;
  int64_t linear_key_head_dim = 128;
  int64_t linear_value_head_dim = 128;
  int64_t linear_num_key_heads = 16;
  int64_t linear_num_value_heads = 32;
  std::vector<LayerKind> layer_types;  // size num_layers: each layer's mixer
  // Mixture of experts (features.mlp kMoe / kMoeSharedExpert only).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;  // kMoeSharedExpert only
  // Top-k weights divided by their sum; qwen3_5_moe always does, qwen3_moe
  // as its config.json says.
  bool norm_topk_prob = true;
  // qwen3_moe: layer i is MoE iff i is not in mlp_only_layers and
  // (i + 1) % decoder_sparse_step == 0 (and num_experts > 0); qwen3_5_moe
  // keeps the defaults (every layer MoE).
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  // Top-level quantization_config (FP8 checkpoints, or --quantize fp8).
  Fp8Quantization quantization;

  // The MLP of `layer`: features.mlp for MoE layers, else kDenseSwiGlu.
  MlpKind MlpOfLayer(int64_t layer) const;
  bool has_dense_mlp() const;  // some layer has a dense MLP (intermediate_size applies)

  int64_t rotary_dim() const {
    return static_cast<int64_t>(static_cast<double>(head_dim) * partial_rotary_factor);
  }

  // Parses config.json text. `source` names the file in error messages.
  static absl::StatusOr<ModelConfig> FromJson(std::string_view json, std::string_view source);
  // Serialises in HF form (for the checkpoint writer). `multimodal` selects the
  // Qwen3_5ForConditionalGeneration layout with fields under text_config.
  std::string ToJson() const;
  // Checks internal consistency (positive sizes, head divisibility, rotary dim even, ...).
  absl::Status Validate() const;
};

}  // namespace draftfeed
