// CPU reference rotary position embedding, rotate-half style, optionally
// partial (Qwen3.5 rotates the first quarter of each head, Qwen3 all of it).
#pragma once

#include <cstdint>

namespace draftfeed::cpu {

// positions[t] = t − cu_seqlens[s] for the sequence s that holds token t:
// positions restart at 0 in every packed sequence. cu_seqlens has
// num_seqs + 1 entries, starting at 0.
void SequencePositions(const int32_t* cu_seqlens, int64_t num_seqs, int32_t* positions);

// In place on x [num_tokens, num_heads, head_dim] (dense). For every head and
// j < rotary_dim/2, with φ = positions[t]·θ^(−2j/rotary_dim) (inv_freq and φ
// in fp32, as transformers computes them):
//   x[j]        ← x[j]·cos φ − x[j + R/2]·sin φ
//   x[j + R/2]  ← x[j + R/2]·cos φ + x[j]·sin φ
// Dims ≥ rotary_dim are untouched. rotary_dim must be even and ≤ head_dim.
void ApplyRope(float* x, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
               int64_t rotary_dim, const int32_t* positions, float theta);

}  // namespace draftfeed::cpu
