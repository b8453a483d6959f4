// Chunked prefill on the CPU engines: the state of the one sequence a forward
// hands to the next (ForwardInput::resume_tokens, carry_last), per layer of
// one rank, in fp32 as the reference computes it.
#pragma once

#include <cstdint>
#include <vector>

#include "server/model/model.h"


namespace draftfeed {

struct CpuSequenceCarry {
  struct Layer {
    // Attention layers: K (after its norm and RoPE) and V of every token so
    // far, [tokens, kv_heads, head_dim] each.
    std::vector<float> k, v;
    // GDN layers: the conv inputs of the last conv_kernel − 1 tokens
    // ([conv_kernel − 1, channels], zeros before the sequence's start) and
    // the delta rule's state [v_heads, key_dim, value_dim].
    std::vector<float> conv_tail, state;
  };
  int64_t tokens = 0;      // of the carried sequence; 0: none carried
  int64_t max_tokens = 0;  // the longest sequence it may carry (ReserveCarry)
  std::vector<Layer> layers;

  // Forgets the sequence and frees what it held.
  void Clear() {
    tokens = 0;
    layers.clear();
    layers.shrink_to_fit();
  }
};

// Host bytes carrying a sequence of `tokens` tokens takes at most (one rank
// holding the whole model): fp32 K/V per attention layer, conv tail and state
// per GDN layer.
int64_t CpuSequenceCarryBytes(const ModelConfig& config, int64_t tokens);

}  // namespace draftfeed
