// The decoder tensors a config implies, in one canonical order, with the shape
// each must have and the config fields that fix it. The loader checks
// checkpoints against this list, the writer names tensors from it and the
// fingerprint walks it, so the three cannot drift apart.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "server/model/config.h"
#include "server/model/model.h"
#include "server/model/tensor.h"

namespace draftfeed {

struct WeightSpec {
  std::string name;  // HF suffix after the model prefix, e.g. "layers.3.self_attn.k_proj.weight"
  std::vector<int64_t> shape;
  std::string origin;  // e.g. "num_key_value_heads=2, head_dim=64, hidden_size=128"
  int layer = -1;      // -1 for the global tensors
  Tensor ModelWeights::*global = nullptr;  // set when layer == -1
  Tensor LayerWeights::*member = nullptr;  // set when layer >= 0
};

// Every decoder tensor (not lm_head): embed_tokens, the layers in order, the
// final norm. Expects a validated config.
std::vector<WeightSpec> DecoderWeightSpecs(const ModelConfig& config);

// lm_head.weight, which lives outside the decoder prefix.
WeightSpec LmHeadSpec(const ModelConfig& config);

// The tensor of `weights` that `spec` names (`weights.layers` must be sized).
Tensor& WeightSlot(ModelWeights& weights, const WeightSpec& spec);
const Tensor& WeightSlot(const ModelWeights& weights, const WeightSpec& spec);

}  // namespace draftfeed
