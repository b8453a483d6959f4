// Device set-up and the one workspace, carved at start-up from the token
// budget so the hot path never allocates.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/payload_checksum.h"
#include "common/status_macros.h"
#include "kernels/hopper_gemm.cuh"
#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/gdn.cuh"
#include "kernels/moe.cuh"
#include "server/model/cuda_device.h"
#include "server/model/cuda_engine_impl.h"

namespace draftfeed {

absl::Status CudaEngine::Impl::CheckFits(size_t bytes, const char* what,
                                         size_t weight_bytes) const {
  size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess || bytes <= free_b) return absl::OkStatus();
  const size_t workspace = work.used() > 0 ? workspace_total : bytes;
  return absl::ResourceExhaustedError(absl::StrCat(
      "cannot hold the ", what, ": it needs ", bytes >> 20, " MiB and ",
      free_b >> 20, " MiB of its ", total_b >> 20, " MiB are free (",
      (total_b - free_b) >> 20, " MiB held by this process's earlier allocations or others). ",
      "Plan: weights ", weight_bytes > 0 ? absl::StrCat(weight_bytes >> 20, " MiB") : "after this",
      ", workspace ", workspace >> 20, " MiB for --max_batch_tokens=", options.max_tokens,
      " x --max_capture_layers=", options.max_layers,
      ", then the carry for --max_sequence_tokens. Lower --max_batch_tokens or "
      "--max_capture_layers for the workspace, --max_sequence_tokens for the carry; split the "
      "weights with --tp, or use an FP8 checkpoint or --quantize fp8"));
}

namespace {

bool AnyMoeLayer(const ModelConfig& c) {
  bool any_moe = false;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    any_moe |= BlocksOfLayer(c, l).mlp == BlockKind::kMoeMlp;
  }
  return any_moe;
}

}  // namespace

absl::Status CudaEngine::Impl::TakeDimensions(const ModelConfig& c) {
  D = c.hidden_size;
  // intermediate_size applies only where some layer has a dense MLP (a
  // Qwen3.5-MoE config has none).
  F = c.has_dense_mlp() ? c.intermediate_size : 0;
  L = c.num_layers;
  Hq = c.num_heads;
  Hkv = c.num_kv_heads;
  hd = c.head_dim;
  R = c.rotary_dim();
  gated = c.features.gated_attention;
  qk_norm = c.features.qk_norm;
  norm_kind = c.features.norm == NormConvention::kOffsetOne ? cuda::NormKind::kZeroCentred
                                                            : cuda::NormKind::kMultiplicative;
  q_rows = Hq * hd * (gated ? 2 : 1);
  p_attn = q_rows + 2 * Hkv * hd;
  if (c.features.linear_attention) {
    Nk = c.linear_num_key_heads;
    Nv = c.linear_num_value_heads;
    dk = c.linear_key_head_dim;
    dv = c.linear_value_head_dim;
    KC = c.linear_conv_kernel;
    C = 2 * Nk * dk + Nv * dv;
    p_gdn = C + 2 * Nv;
  }
  if (!AnyMoeLayer(c)) return absl::OkStatus();
  E = c.num_experts;
  top_k = c.num_experts_per_tok;
  I_moe = c.moe_intermediate_size;
  I_shared = c.features.mlp == MlpKind::kMoeSharedExpert ? c.shared_expert_intermediate_size : 0;
  renormalize = c.norm_topk_prob;
  expert_begin = options.rank.expert_begin;
  E_local = options.rank.num_local_experts > 0 ? options.rank.num_local_experts : E;
  if (expert_begin < 0 || expert_begin + E_local > E) {
    return absl::InvalidArgumentError(absl::StrCat("rank experts [", expert_begin, ", ",
                                                   expert_begin + E_local, ") outside the ", E,
                                                   " experts"));
  }
  // The kernels' limits, checked once here rather than failing a forward.
  if (E > cuda::kMoeMaxExperts || top_k > cuda::kMoeMaxTopK || D % 8 != 0 || I_moe % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA MoE kernels take num_experts <= ", cuda::kMoeMaxExperts,
                     ", num_experts_per_tok <= ", cuda::kMoeMaxTopK,
                     " and hidden_size, moe_intermediate_size multiples of 8; this model has ", E,
                     ", ", top_k, ", ", D, ", ", I_moe));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::OpenDevice(const ModelConfig& c) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError("no CUDA device: use --device cpu");
  }
  if (options.device < 0 || options.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda:", options.device, " does not exist (", count, " devices)"));
  }
  DF_CUDA(cudaSetDevice(options.device));
  DF_RETURN_IF_ERROR(CheckCudaDevice(options.device, c));
  DF_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::SetFp8Width(bool any_fp8) {
  // FP8 weights quantize each GEMM's input first: room for the widest.
  fp8_k_max = any_fp8 ? std::max({D, F, Hq * hd, Nv * dv, I_shared}) : 0;
  fp8_k_max = (fp8_k_max + cuda::kFp8Block - 1) / cuda::kFp8Block * cuda::kFp8Block;
  if (!any_fp8) return absl::OkStatus();
  // FP8 GEMMs need e4m3 tensor cores (sm_89+): refuse now rather than at
  // the first batch.
  return CheckFp8Device(options.device);
}

CudaEngine::Impl::WorkspaceSizes CudaEngine::Impl::SizeWorkspace(bool any_fp8) const {
  const ModelConfig& c = model->config;
  WorkspaceSizes w;
  // In whole FP8 GEMM row groups (cuBLASLt's block-scaled GEMM writes M
  // padded to 4 rows).
  const int64_t T = w.T = cuda::Fp8RowsPadded(options.max_tokens);
  w.any_moe = AnyMoeLayer(c);
  // The shared expert runs through proj and act as the dense MLP does.
  w.ffn_cols = std::max(F, I_shared);
  w.proj_cols = std::max({p_attn, p_gdn, 2 * w.ffn_cols});
  // Every routing of T tokens fits (MoeWorkspaceBytes is the worst case).
  w.moe_bytes = w.any_moe ? cuda::MoeWorkspaceBytes(T, static_cast<int>(E_local),
                                                    static_cast<int>(top_k), D, I_moe)
                          : 0;
  // Only the capturing rank of a group holds capture buffers.
  w.capture_layers = options.rank.capture ? options.max_layers : 0;
  w.sharded_moe = w.any_moe && options.rank.all_reduce != nullptr;
  cuda::GdnArgs probe;
  probe.num_tokens = T;
  probe.num_k_heads = Nk;
  probe.num_v_heads = Nv;
  probe.key_dim = dk;
  probe.value_dim = dv;
  probe.num_seqs = static_cast<int32_t>(options.max_seqs);
  w.gdn_bytes = c.features.linear_attention ? cuda::GdnWorkspaceBytes(probe) : 0;
  w.gemm_ws = 64 << 20;
  // FP8 experts re-quantize their [T·k, I] activations.
  w.moe_rows8 = any_fp8 && w.any_moe ? cuda::Fp8RowsPadded(T * top_k) : 0;
  size_t& total = w.total;
  auto add = [&](size_t bytes) { total += DeviceArena::Round(std::max<size_t>(bytes, 1)); };
  add(T * 4);                                  // ids
  add((options.max_seqs + 1) * 4);             // cu_seqlens
  add(T * 4);                                  // positions
  add(T * D * 4);                              // residual
  add(T * D * 2);                              // u
  add(T * w.proj_cols * 2);                    // proj
  add(T * std::max<int64_t>(Nv * dv, 1) * 2);  // z
  add(T * std::max<int64_t>(C, 1) * 2);        // conv_out
  add(T * std::max(Nv * dv, Hq * hd) * 2);     // core
  add(T * std::max(Nv * dv, Hq * hd) * 2);     // normed
  add(T * D * 2);                              // mix
  add(T * w.ffn_cols * 2);                     // act
  add(T * E * 2);                              // router logits
  add(T * 2);                                  // shared expert gate logit
  add(w.moe_bytes);
  add(w.sharded_moe ? T * D * 4 : 0);  // moe_delta
  add(T * w.capture_layers * D * 2);   // capture, twice
  add(T * w.capture_layers * D * 2);
  add(w.gdn_bytes);
  add(w.moe_rows8 * I_moe);                          // moe_act8
  add(w.moe_rows8 * (I_moe / cuda::kFp8Block) * 4);  // moe_act8_scale
  add(T * fp8_k_max);                                // x8
  add(T * (fp8_k_max / cuda::kFp8Block) * 4);        // x8_scale
  add(w.gemm_ws);
  return w;
}

absl::Status CudaEngine::Impl::CarveWorkspace(const WorkspaceSizes& w) {
  const int64_t T = w.T;
  DF_RETURN_IF_ERROR(CheckFits(w.total, "workspace", 0));
  if (absl::Status s = work.Reserve(w.total); !s.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate the ", w.total >> 20,
                                                     " MiB workspace for a token budget of ", T,
                                                     ": ", s.message()));
  }
  workspace_total = w.total;
  d_ids = work.Take<int32_t>(T);
  d_cu = work.Take<int32_t>(options.max_seqs + 1);
  d_pos = work.Take<int32_t>(T);
  residual = work.Take<float>(T * D);
  u = work.Take<bf16>(T * D);
  proj = work.Take<bf16>(T * w.proj_cols);
  zbuf = work.Take<bf16>(T * std::max<int64_t>(Nv * dv, 1));
  conv_out = work.Take<bf16>(T * std::max<int64_t>(C, 1));
  core = work.Take<bf16>(T * std::max(Nv * dv, Hq * hd));
  normed = work.Take<bf16>(T * std::max(Nv * dv, Hq * hd));
  mix = work.Take<bf16>(T * D);
  act = work.Take<bf16>(T * w.ffn_cols);
  act_bytes = static_cast<size_t>(T * w.ffn_cols * 2);
  router_logits = work.Take<bf16>(T * E);
  shared_logit = work.Take<bf16>(T);
  void* moe_base = work.Take<char>(static_cast<int64_t>(w.moe_bytes));
  if (w.any_moe && moe_base != nullptr) {
    moe = cuda::CarveMoeWorkspace(moe_base, T, static_cast<int>(E_local), static_cast<int>(top_k),
                                  D, I_moe);
  }
  if (w.sharded_moe) moe_delta = work.Take<float>(T * D);
  captures[0] = work.Take<bf16>(T * w.capture_layers * D);
  captures[1] = work.Take<bf16>(T * w.capture_layers * D);
  capture = captures[current];
  gdn_ws = work.Take<char>(static_cast<int64_t>(w.gdn_bytes));
  moe_act8 = work.Take<uint8_t>(w.moe_rows8 * I_moe);
  moe_act8_scale = work.Take<float>(w.moe_rows8 * (I_moe / cuda::kFp8Block));
  x8 = work.Take<uint8_t>(T * fp8_k_max);
  x8_scale = work.Take<float>(T * (fp8_k_max / cuda::kFp8Block));
  gemm_workspace = work.Take<char>(static_cast<int64_t>(w.gemm_ws));
  gemm_workspace_bytes = w.gemm_ws;
  if (gemm_workspace == nullptr) return absl::InternalError("workspace carve overflow");
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::CreateCopyResources(int64_t T) {
  DF_CUDA(cudaMallocHost(&h_ids, T * 4));
  DF_CUDA(cudaMallocHost(&h_cu, (options.max_seqs + 1) * 4));
  DF_CUDA(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  DF_CUDA(cudaMalloc(&d_lanes, 2 * v1::kChecksumLanes * sizeof(*d_lanes)));
  DF_CUDA(cudaMallocHost(&h_lanes, 2 * v1::kChecksumLanes * sizeof(*h_lanes)));
  for (cudaEvent_t& e : copied) {
    // Blocking sync: the copy thread sleeps instead of spinning a core that
    // gRPC and the checksums need.
    DF_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventBlockingSync));
  }
  int lowest_priority = 0, highest_priority = 0;
  DF_CUDA(cudaDeviceGetStreamPriorityRange(&lowest_priority, &highest_priority));
  DF_CUDA(cudaStreamCreateWithPriority(&send_stream, cudaStreamNonBlocking, highest_priority));
  for (cudaEvent_t& e : forwarded) {
    DF_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::InitGemms(bool any_fp8) {
  DF_RETURN_IF_ERROR(gemm.Init(gemm_workspace, gemm_workspace_bytes));
  if (!any_fp8) return absl::OkStatus();
  // The FP8 GEMMs run on the same stream as the bf16 ones: they share the workspace.
  DF_RETURN_IF_ERROR(fp8_gemm.Init(gemm_workspace, gemm_workspace_bytes));
  // cuBLASLt's GEMM on sm_90, else (and under DRAFTFEED_PORTABLE_KERNELS)
  // draftfeed's portable one; 'cublaslt' is refused where it cannot serve.
  DF_ASSIGN_OR_RETURN(fp8_gemm_path, ChooseFp8Gemm(options.device, options.fp8_gemm));
  own_fp8_gemm = fp8_gemm_path != Fp8GemmPath::kCublasLt;
  // The MLPs' gate_up fused with SwiGLU and down's quantization runs on our
  // Hopper kernel, so not where cuBLASLt's GEMM was asked for by name.
  fused_gate_up = cuda::HopperGemmsAvailable() && fp8_gemm_path != Fp8GemmPath::kPortable &&
                  options.fp8_gemm != CudaEngineOptions::Fp8Gemm::kCublasLt;
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::Init(const Model* m, const CudaEngineOptions& opt) {
  model = m;
  options = opt;
  DF_RETURN_IF_ERROR(TakeDimensions(m->config));
  if (options.max_layers <= 0) options.max_layers = L + 1;
  DF_RETURN_IF_ERROR(OpenDevice(m->config));
  bool any_fp8 = false;
  for (const WeightSpec& spec : Specs()) {
    any_fp8 |= spec.layer >= 0 && WeightSlot(m->weights, spec).fp8();
  }
  DF_RETURN_IF_ERROR(SetFp8Width(any_fp8));
  // The workspace, sized once from the token budget.
  const WorkspaceSizes sizes = SizeWorkspace(any_fp8);
  DF_RETURN_IF_ERROR(CarveWorkspace(sizes));
  DF_RETURN_IF_ERROR(CreateCopyResources(sizes.T));
  DF_RETURN_IF_ERROR(InitGemms(any_fp8));
  return UploadWeights();
}

}  // namespace draftfeed
