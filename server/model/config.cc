// The architectures' features and the consistency checks every ModelConfig
// passes, whichever way it was made (config.json, a built-in random model).
#include "server/model/config.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/model/tensor.h"

namespace draftfeed {

std::string_view ArchName(Arch arch) {
  switch (arch) {
    case Arch::kQwen35Hybrid:
      return "qwen3_5";
    case Arch::kQwen3Dense:
      return "qwen3";
    case Arch::kQwen35Moe:
      return "qwen3_5_moe";
    case Arch::kQwen3Moe:
      return "qwen3_moe";
  }
  return "unknown";
}

ArchFeatures FeaturesOf(Arch arch) {
  switch (arch) {
    case Arch::kQwen35Hybrid:
      return {.norm = NormConvention::kOffsetOne,
              .gated_attention = true,
              .qk_norm = true,
              .linear_attention = true,
              .mlp = MlpKind::kDenseSwiGlu};
    case Arch::kQwen3Dense:
      return {.norm = NormConvention::kPlain,
              .gated_attention = false,
              .qk_norm = true,
              .linear_attention = false,
              .mlp = MlpKind::kDenseSwiGlu};
    case Arch::kQwen35Moe:
      return {.norm = NormConvention::kOffsetOne,
              .gated_attention = true,
              .qk_norm = true,
              .linear_attention = true,
              .mlp = MlpKind::kMoeSharedExpert};
    case Arch::kQwen3Moe:
      return {.norm = NormConvention::kPlain,
              .gated_attention = false,
              .qk_norm = true,
              .linear_attention = false,
              .mlp = MlpKind::kMoe};
  }
  return {};
}

MlpKind ModelConfig::MlpOfLayer(int64_t layer) const {
  if (features.mlp == MlpKind::kDenseSwiGlu || num_experts <= 0) return MlpKind::kDenseSwiGlu;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return MlpKind::kDenseSwiGlu;
  }
  if (decoder_sparse_step <= 0 || (layer + 1) % decoder_sparse_step != 0) {
    return MlpKind::kDenseSwiGlu;
  }
  return features.mlp;
}

bool ModelConfig::has_dense_mlp() const {
  for (int64_t i = 0; i < num_layers; ++i) {
    if (MlpOfLayer(i) == MlpKind::kDenseSwiGlu) return true;
  }
  return false;
}

absl::Status ModelConfig::Validate() const {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  const struct {
    absl::string_view name;
    int64_t value;
  } sizes[] = {
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_layers},
      {"num_attention_heads", num_heads},
      {"num_key_value_heads", num_kv_heads},
      {"head_dim", head_dim},
  };
  // Only a dense MLP reads intermediate_size (qwen3_5_moe has none).
  const bool dense_mlp =
      features.mlp == MlpKind::kDenseSwiGlu || (features.mlp == MlpKind::kMoe && has_dense_mlp());
  for (const auto& s : sizes) {
    if (s.name == "intermediate_size" && !dense_mlp) continue;
    if (s.value <= 0) return bad(s.name, " must be positive, got ", s.value);
  }
  const struct {
    absl::string_view name;
    int64_t value, max;
  } bounded[] = {
      {"vocab_size", vocab_size, kMaxConfigVocab},
      {"hidden_size", hidden_size, kMaxConfigWidth},
      {"intermediate_size", intermediate_size, kMaxConfigWidth},
      {"num_hidden_layers", num_layers, kMaxConfigLayers},
      {"num_attention_heads", num_heads, kMaxConfigWidth},
      {"num_key_value_heads", num_kv_heads, kMaxConfigWidth},
      {"head_dim", head_dim, kMaxConfigWidth},
      {"num_experts", num_experts, kMaxConfigExperts},
      {"moe_intermediate_size", moe_intermediate_size, kMaxConfigWidth},
      {"shared_expert_intermediate_size", shared_expert_intermediate_size, kMaxConfigWidth},
      {"linear_conv_kernel_dim", linear_conv_kernel, kMaxConfigWidth},
      {"linear_key_head_dim", linear_key_head_dim, kMaxConfigWidth},
      {"linear_value_head_dim", linear_value_head_dim, kMaxConfigWidth},
      {"linear_num_key_heads", linear_num_key_heads, kMaxConfigWidth},
      {"linear_num_value_heads", linear_num_value_heads, kMaxConfigWidth},
  };
  for (const auto& s : bounded) {
    if (s.value > s.max) return bad(s.name, " must be at most ", s.max, ", got ", s.value);
  }
  if (features.mlp != MlpKind::kDenseSwiGlu) {
    if (features.mlp == MlpKind::kMoe) {
      if (num_experts < 0) return bad("num_experts must not be negative, got ", num_experts);
      if (decoder_sparse_step <= 0) {
        return bad("decoder_sparse_step must be positive, got ", decoder_sparse_step);
      }
    } else {
      if (num_experts <= 0) return bad("num_experts must be positive, got ", num_experts);
      if (decoder_sparse_step != 1 || !mlp_only_layers.empty()) {
        return bad(std::string(ArchName(arch)), " makes every layer MoE: decoder_sparse_step ",
                   "must be 1 and mlp_only_layers empty");
      }
      if (!norm_topk_prob) {
        return bad(std::string(ArchName(arch)),
                   " always renormalises the top-k weights: norm_topk_prob must be true");
      }
      if (shared_expert_intermediate_size <= 0) {
        return bad("shared_expert_intermediate_size must be positive, got ",
                   shared_expert_intermediate_size);
      }
    }
    if (num_experts > 0) {
      if (num_experts_per_tok <= 0 || num_experts_per_tok > num_experts) {
        return bad("num_experts_per_tok=", num_experts_per_tok,
                   " must be in [1, num_experts=", num_experts, "]");
      }
      if (moe_intermediate_size <= 0) {
        return bad("moe_intermediate_size must be positive, got ", moe_intermediate_size);
      }
    }
  }
  if (num_heads % num_kv_heads != 0) {
    return bad("num_attention_heads=", num_heads,
               " is not a multiple of num_key_value_heads=", num_kv_heads);
  }
  // rms_norm_eps only guards the division by the rms: real checkpoints use
  // 1e-6 (Qwen3, Qwen3.5/3.6) or 1e-5; one of 1 or more would outweigh the
  // mean square of unit-scale activations and flatten every norm.
  if (!(rms_norm_eps > 0 && rms_norm_eps < 1)) {
    return bad("rms_norm_eps must be in (0, 1), got ", rms_norm_eps);
  }
  // RoPE bases in released models run from 1e4 (the RoPE paper, Llama 2) to
  // 1e7 (Qwen3.5/3.6, Qwen2.5-1M), with 1e6 (Qwen2.5, Qwen3) and 5e6 (Qwen3
  // 2507) between. A base of 1 or less makes the inverse frequencies
  // theta^(-2i/d) grow along the head instead of decay (1e-300 overflows them
  // to inf and serves NaN); one past 1e12 is five orders of magnitude beyond
  // any released model, a corrupted field rather than a design. The range
  // keeps three orders of magnitude of margin below what exists.
  constexpr double kMinRopeTheta = 10, kMaxRopeTheta = 1e12;
  if (!(rope_theta >= kMinRopeTheta && rope_theta <= kMaxRopeTheta)) {
    return bad("rope_theta must be in [", kMinRopeTheta, ", ", kMaxRopeTheta, "], got ",
               rope_theta);
  }
  if (!(partial_rotary_factor > 0 && partial_rotary_factor <= 1)) {
    return bad("partial_rotary_factor must be in (0, 1], got ", partial_rotary_factor);
  }
  const int64_t rot = rotary_dim();
  if (rot <= 0 || rot % 2 != 0 || rot > head_dim) {
    return bad("rotary dim ", rot, " (head_dim=", head_dim,
               " x partial_rotary_factor=", partial_rotary_factor,
               ") must be even, positive and at most head_dim");
  }
  if (static_cast<int64_t>(layer_types.size()) != num_layers) {
    return bad("layer_types has ", layer_types.size(), " entries, num_hidden_layers=", num_layers);
  }
  if (features.linear_attention) {
    const struct {
      absl::string_view name;
      int64_t value;
    } linear[] = {
        {"linear_conv_kernel_dim", linear_conv_kernel},
        {"linear_key_head_dim", linear_key_head_dim},
        {"linear_value_head_dim", linear_value_head_dim},
        {"linear_num_key_heads", linear_num_key_heads},
        {"linear_num_value_heads", linear_num_value_heads},
    };
    for (const auto& s : linear) {
      if (s.value <= 0) return bad(s.name, " must be positive, got ", s.value);
    }
    if (linear_num_value_heads % linear_num_key_heads != 0) {
      return bad("linear_num_value_heads=", linear_num_value_heads,
                 " is not a multiple of linear_num_key_heads=", linear_num_key_heads);
    }
  } else {
    for (size_t i = 0; i < layer_types.size(); ++i) {
      if (layer_types[i] != LayerKind::kFullAttention) {
        return bad("layer ", i, " is linear_attention, which ", std::string(ArchName(arch)),
                   " does not have");
      }
    }
  }
  if (quantization.enabled &&
      (quantization.block_rows != kFp8BlockSize || quantization.block_cols != kFp8BlockSize)) {
    return bad("quantization_config.weight_block_size [", quantization.block_rows, ", ",
               quantization.block_cols, "] is not supported (only [", kFp8BlockSize, ", ",
               kFp8BlockSize, "])");
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
