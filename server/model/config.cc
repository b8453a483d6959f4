// The architectures' features and the consistency checks every ModelConfig
// passes, whichever way it was made (config.json, a built-in random model).
#include "server/model/config.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace draftfeed {

std::string_view ArchName(Arch arch) {
  switch (arch) {
    case Arch::kQwen35Hybrid:
      return "qwen3_5";
    case Arch::kQwen3Dense:
      return "qwen3";
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
  }
  return {};
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
  for (const auto& s : sizes) {
    if (s.value <= 0) return bad(s.name, " must be positive, got ", s.value);
  }
  if (num_heads % num_kv_heads != 0) {
    return bad("num_attention_heads=", num_heads,
               " is not a multiple of num_key_value_heads=", num_kv_heads);
  }
  if (!(rms_norm_eps > 0) || !std::isfinite(rms_norm_eps)) {
    return bad("rms_norm_eps must be positive, got ", rms_norm_eps);
  }
  if (!(rope_theta > 0) || !std::isfinite(rope_theta)) {
    return bad("rope_theta must be positive, got ", rope_theta);
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
  return absl::OkStatus();
}

}  // namespace draftfeed
