// The forward on the compute stream: embedding, then per layer the input
// norm, its mixer block, the post norm and its MLP block (weight_layout's
// BlockKind), the residual adds fused into the next norm (an MoE MLP adds
// into the residual itself), and the captures.
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/attention.cuh"
#include "kernels/elementwise.cuh"
#include "kernels/embedding.cuh"
#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/fp8_gemm_portable.cuh"
#include "kernels/gdn.cuh"
#include "kernels/hopper_gemm.cuh"
#include "kernels/moe.cuh"
#include "kernels/rank_sum.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "server/model/cuda_engine_impl.h"
#include "server/model/device_all_reduce.h"

namespace draftfeed {

absl::Status CudaEngine::Impl::AllReduce(void* buffer, int64_t count, bool bf16_elements) {
  DeviceAllReduce* reduce = options.rank.all_reduce;
  if (reduce == nullptr) return absl::OkStatus();
  return Timed("all_reduce", [&] {
    return reduce->Sum(options.rank.rank, buffer, count, bf16_elements, stream);
  });
}

absl::Status CudaEngine::Impl::QuantizeForFp8(const bf16* x, int64_t T, int64_t K) {
  if (x == x8_source && T == x8_tokens && K == x8_k) return absl::OkStatus();
  if (K > fp8_k_max) return absl::InternalError("FP8 GEMM input wider than its workspace");
  DF_RETURN_IF_ERROR(Timed("fp8_quant", [&] {
    return CudaStatus(cuda::QuantizeActivationsFp8(x, K, T, K, x8, x8_scale, stream),
                      "QuantizeActivationsFp8");
  }));
  NoteProduced(x, T, K, {x8, x8_scale});
  return absl::OkStatus();
}

cuda::Fp8Activations CudaEngine::Impl::Fp8InputOf(const DeviceBlock& b) const {
  bool fp8 = false;
  switch (b.kind) {
    case BlockKind::kAttention:
      fp8 = IsFp8(b, kAttnQkv);
      break;
    case BlockKind::kGatedDeltaNet:
      fp8 = IsFp8(b, kGdnInQkvBA) || IsFp8(b, kGdnZ);
      break;
    case BlockKind::kDenseMlp:
      fp8 = IsFp8(b, kMlpGateUp);
      break;
    case BlockKind::kMoeMlp:
      fp8 = (IsFp8(b, kMoeExpertsGateUp) && IsFp8(b, kMoeExpertsDown)) ||
            (I_shared > 0 && IsFp8(b, kMoeSharedGateUp));
      break;
    case BlockKind::kNorms:
      break;
  }
  if (!fp8 || D > fp8_k_max) return {};
  return {x8, x8_scale};
}

absl::Status CudaEngine::Impl::Project(const DeviceBlock& b, int i, const bf16* x, bf16* y,
                                       int64_t T, int64_t N, int64_t K) {
  if (!IsFp8(b, i)) {
    return Timed("gemm", [&] { return gemm.Run(x, b.bf(i), y, T, N, K, stream); });
  }
  const Fp8Weight& w = b.fp8[static_cast<size_t>(i)];
  DF_RETURN_IF_ERROR(QuantizeForFp8(x, T, K));
  DF_RETURN_IF_ERROR(Timed("gemm", [&] {
    const int64_t m_pad = cuda::Fp8RowsPadded(T), stride = cuda::Fp8ScaleStride(K);
    switch (fp8_gemm_path) {
      case Fp8GemmPath::kHopper:
        return CudaStatus(
            cuda::Fp8BlockGemm(x8_q, x8_s, w.q, w.scale, stride, y, N, m_pad, w.rows, K, stream),
            "Fp8BlockGemm");
      case Fp8GemmPath::kPortable:
        return CudaStatus(cuda::Fp8BlockGemmPortable(x8_q, x8_s, w.q, w.scale, stride, y, N, m_pad,
                                                     w.rows, K, stream),
                          "Fp8BlockGemmPortable");
      case Fp8GemmPath::kCublasLt:
        break;
    }
    return fp8_gemm.Run(x8_q, x8_s, w.q, w.scale, y, m_pad, w.rows, K, stream, N);
  }));
  if (w.rows == N) return absl::OkStatus();
  return Timed("gemm",
               [&] { return gemm.Run(x, b.bf(i), y + w.rows, T, N - w.rows, K, stream, N); });
}

absl::Status CudaEngine::Impl::Block(const DeviceBlock& b, int64_t T, int32_t nseq,
                                     int32_t max_len) {
  // A tensor-parallel rank's mixer or dense MLP output is a partial sum
  // (its output projection is cut along K): summed here, before the residual
  // add. The MoE block sums its own partial (MoeMlp).
  switch (b.kind) {
    case BlockKind::kAttention:
      DF_RETURN_IF_ERROR(Attention(b, T, nseq, max_len));
      return AllReduce(mix, T * D, /*bf16_elements=*/true);
    case BlockKind::kGatedDeltaNet:
      DF_RETURN_IF_ERROR(GatedDeltaNet(b, T, nseq));
      return AllReduce(mix, T * D, /*bf16_elements=*/true);
    case BlockKind::kDenseMlp:
      DF_RETURN_IF_ERROR(DenseMlp(b, T));
      return AllReduce(mix, T * D, /*bf16_elements=*/true);
    case BlockKind::kMoeMlp:
      return MoeMlp(b, T);
    case BlockKind::kNorms:
      break;  // fused into the residual adds by Run
  }
  return absl::InternalError("a layer's mixer or MLP is a norms block");
}

// A Gated DeltaNet layer: in_proj (qkv, b, a fused) and z, causal conv + SiLU, the gated delta
// rule, the gated norm and out_proj.
absl::Status CudaEngine::Impl::GatedDeltaNet(const DeviceBlock& w, int64_t T, int32_t nseq) {
  const float eps = static_cast<float>(model->config.rms_norm_eps);
  DF_RETURN_IF_ERROR(Project(w, kGdnInQkvBA, u, proj, T, p_gdn, D));
  DF_RETURN_IF_ERROR(Project(w, kGdnZ, u, zbuf, T, Nv * dv, D));
  // Chunked prefill: sequence 0 goes on from the carried conv tail and
  // state, the last sequence's are carried on (cuda_sequence_carry.cc).
  CarryLayer* carried =
      resume_now > 0 || carry_last_now ? &carry_layers[static_cast<size_t>(layer_now)] : nullptr;
  DF_RETURN_IF_ERROR(Timed("gdn_conv", [&] {
    return CudaStatus(
        cuda::CausalConv1dSilu(proj, p_gdn, w.bf(kGdnConv), T, C, KC, d_cu, nseq, conv_out, stream,
                               resume_now > 0 ? carried->tail[carry_side] : nullptr),
        "CausalConv1dSilu");
  }));
  if (carry_last_now) DF_RETURN_IF_ERROR(CarryConvTail(proj, T, nseq));
  cuda::GdnArgs g;
  g.qkv = conv_out;
  g.qkv_stride = C;
  g.b = proj + C;
  g.a = proj + C + Nv;
  g.ab_stride = p_gdn;
  g.a_log = w.f32(kGdnALog);
  g.dt_bias = w.f32(kGdnDtBias);
  g.num_tokens = T;
  g.num_k_heads = Nk;
  g.num_v_heads = Nv;
  g.key_dim = dk;
  g.value_dim = dv;
  g.cu_seqlens = d_cu;
  g.num_seqs = nseq;
  g.out = core;
  if (resume_now > 0) g.initial_state = carried->state[carry_side];
  if (carry_last_now) g.final_state = carried->state[1 - carry_side];
  DF_RETURN_IF_ERROR(Timed("gdn_rule", [&] {
    return CudaStatus(cuda::GatedDeltaRule(g, gdn_ws, stream), "GatedDeltaRule");
  }));
  // out_proj's FP8 operand comes from the quantizer (Project), not from this
  // norm: fused, its 128-wide rows ran slower than the two passes
  // (docs/performance.md, "Figures behind the code's choices").
  DF_RETURN_IF_ERROR(Timed("norm", [&] {
    return CudaStatus(
        cuda::GatedRmsNorm(core, zbuf, dv, w.bf(kGdnNorm), T * Nv, dv, eps, normed, stream),
        "GatedRmsNorm");
  }));
  return Project(w, kGdnOut, normed, mix, T, D, Nv * dv);
}

// Full attention, Qwen3.5's gated form (the sigmoid output gate interleaved
// per head in q_proj) or Qwen3's plain one.
absl::Status CudaEngine::Impl::Attention(const DeviceBlock& w, int64_t T, int32_t nseq,
                                         int32_t max_len) {
  const float eps = static_cast<float>(model->config.rms_norm_eps);
  DF_RETURN_IF_ERROR(Project(w, kAttnQkv, u, proj, T, p_attn, D));
  const int64_t q_head_stride = gated ? 2 * hd : hd;
  bf16* q = proj;
  bf16* k = proj + q_rows;
  bf16* v = k + Hkv * hd;
  if (qk_norm) {
    DF_RETURN_IF_ERROR(Timed("norm", [&]() -> absl::Status {
      for (int64_t h = 0; h < Hq; ++h) {
        cudaError_t e = cuda::RmsNormBf16InPlace(q + h * q_head_stride, p_attn, w.bf(kAttnQNorm), T,
                                                 hd, eps, norm_kind, stream);
        if (e != cudaSuccess) return CudaError(e, "q_norm");
      }
      for (int64_t h = 0; h < Hkv; ++h) {
        cudaError_t e = cuda::RmsNormBf16InPlace(k + h * hd, p_attn, w.bf(kAttnKNorm), T, hd, eps,
                                                 norm_kind, stream);
        if (e != cudaSuccess) return CudaError(e, "k_norm");
      }
      return absl::OkStatus();
    }));
  }
  const float theta = static_cast<float>(model->config.rope_theta);
  DF_RETURN_IF_ERROR(Timed("rope", [&]() -> absl::Status {
    cudaError_t e = cuda::ApplyRope(q, T, Hq, hd, p_attn, q_head_stride, R, d_pos, theta, stream);
    if (e == cudaSuccess) e = cuda::ApplyRope(k, T, Hkv, hd, p_attn, hd, R, d_pos, theta, stream);
    return CudaStatus(e, "ApplyRope");
  }));
  cuda::AttentionArgs a;
  a.q = q;
  a.q_stride = p_attn;
  a.q_head_stride = q_head_stride;
  a.k = k;
  a.k_stride = p_attn;
  a.v = v;
  a.v_stride = p_attn;
  a.num_tokens = T;
  a.num_q_heads = Hq;
  a.num_kv_heads = Hkv;
  a.head_dim = hd;
  a.cu_seqlens = d_cu;
  a.num_seqs = nseq;
  a.max_seqlen = max_len;
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  a.out = core;
  if (resume_now > 0 || carry_last_now) {
    DF_RETURN_IF_ERROR(CarriedAttention(q, q_head_stride, k, v, T, nseq, a.scale));
  } else {
    DF_RETURN_IF_ERROR(Timed("attention", [&] {
      return CudaStatus(cuda::VarlenCausalAttention(a, stream), "VarlenCausalAttention");
    }));
  }
  if (gated) {
    // With FP8 o weights the gate also writes o_proj's quantized input.
    const bool fp8 = IsFp8(w, kAttnO) && Hq * hd <= fp8_k_max && (Hq * hd) % cuda::kFp8Block == 0;
    DF_RETURN_IF_ERROR(Timed("elementwise", [&] {
      if (fp8) {
        return CudaStatus(cuda::SigmoidGateMulQuantizeFp8(core, q + hd, T, Hq, hd, p_attn,
                                                          q_head_stride, {x8, x8_scale}, stream),
                          "SigmoidGateMulQuantizeFp8");
      }
      return CudaStatus(
          cuda::SigmoidGateMul(core, q + hd, T, Hq, hd, p_attn, q_head_stride, stream),
          "SigmoidGateMul");
    }));
    NoteProduced(core, T, Hq * hd,
                 fp8 ? cuda::Fp8Activations{x8, x8_scale} : cuda::Fp8Activations{});
  }
  return Project(w, kAttnO, core, mix, T, D, Hq * hd);
}

// down(SiLU(gate)·up) from the fused [gate; up] projection `proj` of width
// 2·width: with FP8 down weights SwiGLU writes the down GEMM's quantized
// input directly (the same values SwiGlu would store, one pass fewer).
absl::Status CudaEngine::Impl::SwiGluDown(const DeviceBlock& w, int down, int64_t T, int64_t width,
                                          bf16* out) {
  if (IsFp8(w, down) && w.fp8[static_cast<size_t>(down)].rows == D) {
    DF_RETURN_IF_ERROR(Timed("elementwise", [&] {
      return CudaStatus(cuda::SwiGluQuantizeFp8(proj, T, width, x8, x8_scale, stream),
                        "SwiGluQuantizeFp8");
    }));
    NoteProduced(act, T, width, {x8, x8_scale});  // as if SwiGlu had written act first
  } else {
    DF_RETURN_IF_ERROR(Timed("elementwise", [&] {
      return CudaStatus(cuda::SwiGlu(proj, T, width, act, stream), "SwiGlu");
    }));
  }
  return Project(w, down, act, out, T, D, width);
}

// The dense MLP: down_proj(SiLU(gate) * up), gate and up from one fused GEMM.
absl::Status CudaEngine::Impl::DenseMlp(const DeviceBlock& w, int64_t T) {
  DF_ASSIGN_OR_RETURN(const bool fused, FusedMlp(w, kMlpGateUp, kMlpDown, T, F, mix));
  if (fused) return absl::OkStatus();
  DF_RETURN_IF_ERROR(Project(w, kMlpGateUp, u, proj, T, 2 * F, D));
  return SwiGluDown(w, kMlpDown, T, F, mix);
}

// gate_up's GEMM, SwiGLU and down's quantization in one kernel: no bf16
// [gate; up] is written and read back, no SwiGLU pass. Down's operand goes
// into act's bytes (act itself is not written), [pad4(T), width] e4m3 and
// then its scales.
absl::StatusOr<bool> CudaEngine::Impl::FusedMlp(const DeviceBlock& w, int gate_up, int down,
                                                int64_t T, int64_t width, bf16* out) {
  if (!fused_gate_up || !IsFp8(w, gate_up) || !IsFp8(w, down)) return false;
  const Fp8Weight& gu = w.fp8[static_cast<size_t>(gate_up)];
  if (gu.rows != 2 * width || w.fp8[static_cast<size_t>(down)].rows != D) return false;
  const int64_t t_pad = cuda::Fp8RowsPadded(T);
  const size_t q_bytes = static_cast<size_t>(t_pad * width);
  const size_t s_offset = (q_bytes + 15) / 16 * 16;
  if (width % cuda::kFp8Block != 0 ||
      s_offset + static_cast<size_t>(t_pad * (width / cuda::kFp8Block)) * 4 > act_bytes) {
    return false;
  }
  DF_RETURN_IF_ERROR(QuantizeForFp8(u, T, D));
  const cuda::Fp8Activations act8{
      reinterpret_cast<uint8_t*>(act),
      reinterpret_cast<float*>(reinterpret_cast<char*>(act) + s_offset)};
  DF_RETURN_IF_ERROR(Timed("gemm", [&] {
    return CudaStatus(
        cuda::Fp8GemmSwiGluQuantize(x8_q, x8_s, gu.q, gu.scale, cuda::Fp8ScaleStride(D), T, width,
                                    D, act8, stream),
        "Fp8GemmSwiGluQuantize");
  }));
  NoteProduced(act, T, width, act8);
  DF_RETURN_IF_ERROR(Project(w, down, act, out, T, D, width));
  return true;
}

// The mixture of experts, all on the device: router logits (cuBLASLt, bf16
// as transformers rounds them), fp32 softmax top-k, the pairs sorted by
// expert, the grouped gate_up (+ SwiGLU) and down GEMMs, then (Qwen3.5-MoE)
// the shared expert through the dense path into `mix` with its gate logit,
// and one combine that adds Σ_j w·y (+ sigmoid(gate)·shared) into the fp32
// residual, unrounded.
absl::Status CudaEngine::Impl::MoeMlp(const DeviceBlock& w, int64_t T) {
  const int experts = static_cast<int>(E), k = static_cast<int>(top_k);
  DF_RETURN_IF_ERROR(Timed("router", [&]() -> absl::Status {
    DF_RETURN_IF_ERROR(gemm.Run(u, w.bf(kMoeRouter), router_logits, T, E, D, stream));
    return CudaStatus(cuda::MoeTopK(router_logits, E, T, experts, k, renormalize, moe.expert_ids,
                                    moe.weights, stream),
                      "MoeTopK");
  }));
  // An expert-parallel rank keeps the pairs routed to its own experts, by
  // local index; the grouped GEMMs below run over those experts only.
  const int local = static_cast<int>(E_local);
  if (local != experts) {
    DF_RETURN_IF_ERROR(Timed("permute", [&] {
      return CudaStatus(cuda::MoeKeepLocalExperts(moe.expert_ids, T * k,
                                                  static_cast<int>(expert_begin), local, stream),
                        "MoeKeepLocalExperts");
    }));
  }
  DF_RETURN_IF_ERROR(Timed("permute", [&] {
    return CudaStatus(cuda::MoePermute(moe.expert_ids, T, local, k, moe.routing, stream),
                      "MoePermute");
  }));
  if (IsFp8(w, kMoeExpertsGateUp) && IsFp8(w, kMoeExpertsDown)) {
    // FP8 experts: u quantized per token (by the norm; gathered by the
    // kernel), and the SwiGLU activations quantized per expert-sorted row
    // for down by gate_up itself.
    DF_RETURN_IF_ERROR(QuantizeForFp8(u, T, D));
    const Fp8Weight& gu = w.fp8[kMoeExpertsGateUp];
    const Fp8Weight& dn = w.fp8[kMoeExpertsDown];
    const int64_t rows = T * k, rows_pad = cuda::Fp8RowsPadded(rows);
    DF_RETURN_IF_ERROR(Timed("expert_gemm", [&] {
      return CudaStatus(cuda::MoeGateUpSwiGluFp8(x8_q, x8_s, cuda::Fp8RowsPadded(T), gu.q, gu.scale,
                                                 D, I_moe, local, rows, moe.routing, moe.act,
                                                 stream, {moe_act8, moe_act8_scale}),
                        "MoeGateUpSwiGluFp8");
    }));
    DF_RETURN_IF_ERROR(Timed("expert_gemm", [&] {
      return CudaStatus(cuda::MoeDownFp8(moe_act8, moe_act8_scale, rows_pad, dn.q, dn.scale, D,
                                         I_moe, local, rows, moe.routing, moe.y, stream),
                        "MoeDownFp8");
    }));
  } else {
    DF_RETURN_IF_ERROR(Timed("expert_gemm", [&] {
      cudaError_t e = cuda::MoeGateUpSwiGlu(u, D, w.bf(kMoeExpertsGateUp), D, I_moe, local, T * k,
                                            moe.routing, moe.act, stream);
      if (e == cudaSuccess) {
        e = cuda::MoeDown(moe.act, w.bf(kMoeExpertsDown), D, I_moe, local, T * k, moe.routing,
                          moe.y, stream);
      }
      return CudaStatus(e, "MoE expert GEMMs");
    }));
  }
  const bool shared = I_shared > 0;
  if (shared) {
    // Its GEMMs and SwiGLU count under "gemm" and "elementwise" like the
    // dense MLP's (Project times them), its N = 1 gate logit under "router".
    DF_ASSIGN_OR_RETURN(const bool fused,
                        FusedMlp(w, kMoeSharedGateUp, kMoeSharedDown, T, I_shared, mix));
    if (!fused) {
      DF_RETURN_IF_ERROR(Project(w, kMoeSharedGateUp, u, proj, T, 2 * I_shared, D));
      DF_RETURN_IF_ERROR(SwiGluDown(w, kMoeSharedDown, T, I_shared, mix));
    }
    // Its N = 1 gate logit is a row dot of our own, not a cuBLASLt GEMM,
    // whose N = 1 algorithm follows M: a token's gate (and so its state)
    // would round differently with the batch around it.
    DF_RETURN_IF_ERROR(Timed("router", [&] {
      return CudaStatus(
          cuda::RowDot(u, D, w.bf(kMoeSharedGate), T, D, shared_logit, stream), "RowDot");
    }));
  }
  // A tensor-parallel rank's sum (its experts, its slice of the shared
  // expert) is partial: it goes to moe_delta, is summed over the ranks in
  // fp32 and then joins the residual.
  float* target = moe_delta != nullptr ? moe_delta : residual;
  DF_RETURN_IF_ERROR(Timed("moe_combine", [&]() -> absl::Status {
    if (target == moe_delta) {
      DF_CUDA(cudaMemsetAsync(moe_delta, 0, static_cast<size_t>(T * D) * 4, stream));
    }
    return CudaStatus(
        cuda::MoeCombine(moe.y, moe.routing.pair_row, moe.weights, T, k, D, shared ? mix : nullptr,
                         D, shared ? shared_logit : nullptr, 1, target, stream),
        "MoeCombine");
  }));
  if (target == residual) return absl::OkStatus();
  DF_RETURN_IF_ERROR(AllReduce(moe_delta, T * D, /*bf16_elements=*/false));
  return Timed("moe_combine", [&] {
    return CudaStatus(cuda::AddF32(residual, moe_delta, T * D, stream), "AddF32");
  });
}

absl::Status CudaEngine::Impl::Run(const ForwardInput& in, bool sync) {
  DF_CUDA(cudaSetDevice(options.device));
  DF_RETURN_IF_ERROR(ValidateForwardInput(model->config, in, options.max_tokens));
  DF_RETURN_IF_ERROR(
      CheckCarriedInput(in, carry_tokens, carry_max, absl::StrCat("cuda:", options.device)));
  resume_now = in.resume_tokens;
  carry_last_now = in.carry_last;
  const int64_t T = static_cast<int64_t>(in.token_ids.size());
  const int64_t K = static_cast<int64_t>(in.layers.size());
  if (static_cast<int64_t>(in.seq_lens.size()) > options.max_seqs) {
    return absl::InvalidArgumentError(absl::StrCat("batch has ", in.seq_lens.size(),
                                                   " sequences; this engine takes at most ",
                                                   options.max_seqs));
  }
  if (K > options.max_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat(K, " capture layers; this engine has ", options.max_layers, " slots"));
  }
  // Target outputs take the whole forward (lm_head reads the final norm) on
  // every rank, so that a tensor-parallel group's all-reduces pair up; the
  // capturing rank alone computes them. Their buffers are made before any
  // work is enqueued, so that a failed allocation leaves nothing running.
  const bool outputs = in.wants_outputs();
  if (outputs && options.rank.capture) DF_RETURN_IF_ERROR(PrepareTargetOutputs(in, current));
  times.ms.clear();
  const int32_t nseq = static_cast<int32_t>(in.seq_lens.size());
  int32_t max_len = 0;
  h_cu[0] = 0;
  for (int32_t i = 0; i < nseq; ++i) {
    h_cu[i + 1] = h_cu[i] + in.seq_lens[i];
    max_len = std::max(max_len, in.seq_lens[i]);
  }
  std::memcpy(h_ids, in.token_ids.data(), static_cast<size_t>(T) * 4);
  DF_CUDA(cudaMemcpyAsync(d_ids, h_ids, T * 4, cudaMemcpyHostToDevice, stream));
  DF_CUDA(cudaMemcpyAsync(d_cu, h_cu, (nseq + 1) * 4, cudaMemcpyHostToDevice, stream));

  // Which layers to run and where each capture goes.
  std::vector<int64_t> slot_of(static_cast<size_t>(L), -1);
  int64_t final_slot = -1;
  int64_t last = -1;
  for (int64_t s = 0; s < K; ++s) {
    const int32_t id = in.layers[s];
    if (id == kFinalLayerId) {
      final_slot = s;
      last = L - 1;
    } else {
      slot_of[id] = s;
      last = std::max<int64_t>(last, id);
    }
  }
  if (outputs) last = L - 1;
  const float eps = static_cast<float>(model->config.rms_norm_eps);
  DF_RETURN_IF_ERROR(Timed("embed", [&]() -> absl::Status {
    cudaError_t e = cuda::PositionsFromCuSeqlens(d_cu, nseq, T, d_pos, stream);
    if (e == cudaSuccess) e = cuda::EmbeddingLookup(d_ids, T, embed, D, residual, stream);
    return CudaStatus(e, "embedding");
  }));
  if (in.chunked()) DF_RETURN_IF_ERROR(UploadCarriedLayout(in));
  // Each norm that writes u also writes the next block's FP8 operand where
  // that block's projections of u are FP8 (Fp8InputOf), and says so.
  cuda::Fp8Activations fp8 = Fp8InputOf(layers[0].mixer);
  DF_RETURN_IF_ERROR(Timed("norm", [&] {
    return CudaStatus(cuda::RmsNormF32(residual, D, layers[0].norms.bf(kInputNorm), T, D, eps,
                                       norm_kind, u, D, stream, fp8),
                      "RmsNormF32");
  }));
  NoteProduced(u, T, D, fp8);
  for (int64_t l = 0; l <= last; ++l) {
    const Layer& w = layers[static_cast<size_t>(l)];
    layer_now = l;
    DF_RETURN_IF_ERROR(Block(w.mixer, T, nseq, max_len));
    fp8 = Fp8InputOf(w.mlp);
    DF_RETURN_IF_ERROR(Timed("norm", [&] {
      return CudaStatus(cuda::AddRmsNormF32(residual, mix, w.norms.bf(kPostNorm), T, D, eps,
                                            norm_kind, u, stream, fp8),
                        "AddRmsNormF32");
    }));
    NoteProduced(u, T, D, fp8);
    DF_RETURN_IF_ERROR(Block(w.mlp, T, nseq, max_len));
    // After the last layer run no next input is needed: the final norm, when
    // asked for, is written straight into its capture slot below.
    const bf16* next_norm =
        l + 1 < L ? layers[static_cast<size_t>(l + 1)].norms.bf(kInputNorm) : final_norm;
    fp8 = l + 1 < L && l < last ? Fp8InputOf(layers[static_cast<size_t>(l + 1)].mixer)
                                : cuda::Fp8Activations{};
    DF_RETURN_IF_ERROR(Timed("norm", [&]() -> absl::Status {
      if (AddsToResidual(w.mlp)) {
        if (l == last) return absl::OkStatus();
        return CudaStatus(
            cuda::RmsNormF32(residual, D, next_norm, T, D, eps, norm_kind, u, D, stream, fp8),
            "RmsNormF32");
      }
      return CudaStatus(l == last ? cuda::AddResidual(residual, mix, T, D, stream)
                                  : cuda::AddRmsNormF32(residual, mix, next_norm, T, D, eps,
                                                        norm_kind, u, stream, fp8),
                        "AddRmsNormF32");
    }));
    NoteProduced(u, T, D, fp8);
    if (slot_of[l] >= 0 && options.rank.capture) {
      DF_RETURN_IF_ERROR(Timed("capture", [&] {
        return CudaStatus(cuda::CaptureResidual(residual, T, D, capture, K, slot_of[l], stream),
                          "CaptureResidual");
      }));
    }
  }
  if (final_slot >= 0 && options.rank.capture) {
    DF_RETURN_IF_ERROR(Timed("capture", [&] {
      return CudaStatus(cuda::RmsNormF32(residual, D, final_norm, T, D, eps, norm_kind,
                                         capture + final_slot * D, K * D, stream),
                        "final norm");
    }));
  }
  if (outputs && options.rank.capture) DF_RETURN_IF_ERROR(TargetOutputsForward(in, current));
  if (in.chunked()) {
    // The GDN layers wrote the carried-on tails and states to the other side.
    if (carry_last_now) carry_side = 1 - carry_side;
    carry_tokens = TokensCarriedAfter(in);
  }
  capture_tokens = T;
  capture_slots = K;
  if (sync) DF_CUDA(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

}  // namespace draftfeed
