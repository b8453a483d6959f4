// The CPU reference forward over one rank's weights (internal to the CPU
// engines): CpuEngine is one rank holding everything, ShardedCpuEngine tp
// ranks on threads, each holding its ShardingPlan slices.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/cpu/rmsnorm.h"
#include "server/model/cpu_sequence_carry.h"
#include "server/model/cpu_target_outputs.h"
#include "server/model/engine.h"
#include "server/model/model.h"
#include "server/model/weight_layout.h"

namespace draftfeed {

class CpuForward {
 public:
  using Buffer = std::vector<float>;
  // Sums a block's [T, D] partial output over the ranks, in place; the same
  // value on every rank afterwards. Null for a single rank.
  using AllReduce = std::function<void(Buffer&)>;

  // What the rank holds and computes with. `config` has the rank's head
  // counts and widths (the whole model's for one rank); its num_experts stays
  // whole for the router, and the rank evaluates experts [expert_begin,
  // expert_begin + num_local_experts). `weights` (whose embedding is read
  // in place) must outlive the forward.
  struct Rank {
    ModelConfig config;
    const ModelWeights* weights = nullptr;
    int64_t expert_begin = 0;
    int64_t num_local_experts = 0;
  };

  // Widens the rank's weights, each checked against `specs` (the rank's
  // shapes, DecoderWeightSpecs order), to fp32; the embedding is gathered
  // from storage unless misaligned. Errors name the tensor.
  static absl::StatusOr<CpuForward> Create(const Rank& rank, const std::vector<WeightSpec>& specs,
                                           int num_threads);

  // Writes the [T, K, H] fp32 capture into `out` (null on ranks that do not
  // capture), and the post-final-norm states [T, H] into `final_states` when
  // it is not null (what lm_head reads for target outputs). `in` must have
  // passed ValidateForwardInput. Chunked input (resume_tokens, carry_last)
  // reads and updates `carry`, which must then be non-null and have passed
  // CheckCarriedInput.
  void Run(const ForwardInput& in, float* out, const AllReduce& all_reduce,
           float* final_states = nullptr, CpuSequenceCarry* carry = nullptr) const;

  // What both CPU engines check and write around Run. The capture's element
  // count T x K x H of a valid `in` (any token count: the budget is the
  // service's to enforce); INVALID_ARGUMENT naming the field otherwise.
  static absl::StatusOr<int64_t> CaptureElements(const ModelConfig& config, const ForwardInput& in);
  // INVALID_ARGUMENT naming both sizes unless an fp32 output of `size`
  // elements holds the capture's `n`.
  static absl::Status CheckFloatOutput(const ForwardInput& in, int64_t hidden, size_t size,
                                       int64_t n);
  // The fp32 states as the capture in `in.encoding`: little-endian bf16 bits
  // written bytewise (so `out` needs no alignment), or fp8_e4m3 encoded from
  // the fp32 values (its only error e4m3's rounding). Token t's bytes start
  // at t * RowBytesPerToken (its target outputs, when asked, follow them).
  static absl::Status WriteCapture(std::span<const float> states, const ForwardInput& in,
                                   int64_t hidden, std::span<std::byte> out);
  // What both CPU engines' Forward does after its checks: runs `run` (a
  // forward writing the [T, K, H] states and, when target outputs are asked,
  // the final-norm states), then writes each token's row: the capture, then
  // its target outputs from `outputs`.
  using RunFn = std::function<void(float* states, float* final_states)>;
  static absl::Status ForwardRows(const ForwardInput& in, const Model& model, int64_t n,
                                  const RunFn& run, CpuTargetOutputs& outputs,
                                  std::span<std::byte> out);

 private:
  struct AttentionWeights {
    Buffer wq;  // [Hq*hd, D]: the query rows of q_proj
    Buffer wg;  // [Hq*hd, D]: the output-gate rows (Qwen3.5); empty for Qwen3
    Buffer wk, wv, wo, q_norm, k_norm;
  };
  struct GdnWeights {
    Buffer w_qkv, w_z, w_b, w_a, conv, a_log, dt_bias, norm, w_out;
  };
  struct MoeWeights {
    Buffer router, experts_gate_up, experts_down;
    Buffer shared_gate, shared_up, shared_down, shared_expert_gate;  // empty without one
  };
  struct LayerF32 {
    Buffer input_norm, post_norm, gate, up, down;
    AttentionWeights attn;
    GdnWeights gdn;
    MoeWeights moe;
  };
  struct Batch {
    int64_t tokens = 0;
    std::vector<int32_t> cu;
    std::vector<int32_t> positions;
    int64_t num_seqs() const { return static_cast<int64_t>(cu.size()) - 1; }
    // Chunked prefill (ForwardInput): sequence 0 resumes `resume` tokens in;
    // the last sequence's state goes to `carry` when carry_last.
    int64_t resume = 0;
    bool carry_last = false;
    CpuSequenceCarry* carry = nullptr;
  };

  absl::Status Load(const std::vector<WeightSpec>& specs);
  static Buffer* LayerSlot(LayerF32& l, Tensor LayerWeights::*member);
  void Embed(const ForwardInput& in, float* h) const;
  // `layer`: the layer's id, its slot in the batch's carry.
  void Attention(int64_t layer, const LayerF32& w, const Batch& b, const Buffer& u,
                 Buffer& m) const;
  void GatedDeltaNet(int64_t layer, const LayerF32& w, const Batch& b, const Buffer& u,
                     Buffer& m) const;
  // Chunked prefill (cpu_sequence_carry.cc). Attention of a batch whose first
  // sequence resumes or whose last is carried: sequence 0's keys are the
  // carried ones, then its own; the last sequence's K/V go to the carry.
  void CarriedAttention(int64_t layer, const Batch& b, const Buffer& q, Buffer k, Buffer v,
                        float scale, Buffer& o) const;
  // The conv inputs of the last sequence's last kernel − 1 tokens, from `x`
  // (this batch's, [T, channels]) and, where it resumed, the old tail.
  static Buffer CarriedConvTail(const Batch& b, const Buffer& x, int64_t channels, int64_t kernel,
                                const Buffer& old_tail);
  void Ffn(const LayerF32& w, const Batch& b, const Buffer& u, Buffer& m) const;
  void Moe(const LayerF32& w, const Batch& b, const Buffer& u, Buffer& m) const;
  // The mixer or MLP `kind` of layer `w`: m = block(u) (this rank's part).
  void Block(BlockKind kind, int64_t layer, const LayerF32& w, const Batch& b, const Buffer& u,
             Buffer& m) const;
  void Linear(const Buffer& x, const Buffer& w, int64_t rows, int64_t out_dim, int64_t in_dim,
              Buffer& y) const;

  Rank rank_;
  int threads_ = 1;
  cpu::RmsNormKind norm_kind_ = cpu::RmsNormKind::kZeroCentred;
  float eps_ = 1e-6f;
  Buffer embed_f32_;  // a copy only when the stored table is misaligned for its dtype
  Buffer final_norm_;
  std::vector<LayerF32> layers_;
};

}  // namespace draftfeed
