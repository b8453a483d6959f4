// What the MoE goldens (tests/data/make_moe_goldens.py) add to the dense ones:
// the MoE metadata and both HF runs' router logits, and from them the tokens
// whose routing is a near-tie, on which a bf16 run may take another expert.
#ifndef DRAFTFEED_TESTS_SERVER_MODEL_GOLDEN_MOE_ROUTING_H_
#define DRAFTFEED_TESTS_SERVER_MODEL_GOLDEN_MOE_ROUTING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/model/safetensors.h"

namespace draftfeed {

struct MoeGoldens {
  int64_t experts = 0;                 // 0: a dense model's goldens, nothing else is set
  int64_t top_k = 0;                   // experts per token
  std::vector<std::string> mlp_types;  // per layer: "moe" or "dense"
  // Per sequence: [T, N, E] router logits of HF fp32 / bf16 (rows of layers
  // that are not MoE are 0).
  std::vector<std::vector<float>> fp32_router, bf16_router;
};

// Reads the MoE part of goldens file `f` whose sequences have `seq_lens`
// tokens through `num_layers` layers; a file without num_experts metadata is
// a dense model's and gives experts == 0.
absl::StatusOr<MoeGoldens> LoadMoeGoldens(const SafetensorsFile& f, int64_t num_layers,
                                          const std::vector<int64_t>& seq_lens);

// Routing is discontinuous: a token whose k-th and (k+1)-th fp32 router
// logits z_(k), z_(k+1) are closer than the bf16 noise on them may take
// another expert in any bf16 run, and which such tokens flip depends on the
// exact noise (HF-bf16 flips 4-18 tokens per layer of qwen35_moe, ours others).
// Logits, not softmax probabilities, because the noise adds to the logits: a
// flip needs |Δz_a − Δz_b| > z_(k) − z_(k+1), and |Δz_a − Δz_b| <= 2 max|Δz|.
// tau is 2x the largest max_e |Δz_e| of HF-bf16 vs fp32 at the first MoE
// layer, over every token of every sequence: that layer's router input carries
// the bf16 rounding of one block and no earlier flip (later layers' |Δz| mix
// in the flips and the GDN amplification: qwen35_moe's reaches 1.1). Measured
// on the goldens: tau = 0.178 (qwen35_moe), 0.080 (qwen3_moe), and every token
// that HF-bf16 routes differently (35 and 10) has, at its first differing
// layer, a gap under 2x its own |Δz| there; all but one of qwen35_moe's have
// one under tau. A token is near-tie if its gap is under tau at any MoE layer
// (a flip at layer l changes its state, hence its routing, after l).
// The tokens after a flip in the same sequence stay in: in qwen3_moe, HF-bf16's
// last-layer per-token cosine to fp32 of the tokens after a flip (min 0.99993,
// 155 tokens) equals that of tokens before any flip (0.99993, 175); in
// qwen35_moe it is lower (0.972 vs 0.998, 262 vs 43 tokens) but those are the
// later positions, where its tiny GDN heads amplify bf16 error anyway, and
// whatever a neighbour's flip spreads is in HF's error on the same tokens too.
struct NearTies {
  double tau = 0;
  std::vector<std::vector<bool>> stable;  // per sequence, per token: not a near-tie
  int64_t near_tie = 0, total = 0;
};

// `g` must be an MoE model's (experts > 0) with at least one MoE layer.
NearTies FindNearTies(const MoeGoldens& g);

}  // namespace draftfeed

#endif  // DRAFTFEED_TESTS_SERVER_MODEL_GOLDEN_MOE_ROUTING_H_
