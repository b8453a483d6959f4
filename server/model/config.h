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
};
std::string_view ArchName(Arch arch);  // "qwen3_5", "qwen3"

enum class LayerKind : uint8_t { kLinearAttention, kFullAttention };

// How RMSNorm applies its weight: Qwen3.5 stores w near 0 and scales by (1 + w),
// Qwen3 stores w near 1 and scales by w.
enum class NormConvention : uint8_t { kOffsetOne, kPlain };

enum class MlpKind : uint8_t {
  kDenseSwiGlu,  // down_proj(SiLU(gate_proj(x)) * up_proj(x))
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
  MlpKind mlp = MlpKind::kDenseSwiGlu;
};
ArchFeatures FeaturesOf(Arch arch);

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
