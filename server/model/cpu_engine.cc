// CPU reference forward of the Qwen3.5 hybrid and of Qwen3 dense, and of
// their MoE variants, as transformers' Qwen3_5(_moe) and Qwen3(_moe) modeling
// compute them. Everything is fp32:
// weights are widened once in Create, the residual stream and every
// intermediate stay fp32, and none of transformers' intermediate bf16
// roundings are replayed, so this is the oracle that HF run in fp32 is
// compared with. Every op is row-local or per sequence, so a
// sequence's states do not depend on what else is packed with it.
#include "server/model/cpu_engine.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fp8_capture.h"
#include "common/status_macros.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gdn.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"
#include "server/model/cpu_forward.h"
#include "server/model/weight_layout.h"

namespace draftfeed {
namespace {

// transformers' torch_chunk_gated_delta_rule and FLA both use 64.
constexpr int64_t kGdnChunk = 64;
// L2 norm of the GDN q/k, x / sqrt(Σx² + ε): ε is fixed, not rms_norm_eps.
constexpr float kGdnL2Eps = 1e-6f;

using Buffer = CpuForward::Buffer;

// Checks that a tensor is the one weight_layout.h expects.
absl::Status CheckWeight(const ModelWeights& weights, const WeightSpec& spec) {
  const Tensor& t = WeightSlot(weights, spec);
  if (!t.valid()) {
    return absl::InvalidArgumentError(absl::StrCat("weight ", spec.name, " is missing"));
  }
  if (t.shape != spec.shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight ", spec.name, " has shape ", t.ShapeString(), ", expected [",
                     absl::StrJoin(spec.shape, ", "), "] (", spec.origin, ")"));
  }
  // FP8 weights are widened by ToFloat (dequantized with their block scales);
  // embed_tokens, read in place below, is never FP8 (the loader refuses it).
  if (t.dtype != DType::kBF16 && t.dtype != DType::kF16 && t.dtype != DType::kF32 &&
      !(t.fp8() && spec.fp8_eligible)) {
    return absl::InvalidArgumentError(absl::StrCat("weight ", spec.name, " has unsupported dtype ",
                                                   std::string(DTypeName(t.dtype))));
  }
  return absl::OkStatus();
}

absl::StatusOr<Buffer> Widen(const ModelWeights& weights, const WeightSpec& spec) {
  DF_RETURN_IF_ERROR(CheckWeight(weights, spec));
  return ToFloat(WeightSlot(weights, spec));
}

// q_proj of Qwen3.5 interleaves per head: rows [2hd·h, 2hd·h + hd) are the
// query of head h and the next hd rows its gate (not two contiguous halves). Splitting them here
// makes Q and G two dense GEMM outputs.
void SplitQueryGate(const Buffer& q_proj, int64_t heads, int64_t hd, int64_t d, Buffer& wq,
                    Buffer& wg) {
  const int64_t block = hd * d;
  wq.resize(static_cast<size_t>(heads * block));
  wg.resize(static_cast<size_t>(heads * block));
  for (int64_t h = 0; h < heads; ++h) {
    std::copy_n(q_proj.data() + 2 * h * block, block, wq.data() + h * block);
    std::copy_n(q_proj.data() + (2 * h + 1) * block, block, wg.data() + h * block);
  }
}

void AddInto(Buffer& h, const Buffer& m) {
  for (size_t i = 0; i < h.size(); ++i) h[i] += m[i];
}

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace

// Where the widened copy of a layer tensor goes.
CpuForward::Buffer* CpuForward::LayerSlot(LayerF32& l, Tensor LayerWeights::*member) {
  const std::pair<Tensor LayerWeights::*, Buffer*> slots[] = {
      {&LayerWeights::input_layernorm, &l.input_norm},
      {&LayerWeights::post_attention_layernorm, &l.post_norm},
      {&LayerWeights::gate_proj, &l.gate},
      {&LayerWeights::up_proj, &l.up},
      {&LayerWeights::down_proj, &l.down},
      {&LayerWeights::q_proj, &l.attn.wq},
      {&LayerWeights::k_proj, &l.attn.wk},
      {&LayerWeights::v_proj, &l.attn.wv},
      {&LayerWeights::o_proj, &l.attn.wo},
      {&LayerWeights::q_norm, &l.attn.q_norm},
      {&LayerWeights::k_norm, &l.attn.k_norm},
      {&LayerWeights::in_proj_qkv, &l.gdn.w_qkv},
      {&LayerWeights::in_proj_z, &l.gdn.w_z},
      {&LayerWeights::in_proj_b, &l.gdn.w_b},
      {&LayerWeights::in_proj_a, &l.gdn.w_a},
      {&LayerWeights::conv1d, &l.gdn.conv},
      {&LayerWeights::A_log, &l.gdn.a_log},
      {&LayerWeights::dt_bias, &l.gdn.dt_bias},
      {&LayerWeights::norm, &l.gdn.norm},
      {&LayerWeights::out_proj, &l.gdn.w_out},
      {&LayerWeights::router, &l.moe.router},
      {&LayerWeights::experts_gate_up, &l.moe.experts_gate_up},
      {&LayerWeights::experts_down, &l.moe.experts_down},
      {&LayerWeights::shared_gate_proj, &l.moe.shared_gate},
      {&LayerWeights::shared_up_proj, &l.moe.shared_up},
      {&LayerWeights::shared_down_proj, &l.moe.shared_down},
      {&LayerWeights::shared_expert_gate, &l.moe.shared_expert_gate},
  };
  for (const auto& [m, dst] : slots) {
    if (m == member) return dst;
  }
  std::abort();  // weight_layout.h names a layer tensor this engine does not know
}

void CpuForward::Linear(const Buffer& x, const Buffer& w, int64_t rows, int64_t out_dim,
                        int64_t in_dim, Buffer& y) const {
  y.resize(static_cast<size_t>(rows * out_dim));
  cpu::Gemm(x.data(), w.data(), y.data(), rows, out_dim, in_dim, threads_);
}

absl::Status CpuForward::Load(const std::vector<WeightSpec>& specs) {
  const ModelConfig& c = rank_.config;
  const ModelWeights& weights = *rank_.weights;
  if (weights.layers.size() != static_cast<size_t>(c.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model has ", weights.layers.size(), " layers of weights, config says ", c.num_layers));
  }
  norm_kind_ = c.features.norm == NormConvention::kOffsetOne ? cpu::RmsNormKind::kZeroCentred
                                                             : cpu::RmsNormKind::kMultiplicative;
  eps_ = static_cast<float>(c.rms_norm_eps);
  layers_.resize(static_cast<size_t>(c.num_layers));

  for (const WeightSpec& spec : specs) {
    if (spec.layer < 0 && spec.global == &ModelWeights::embed_tokens) {
      // Gathered straight from storage (a real table is vocab x D, too big to
      // widen), unless it is not aligned for its element type.
      DF_RETURN_IF_ERROR(CheckWeight(weights, spec));
      const Tensor& t = weights.embed_tokens;
      if (reinterpret_cast<uintptr_t>(t.data) % DTypeSize(t.dtype) != 0) embed_f32_ = ToFloat(t);
      continue;
    }
    DF_ASSIGN_OR_RETURN(Buffer w, Widen(weights, spec));
    if (spec.layer < 0) {  // the only other global decoder tensor
      final_norm_ = std::move(w);
      continue;
    }
    LayerF32& l = layers_[static_cast<size_t>(spec.layer)];
    if (spec.member == &LayerWeights::q_proj && c.features.gated_attention) {
      SplitQueryGate(w, c.num_heads, c.head_dim, c.hidden_size, l.attn.wq, l.attn.wg);
    } else {
      *LayerSlot(l, spec.member) = std::move(w);
    }
  }
  return absl::OkStatus();
}

void CpuForward::Embed(const ForwardInput& in, float* h) const {
  const Tensor& t = rank_.weights->embed_tokens;
  const int64_t n = static_cast<int64_t>(in.token_ids.size());
  const int64_t vocab = rank_.config.vocab_size, d = rank_.config.hidden_size;
  if (!embed_f32_.empty()) {
    cpu::EmbeddingF32(embed_f32_.data(), vocab, d, in.token_ids.data(), n, h);
  } else if (t.dtype == DType::kBF16) {
    cpu::EmbeddingBf16(reinterpret_cast<const uint16_t*>(t.data), vocab, d, in.token_ids.data(), n,
                       h);
  } else if (t.dtype == DType::kF16) {
    cpu::EmbeddingFp16(reinterpret_cast<const uint16_t*>(t.data), vocab, d, in.token_ids.data(), n,
                       h);
  } else {
    cpu::EmbeddingF32(reinterpret_cast<const float*>(t.data), vocab, d, in.token_ids.data(), n, h);
  }
}

// Full attention: Qwen3.5's with the sigmoid output gate, Qwen3's without.
void CpuForward::Attention(int64_t layer, const LayerF32& w, const Batch& b, const Buffer& u,
                           Buffer& m) const {
  const ModelConfig& c = rank_.config;
  const int64_t t = b.tokens, d = c.hidden_size, hd = c.head_dim;
  const int64_t hq = c.num_heads, hkv = c.num_kv_heads;
  Buffer q, k, v, o(static_cast<size_t>(t * hq * hd));
  Linear(u, w.attn.wq, t, hq * hd, d, q);
  Linear(u, w.attn.wk, t, hkv * hd, d, k);
  Linear(u, w.attn.wv, t, hkv * hd, d, v);
  if (c.features.qk_norm) {  // per-head norms come before RoPE
    cpu::RmsNorm(q.data(), w.attn.q_norm.data(), t * hq, hd, eps_, norm_kind_, q.data());
    cpu::RmsNorm(k.data(), w.attn.k_norm.data(), t * hkv, hd, eps_, norm_kind_, k.data());
  }
  const float theta = static_cast<float>(c.rope_theta);
  cpu::ApplyRope(q.data(), t, hq, hd, c.rotary_dim(), b.positions.data(), theta);
  cpu::ApplyRope(k.data(), t, hkv, hd, c.rotary_dim(), b.positions.data(), theta);
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  if (b.resume == 0 && !b.carry_last) {
    cpu::VarlenCausalAttention(q.data(), k.data(), v.data(), b.cu.data(), b.num_seqs(), hq, hkv,
                               hd, scale, o.data(), threads_);
  } else {
    CarriedAttention(layer, b, q, std::move(k), std::move(v), scale, o);
  }
  if (!w.attn.wg.empty()) {
    Buffer gate;
    Linear(u, w.attn.wg, t, hq * hd, d, gate);
    for (size_t i = 0; i < o.size(); ++i) o[i] *= Sigmoid(gate[i]);
  }
  Linear(o, w.attn.wo, t, d, hq * hd, m);
}

// A Gated DeltaNet layer: projections, causal conv + SiLU, L2-normed q/k, gates, the chunked
// gated delta rule, the gated norm and out_proj.
void CpuForward::GatedDeltaNet(int64_t layer, const LayerF32& w, const Batch& b,
                               const Buffer& u, Buffer& m) const {
  const ModelConfig& c = rank_.config;
  const int64_t t = b.tokens, d = c.hidden_size;
  const int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t channels = 2 * nk * dk + nv * dv;
  Buffer x, z, beta_logit, a;
  Linear(u, w.gdn.w_qkv, t, channels, d, x);
  Linear(u, w.gdn.w_z, t, nv * dv, d, z);
  Linear(u, w.gdn.w_b, t, nv, d, beta_logit);
  Linear(u, w.gdn.w_a, t, nv, d, a);

  // Channel order q | k | v, as in_proj_qkv's rows; the conv output is read in place by all
  // three through token strides.
  Buffer y(static_cast<size_t>(t * channels));
  CpuSequenceCarry::Layer* carried =
      b.carry != nullptr ? &b.carry->layers[static_cast<size_t>(layer)] : nullptr;
  cpu::CausalConv1dSilu(x.data(), w.gdn.conv.data(), b.cu.data(), b.num_seqs(), channels,
                        c.linear_conv_kernel, y.data(),
                        b.resume > 0 ? carried->conv_tail.data() : nullptr);
  if (b.carry_last) {
    carried->conv_tail = CarriedConvTail(b, x, channels, c.linear_conv_kernel, carried->conv_tail);
  }
  float* q = y.data();
  float* k = y.data() + nk * dk;
  const float* v = y.data() + 2 * nk * dk;
  const float q_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
  cpu::L2NormHeads(q, t, nk, dk, channels, kGdnL2Eps, q_scale);
  cpu::L2NormHeads(k, t, nk, dk, channels, kGdnL2Eps, 1.0f);

  Buffer g(static_cast<size_t>(t * nv)), beta(static_cast<size_t>(t * nv));
  cpu::GdnGates(a.data(), beta_logit.data(), w.gdn.a_log.data(), w.gdn.dt_bias.data(), t, nv,
                g.data(), beta.data());

  Buffer o(static_cast<size_t>(t * nv * dv));
  cpu::DeltaRuleArgs args;
  args.q = q;
  args.q_stride = channels;
  args.k = k;
  args.k_stride = channels;
  args.v = v;
  args.v_stride = channels;
  args.g = g.data();
  args.beta = beta.data();
  args.o = o.data();
  args.cu_seqlens = b.cu.data();
  args.num_seqs = b.num_seqs();
  args.num_k_heads = nk;
  args.num_v_heads = nv;
  args.key_dim = dk;
  args.value_dim = dv;
  Buffer final_state(b.carry_last ? static_cast<size_t>(nv * dk * dv) : 0);
  if (b.resume > 0) args.initial_state = carried->state.data();
  if (b.carry_last) args.final_state = final_state.data();
  cpu::GatedDeltaRuleChunked(args, kGdnChunk, threads_);
  if (b.carry_last) carried->state = std::move(final_state);

  cpu::GatedRmsNorm(o.data(), z.data(), w.gdn.norm.data(), t * nv, dv, eps_, o.data());
  Linear(o, w.gdn.w_out, t, d, nv * dv, m);
}

// The dense MLP: down_proj(SiLU(gate_proj(u)) ⊙ up_proj(u)).
void CpuForward::Ffn(const LayerF32& w, const Batch& b, const Buffer& u, Buffer& m) const {
  const ModelConfig& c = rank_.config;
  const int64_t t = b.tokens, d = c.hidden_size, f = c.intermediate_size;
  Buffer gate, up;
  Linear(u, w.gate, t, f, d, gate);
  Linear(u, w.up, t, f, d, up);
  cpu::SwiGlu(gate.data(), up.data(), t * f, gate.data());
  Linear(gate, w.down, t, d, f, m);
}

// The mixture of experts: router logits u·W_gᵀ, fp32 softmax and top-k
// (renormalised as the config says), the routed SwiGLU experts summed by
// weight, plus (Qwen3.5-MoE) the shared expert scaled by
// sigmoid(u·shared_expert_gateᵀ).
void CpuForward::Moe(const LayerF32& w, const Batch& b, const Buffer& u, Buffer& m) const {
  const ModelConfig& c = rank_.config;
  const int64_t t = b.tokens, d = c.hidden_size;
  const int64_t e = c.num_experts, k = c.num_experts_per_tok;
  Buffer logits;
  Linear(u, w.moe.router, t, e, d, logits);
  std::vector<int32_t> ids(static_cast<size_t>(t * k));
  Buffer weights(static_cast<size_t>(t * k));
  cpu::MoeRoute(logits.data(), t, e, k, c.norm_topk_prob, ids.data(), weights.data());
  m.resize(static_cast<size_t>(t * d));
  cpu::MoeExpertRange(u.data(), t, d, c.moe_intermediate_size, w.moe.experts_gate_up.data(),
                      w.moe.experts_down.data(), rank_.expert_begin, rank_.num_local_experts,
                      ids.data(), weights.data(), k, m.data(), threads_);
  if (c.features.mlp != MlpKind::kMoeSharedExpert) return;
  const int64_t s = c.shared_expert_intermediate_size;
  Buffer gate, up, shared, shared_logit;
  Linear(u, w.moe.shared_gate, t, s, d, gate);
  Linear(u, w.moe.shared_up, t, s, d, up);
  cpu::SwiGlu(gate.data(), up.data(), t * s, gate.data());
  Linear(gate, w.moe.shared_down, t, d, s, shared);
  Linear(u, w.moe.shared_expert_gate, t, 1, d, shared_logit);
  for (int64_t r = 0; r < t; ++r) {
    const float g = Sigmoid(shared_logit[static_cast<size_t>(r)]);
    for (int64_t j = 0; j < d; ++j) m[r * d + j] += g * shared[r * d + j];
  }
}

void CpuForward::Block(BlockKind kind, int64_t layer, const LayerF32& w, const Batch& b,
                       const Buffer& u, Buffer& m) const {
  switch (kind) {
    case BlockKind::kAttention:
      return Attention(layer, w, b, u, m);
    case BlockKind::kGatedDeltaNet:
      return GatedDeltaNet(layer, w, b, u, m);
    case BlockKind::kDenseMlp:
      return Ffn(w, b, u, m);
    case BlockKind::kMoeMlp:
      return Moe(w, b, u, m);
    case BlockKind::kNorms:
      break;  // applied by Run around the blocks
  }
  std::abort();  // BlocksOfLayer gives a mixer and an MLP only
}

void CpuForward::Run(const ForwardInput& in, float* out, const AllReduce& all_reduce,
                     float* final_states, CpuSequenceCarry* carry) const {
  const ModelConfig& c = rank_.config;
  const int64_t d = c.hidden_size;
  const int64_t num_layers = c.num_layers;
  const int64_t k_total = static_cast<int64_t>(in.layers.size());

  Batch b;
  b.tokens = static_cast<int64_t>(in.token_ids.size());
  b.cu.push_back(0);
  for (int32_t len : in.seq_lens) b.cu.push_back(b.cu.back() + len);
  b.positions.resize(static_cast<size_t>(b.tokens));
  cpu::SequencePositions(b.cu.data(), b.num_seqs(), b.positions.data());
  if (in.chunked()) {
    b.resume = in.resume_tokens;
    b.carry_last = in.carry_last;
    b.carry = carry;
    // Sequence 0 goes on from where it stopped.
    for (int32_t t = 0; t < b.cu[1]; ++t) b.positions[static_cast<size_t>(t)] += b.resume;
    carry->layers.resize(static_cast<size_t>(num_layers));
  }

  // Output slot of each capture id (index 0 is the final norm, i + 1 layer i),
  // and how deep the forward has to go.
  std::vector<int64_t> slot(static_cast<size_t>(num_layers + 1), -1);
  int64_t last_layer = -1;
  for (int64_t kk = 0; kk < k_total; ++kk) {
    const int32_t id = in.layers[kk];
    slot[static_cast<size_t>(id + 1)] = kk;
    last_layer = std::max<int64_t>(last_layer, id == kFinalLayerId ? num_layers - 1 : id);
  }
  // Target outputs read the final state: every rank of a group goes the
  // whole depth (their all-reduces pair up), the capture rank keeps it.
  if (in.wants_outputs()) last_layer = num_layers - 1;
  auto capture = [&](const Buffer& state, int64_t kk) {
    if (out == nullptr) return;
    for (int64_t t = 0; t < b.tokens; ++t) {
      std::copy_n(state.data() + t * d, d, out + (t * k_total + kk) * d);
    }
  };

  Buffer h(static_cast<size_t>(b.tokens * d)), u(h.size()), m;
  Embed(in, h.data());
  for (int64_t i = 0; i <= last_layer; ++i) {
    const LayerF32& w = layers_[static_cast<size_t>(i)];
    const LayerBlocks blocks = BlocksOfLayer(c, i);
    cpu::RmsNorm(h.data(), w.input_norm.data(), b.tokens, d, eps_, norm_kind_, u.data());
    Block(blocks.mixer, i, w, b, u, m);
    if (all_reduce) all_reduce(m);
    AddInto(h, m);
    cpu::RmsNorm(h.data(), w.post_norm.data(), b.tokens, d, eps_, norm_kind_, u.data());
    Block(blocks.mlp, i, w, b, u, m);
    if (all_reduce) all_reduce(m);
    AddInto(h, m);
    if (slot[static_cast<size_t>(i + 1)] >= 0) capture(h, slot[static_cast<size_t>(i + 1)]);
  }
  if ((slot[0] >= 0 && out != nullptr) || final_states != nullptr) {
    cpu::RmsNorm(h.data(), final_norm_.data(), b.tokens, d, eps_, norm_kind_, u.data());
    if (slot[0] >= 0) capture(u, slot[0]);
    if (final_states != nullptr) std::copy(u.begin(), u.end(), final_states);
  }
  if (in.chunked()) {
    carry->tokens = TokensCarriedAfter(in);
    if (carry->tokens == 0) carry->Clear();
  }
}

absl::StatusOr<CpuForward> CpuForward::Create(const Rank& rank,
                                              const std::vector<WeightSpec>& specs,
                                              int num_threads) {
  CpuForward f;
  f.rank_ = rank;
  f.threads_ = num_threads > 0 ? num_threads
                               : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  DF_RETURN_IF_ERROR(f.Load(specs));
  return f;
}

absl::StatusOr<int64_t> CpuForward::CaptureElements(const ModelConfig& config,
                                                    const ForwardInput& in) {
  DF_RETURN_IF_ERROR(ValidateForwardInput(config, in, std::numeric_limits<int64_t>::max()));
  return static_cast<int64_t>(in.token_ids.size()) * static_cast<int64_t>(in.layers.size()) *
         config.hidden_size;
}

absl::Status CpuForward::CheckFloatOutput(const ForwardInput& in, int64_t hidden, size_t size,
                                          int64_t n) {
  if (static_cast<int64_t>(size) == n) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "output has ", size, " elements; tokens x layers x hidden = ", in.token_ids.size(), " x ",
      in.layers.size(), " x ", hidden, " = ", n));
}

absl::Status CpuForward::WriteCapture(std::span<const float> states, const ForwardInput& in,
                                      int64_t hidden, std::span<std::byte> out) {
  const auto tokens = static_cast<int64_t>(in.token_ids.size());
  const auto layers = static_cast<int64_t>(in.layers.size());
  const int64_t values = layers * hidden;  // per token
  const int64_t row = tokens > 0 ? static_cast<int64_t>(out.size()) / tokens : 0;
  const int64_t hidden_bytes = CaptureBytesPerToken(in.encoding, layers, hidden);
  if (in.encoding == CaptureEncoding::kFp8E4m3) {
    if (row == hidden_bytes) return EncodeFp8Capture(states, tokens, layers, hidden, out);
    for (int64_t t = 0; t < tokens && values > 0; ++t) {
      DF_RETURN_IF_ERROR(EncodeFp8Capture(states.subspan(t * values, values), 1, layers, hidden,
                                          out.subspan(t * row, hidden_bytes)));
    }
    return absl::OkStatus();
  }
  for (int64_t t = 0; t < tokens; ++t) {
    std::byte* dst = out.data() + t * row;
    const float* src = states.data() + t * values;
    for (int64_t i = 0; i < values; ++i) {
      const uint16_t bits = FloatToBf16(src[i]);
      dst[2 * i] = static_cast<std::byte>(bits & 0xff);
      dst[2 * i + 1] = static_cast<std::byte>(bits >> 8);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuForward::ForwardRows(const ForwardInput& in, const Model& model, int64_t n,
                                     const RunFn& run, CpuTargetOutputs& outputs,
                                     std::span<std::byte> out) {
  const int64_t d = model.config.hidden_size;
  const auto tokens = static_cast<int64_t>(in.token_ids.size());
  std::vector<float> states(static_cast<size_t>(n));
  std::vector<float> final_states(static_cast<size_t>(in.wants_outputs() ? tokens * d : 0));
  run(states.data(), in.wants_outputs() ? final_states.data() : nullptr);
  DF_RETURN_IF_ERROR(WriteCapture(states, in, d, out));
  if (!in.wants_outputs()) return absl::OkStatus();
  return outputs.Write(final_states, tokens, *in.outputs, out.data(),
                       RowBytesPerToken(model.config, in),
                       CaptureBytesPerToken(in.encoding, static_cast<int64_t>(in.layers.size()), d));
}

struct CpuEngine::Impl {
  const Model* model = nullptr;
  CpuForward forward;
  std::unique_ptr<CpuTargetOutputs> outputs;
  CpuSequenceCarry carry;

  // Validates the input; returns T·K·H, the number of output elements.
  absl::StatusOr<int64_t> CheckInput(const ForwardInput& in) const {
    DF_ASSIGN_OR_RETURN(const int64_t n, CpuForward::CaptureElements(model->config, in));
    DF_RETURN_IF_ERROR(CheckCarriedInput(in, carry.tokens, carry.max_tokens, "the CPU engine"));
    return n;
  }
};

CpuEngine::CpuEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuEngine::~CpuEngine() = default;

absl::StatusOr<std::unique_ptr<CpuEngine>> CpuEngine::Create(const Model* model, int num_threads) {
  if (model == nullptr) return absl::InvalidArgumentError("CpuEngine::Create: model is null");
  if (model->weights_on_device_random) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", model->id,
                     " is a real-size random model whose weights are made on the GPU; it needs "
                     "the CUDA engine (--device cuda:N)"));
  }
  if (num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_threads is ", num_threads, "; use 0 for one per core, or a count"));
  }
  if (absl::Status st = model->config.Validate(); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("model ", model->id, ": ", st.message()));
  }
  // One rank holding everything.
  CpuForward::Rank rank;
  rank.config = model->config;
  rank.weights = &model->weights;
  rank.num_local_experts = model->config.num_experts;
  absl::StatusOr<CpuForward> forward =
      CpuForward::Create(rank, DecoderWeightSpecs(model->config), num_threads);
  if (!forward.ok()) {
    return absl::Status(forward.status().code(),
                        absl::StrCat("model ", model->id, ": ", forward.status().message()));
  }
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->forward = *std::move(forward);
  impl->outputs = std::make_unique<CpuTargetOutputs>(model, num_threads);
  return std::unique_ptr<CpuEngine>(new CpuEngine(std::move(impl)));
}

const Model& CpuEngine::model() const { return *impl_->model; }

absl::Status CpuEngine::ForwardFloat(const ForwardInput& in, std::span<float> out) {
  DF_ASSIGN_OR_RETURN(const int64_t n, impl_->CheckInput(in));
  DF_RETURN_IF_ERROR(
      CpuForward::CheckFloatOutput(in, impl_->model->config.hidden_size, out.size(), n));
  impl_->forward.Run(in, out.data(), nullptr, nullptr, &impl_->carry);
  return absl::OkStatus();
}

absl::Status CpuEngine::Forward(const ForwardInput& in, std::span<std::byte> out) {
  DF_ASSIGN_OR_RETURN(const int64_t n, impl_->CheckInput(in));
  DF_RETURN_IF_ERROR(CheckCaptureOutput(*this, in, out.size()));
  const CpuForward& forward = impl_->forward;
  return CpuForward::ForwardRows(
      in, *impl_->model, n,
      [&](float* states, float* final_states) {
        forward.Run(in, states, nullptr, final_states, &impl_->carry);
      },
      *impl_->outputs, out);
}

bool CpuEngine::serves_target_outputs() const { return impl_->outputs->served(); }

int64_t CpuEngine::max_carry_tokens() const { return impl_->carry.max_tokens; }

int64_t CpuEngine::CarryBytes(int64_t tokens) const {
  return CpuSequenceCarryBytes(impl_->model->config, tokens);
}

absl::Status CpuEngine::ReserveCarry(int64_t tokens) {
  if (tokens < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot carry ", tokens, " tokens"));
  }
  impl_->carry.max_tokens = tokens;
  return absl::OkStatus();
}

void CpuEngine::DropCarry() { impl_->carry.Clear(); }

}  // namespace draftfeed
