// Internal to the CUDA engine: its state (CudaEngine::Impl) and the arena
// everything device-side is carved from, shared by the files of its jobs:
//   cuda_workspace.cc  device set-up and the workspace, sized once;
//   cuda_weights.cc    weight upload and GPU random init, from weight_layout;
//   cuda_blocks.cc     the forward: per-layer blocks and the capture slots;
//   cuda_capture.cc    the double-buffered capture, its copy thread and the
//                      device sink;
//   cuda_target_outputs.cc  lm_head, its logits and the target outputs
//                      written into whole payload rows;
//   cuda_sequence_carry.cc  chunked prefill: the one sequence carried from a
//                      forward to the next (K/V, conv tails, GDN states);
//   cuda_engine.cc     creation, teardown and the accessors.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/cuda_status.h"
#include "kernels/common.cuh"
#include "kernels/moe.cuh"
#include "kernels/rmsnorm.cuh"
#include "server/model/cuda_device.h"
#include "server/model/cuda_engine.h"
#include "server/model/cuda_fp8_gemm.h"
#include "server/model/cuda_gemm.h"
#include "server/model/weight_layout.h"

namespace draftfeed {

// A bump allocator over one cudaMalloc: everything is carved at start-up.
class DeviceArena {
 public:
  ~DeviceArena() {
    if (base_) cudaFree(base_);
  }
  absl::Status Reserve(size_t bytes) {
    DF_CUDA(cudaMalloc(&base_, bytes));
    size_ = bytes;
    return absl::OkStatus();
  }
  template <typename T>
  T* Take(int64_t n) {
    const size_t bytes =
        (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 255) & ~size_t{255};
    T* p = reinterpret_cast<T*>(static_cast<char*>(base_) + used_);
    used_ += bytes;
    return used_ <= size_ ? p : nullptr;
  }
  static size_t Round(size_t bytes) { return (bytes + 255) & ~size_t{255}; }
  size_t used() const { return used_; }
  // Frees the allocation: what was taken from it is gone.
  void Release() {
    if (base_) cudaFree(base_);
    base_ = nullptr;
    size_ = used_ = 0;
  }

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
  size_t used_ = 0;
};

// Where UploadWeights puts each device tensor (by its index in `specs`,
// Impl::Specs()): a block's device buffer stacks its tensors row after row,
// its FP8 head (the FP8-kept tensors that lead it) as e4m3 rows then fp32
// block scales. Built from the specs; Impl::CarveWeights fills in the places.
struct DeviceWeightPlacement {
  DeviceWeightPlacement(const ModelWeights& weights, std::vector<WeightSpec> all,
                        int64_t num_layers, bool experts_fp8);
  size_t ElementBytes(size_t i) const { return specs[i].device_f32 ? 4 : 2; }
  bool IsFp8(size_t i) const { return WeightSlot(mw, specs[i]).fp8(); }
  int64_t RowsOf(size_t i) const { return specs[i].numel() / specs[i].shape.back(); }
  // The members of one device buffer that layer l has, as spec indices.
  std::vector<size_t> Members(int64_t l, const DeviceBuffer& buffer) const;
  // The rows of a buffer's FP8 head kept FP8 on the device (0: all bf16).
  int64_t Fp8Rows(BlockKind kind, size_t buffer, const std::vector<size_t>& idx) const;
  // Device bytes of a buffer: FP8 head (e4m3 + its scales), then the rest.
  size_t BytesOf(const std::vector<size_t>& idx, int64_t head_rows) const;

  const ModelWeights& mw;
  const std::vector<WeightSpec> specs;
  std::vector<char*> dst;         // bf16 / fp32 places (null for FP8-kept tensors)
  std::vector<uint8_t*> dst_q;    // FP8-kept tensors' e4m3 rows
  std::vector<float*> dst_scale;  // and their scale rows
  size_t embed_index = 0, norm_index = 0;
  bool fp8_expert_gemms = false;              // routed experts stay FP8 (CudaEngineOptions)
  std::vector<std::vector<size_t>> of_layer;  // spec indices of each layer
};

struct CudaEngine::Impl {
  using bf16 = cuda::bf16;

  // A device buffer's FP8 part: its first `rows` rows as e4m3 with fp32
  // block scales (fp8_gemm_operands.cuh's layout). The buffer's other rows
  // (a partly FP8 fused projection's bf16 tail, e.g. GDN's in_proj_b/a) are
  // what `buffers` points at.
  struct Fp8Weight {
    const uint8_t* q = nullptr;
    const float* scale = nullptr;
    int64_t rows = 0;  // 0: the whole buffer is bf16
  };
  // One block's device buffers, in its BlockDeviceBuffers order
  // (weight_layout.h); null where the config has no such tensor.
  struct DeviceBlock {
    BlockKind kind = BlockKind::kNorms;
    std::vector<void*> buffers;
    std::vector<Fp8Weight> fp8;  // beside `buffers`
    bf16* bf(int i) const { return static_cast<bf16*>(buffers[static_cast<size_t>(i)]); }
    float* f32(int i) const { return static_cast<float*>(buffers[static_cast<size_t>(i)]); }
  };
  struct Layer {
    DeviceBlock norms, mixer, mlp;
  };

  const Model* model = nullptr;
  CudaEngineOptions options;
  cudaStream_t stream = nullptr;
  DeviceArena weights;
  DeviceArena work;
  CublasLtGemm gemm;
  CublasLtFp8Gemm fp8_gemm;
  // The dense FP8 projections' GEMM (ChooseFp8Gemm); own_fp8_gemm: one of
  // draftfeed's (Hopper or portable), not cuBLASLt's fp8_gemm.
  Fp8GemmPath fp8_gemm_path = Fp8GemmPath::kCublasLt;
  // CudaEngine::numerics, made once at creation: GetTargetInfo asks for it
  // per call, and the device query behind it is not free.
  std::string numerics;
  bool own_fp8_gemm = false;
  // FP8 MLPs (dense and shared expert) run gate_up, SwiGLU and down's
  // quantization as one kernel (FusedGateUp), writing down's operand into
  // act's bytes; set where our Hopper kernel runs and cuBLASLt was not asked for.
  bool fused_gate_up = false;
  std::vector<Layer> layers;
  bf16* embed = nullptr;
  bf16* final_norm = nullptr;
  cuda::NormKind norm_kind = cuda::NormKind::kZeroCentred;

  // Dimensions.
  int64_t D = 0, F = 0, L = 0, Hq = 0, Hkv = 0, hd = 0, R = 0;
  int64_t C = 0, Nk = 0, Nv = 0, dk = 0, dv = 0, KC = 0;
  int64_t q_rows = 0;  // rows of q_proj: Hq·hd·(2 with the output gate)
  int64_t p_attn = 0, p_gdn = 0;
  bool gated = true;    // features.gated_attention
  bool qk_norm = true;  // features.qk_norm
  // Mixture of experts: E experts of width I_moe, top_k per token, the
  // shared expert's width (0: none).
  int64_t E = 0, top_k = 0, I_moe = 0, I_shared = 0;
  bool renormalize = true;  // config.norm_topk_prob
  // The experts this device evaluates: all E, or an expert-parallel rank's
  // [expert_begin, expert_begin + E_local).
  int64_t E_local = 0, expert_begin = 0;

  // Workspace.
  int32_t* d_ids = nullptr;
  int32_t* d_cu = nullptr;
  int32_t* d_pos = nullptr;
  int32_t* h_ids = nullptr;  // pinned staging
  int32_t* h_cu = nullptr;
  float* residual = nullptr;
  bf16* u = nullptr;
  bf16* proj = nullptr;  // [T, max(p_attn, p_gdn, 2F)]
  bf16* zbuf = nullptr;
  bf16* conv_out = nullptr;
  bf16* core = nullptr;
  bf16* normed = nullptr;
  bf16* mix = nullptr;
  bf16* act = nullptr;
  bf16* router_logits = nullptr;  // [T, E]
  bf16* shared_logit = nullptr;   // [T] the shared expert's gate
  cuda::MoeBuffers moe;           // routing, activations and outputs of the routed experts
  // A sharded MoE block's partial output [T, D], summed over the ranks
  // before it joins the residual (null for a single rank).
  float* moe_delta = nullptr;
  // Double-buffered capture: ForwardAsync copies one buffer to the host on
  // copy_stream while the next forward writes the other. `capture` is the
  // buffer of the current (or last) forward.
  bf16* captures[2] = {nullptr, nullptr};
  bf16* capture = nullptr;
  // fp8_e4m3 payloads, encoded from `captures` after the forward (Payload).
  // Allocated on the first fp8 batch, max_tokens x CaptureBytesPerToken each,
  // so that a target only ever asked for bf16 reserves nothing for them.
  uint8_t* fp8_captures[2] = {nullptr, nullptr};
  int current = 1;
  cudaStream_t copy_stream = nullptr;
  cudaEvent_t copied[2] = {nullptr, nullptr};
  // ForwardToDevice: the sink's work (an NCCL send) runs on send_stream, of
  // the device's highest priority so that its kernel is scheduled while the
  // next forward fills the GPU, ordered after its forward by `forwarded`.
  cudaStream_t send_stream = nullptr;
  cudaEvent_t forwarded[2] = {nullptr, nullptr};
  // Each capture's checksum lanes, computed on copy_stream beside its copy.
  unsigned long long* d_lanes = nullptr;  // [2][kChecksumLanes]
  uint64_t* h_lanes = nullptr;            // [2][kChecksumLanes], pinned
  // The copy thread retires copies (and device sinks' work) in order: it
  // waits for each one's event (or DeviceWait), runs its callback, then frees
  // its buffer for the next forward.
  struct PendingCopy {
    int buffer;
    size_t bytes;
    CopiedCallback on_copied;
    DeviceWait sink_wait;         // ForwardToDevice: waits for the sink's work
    absl::Status forward_status;  // ForwardToDevice: how the forward itself ended
  };
  std::mutex copy_mu;
  std::condition_variable copy_cv;
  std::deque<PendingCopy> pending;  // at most 2: one per buffer
  bool busy[2] = {false, false};    // a copy (or send) out of this buffer is not retired yet
  bool stop_copier = false;
  std::thread copier;
  // Target outputs (cuda_target_outputs.cc), everything made on the first
  // batch that asks for them. A batch with outputs sends whole rows (its
  // hidden capture, then each token's outputs): `rows` are payloads of
  // max_tokens rows of the widest row asked so far, double-buffered with the
  // captures; the outputs are written there by the forward, the hidden part
  // copied in by Payload.
  const bf16* lm_head = nullptr;  // [V, D]: `embed` when tied, else lm_head_owned
  bf16* lm_head_owned = nullptr;
  float* logits = nullptr;  // [logits_tokens, V] fp32: one chunk of tokens
  int64_t logits_tokens = 0;
  uint8_t* rows[2] = {nullptr, nullptr};
  size_t rows_bytes[2] = {0, 0};
  // The draft vocabulary's ids and the kernel's index of them, for the last
  // list asked (rebuilt only when a batch asks another).
  int32_t* draft_ids = nullptr;  // [kMaxDraftVocab]
  void* draft_index = nullptr;   // DraftIndexBytes(V, kMaxDraftVocab)
  std::vector<int32_t> draft_indexed;
  bool draft_built = false;
  void* gdn_ws = nullptr;
  // FP8 GEMM inputs: the activation quantized per token and 128 group, and
  // which activation it holds (set by each norm before a block: to u where
  // the norm wrote it quantized, else to none, as the block's inputs are new).
  uint8_t* x8 = nullptr;      // [T_pad, fp8_k_max]
  float* x8_scale = nullptr;  // [fp8_k_max / 128, T_pad]
  int64_t fp8_k_max = 0;      // 0: no FP8 weights on the device
  // FP8 routed experts: the SwiGLU activations re-quantized for the down GEMM.
  uint8_t* moe_act8 = nullptr;      // [pad4(T·k), I]
  float* moe_act8_scale = nullptr;  // [I / 128, pad4(T·k)]
  const bf16* x8_source = nullptr;
  int64_t x8_tokens = 0, x8_k = 0;
  // Where that quantization lives: x8, or act's bytes after a fused gate_up.
  uint8_t* x8_q = nullptr;
  float* x8_s = nullptr;
  size_t act_bytes = 0;
  // Counts of the FP8 weights by how they run, for the start-up line.
  int64_t fp8_gemm_buffers = 0, fp8_dequantized_buffers = 0;
  void* gemm_workspace = nullptr;
  size_t gemm_workspace_bytes = 0;
  size_t workspace_total = 0;
  int64_t capture_tokens = 0, capture_slots = 0;

  // Chunked prefill (cuda_sequence_carry.cc): the state of the one sequence
  // a forward hands to the next, in its own arena reserved by ReserveCarry.
  // Per layer (null where the layer is of the other kind): an attention
  // layer's K|V of every token so far, [carry_max, 2, Hkv, hd] bf16 (K after
  // its norm and RoPE, then V, per token); a GDN layer's conv inputs of the
  // last KC − 1 tokens [KC − 1, C] bf16 and delta-rule state [Nv, dk, dv]
  // fp32, each a ping-pong pair (carry_side is the carried one) because a
  // packed forward reads one sequence's and writes another's.
  struct CarryLayer {
    bf16* kv = nullptr;
    bf16* tail[2] = {nullptr, nullptr};
    float* state[2] = {nullptr, nullptr};
  };
  DeviceArena carry_arena;
  std::vector<CarryLayer> carry_layers;
  int64_t carry_max = 0;     // ReserveCarry's tokens; 0: chunked input refused
  int64_t carry_tokens = 0;  // of the carried sequence; 0: none
  int carry_side = 0;
  // The forward being enqueued: its layer (Run's loop), sequence 0's resume
  // point and whether its last sequence is carried on.
  int64_t layer_now = 0;
  int64_t resume_now = 0;
  bool carry_last_now = false;
  // A chunked forward's positions (sequence 0 starts at resume_now) and the
  // cu_seqlens of its two attention calls: {0, len0} then the rest rebased.
  int32_t* h_carry_i32 = nullptr;  // pinned: [max_tokens] positions, [2 + max_seqs] cu
  int32_t* d_carry_i32 = nullptr;
  size_t CarryBytes(int64_t tokens) const;
  absl::Status ReserveCarry(int64_t tokens);
  void FreeCarry();
  // Positions and the attention calls' cu_seqlens of a chunked forward,
  // uploaded on `stream` (d_pos then holds the positions).
  absl::Status UploadCarriedLayout(const ForwardInput& in);
  // Attention of a chunked forward, q/k/v as Attention computed them (rows
  // p_attn apart): sequence 0 over its carried keys then its own, the rest
  // as usual; the last sequence's K/V into the carry.
  absl::Status CarriedAttention(const bf16* q, int64_t q_head_stride, const bf16* k, const bf16* v,
                                int64_t T, int32_t nseq, float scale);
  // The conv tail the next forward starts from: the last sequence's last
  // KC − 1 inputs of `x` (rows p_gdn apart), after the carried tail when it
  // is the resumed one.
  absl::Status CarryConvTail(const bf16* x, int64_t T, int32_t nseq);
  OpTimes times;

  template <typename Fn>
  absl::Status Timed(const char* family, Fn&& fn) {
    if (!options.profile) return fn();
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a, stream);
    absl::Status s = fn();
    cudaEventRecord(b, stream);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    for (auto& [name, total] : times.ms) {
      if (name == family) {
        total += ms;
        return s;
      }
    }
    times.ms.emplace_back(family, ms);
    return s;
  }

  absl::Status Init(const Model* m, const CudaEngineOptions& opt);
  // Init's steps (cuda_workspace.cc), in order: the dimensions above from the
  // config (and the MoE kernels' limits), the device and `stream`, the FP8
  // input width (and whether the GPU runs FP8 GEMMs), the workspace sized
  // from the token budget then carved, the copy thread's streams, events and
  // pinned staging, the GEMMs; then UploadWeights.
  absl::Status TakeDimensions(const ModelConfig& c);
  absl::Status OpenDevice(const ModelConfig& c);
  absl::Status SetFp8Width(bool any_fp8);
  struct WorkspaceSizes {
    int64_t T = 0;  // the token budget in whole FP8 GEMM row groups
    int64_t ffn_cols = 0, proj_cols = 0, capture_layers = 0, moe_rows8 = 0;
    size_t moe_bytes = 0, gdn_bytes = 0, gemm_ws = 0;
    size_t total = 0;  // every buffer, each rounded as DeviceArena carves it
    bool any_moe = false, sharded_moe = false;
  };
  WorkspaceSizes SizeWorkspace(bool any_fp8) const;
  absl::Status CarveWorkspace(const WorkspaceSizes& w);
  absl::Status CreateCopyResources(int64_t T);
  absl::Status InitGemms(bool any_fp8);
  // RESOURCE_EXHAUSTED with the memory plan, before anything is allocated,
  // when `bytes` of `what` ("weights", "workspace") cannot fit in what the
  // device has free: free and total memory, the weights and workspace, and
  // which flag lowers which. OK when they fit (the allocation may still fail).
  absl::Status CheckFits(size_t bytes, const char* what, size_t weight_bytes) const;
  // The device's tensors: the rank's shapes, else the config's.
  std::vector<WeightSpec> Specs() const {
    return options.rank.specs.empty() ? DecoderWeightSpecs(model->config) : options.rank.specs;
  }
  // Sums a block's partial output over the tensor-parallel ranks, in place
  // (nothing for a single rank).
  absl::Status AllReduce(void* buffer, int64_t count, bool bf16_elements);
  int TakeBuffer();
  // Hands `job` to the copy thread; its buffer stays busy until it retires.
  void Queue(PendingCopy job);
  size_t CaptureBytes(const ForwardInput& in) const {
    return draftfeed::CaptureBytes(model->config, in);
  }
  // The payload of buffer b's capture in `in.encoding`: the bf16 capture
  // itself, or its fp8_e4m3 encoding, enqueued on `s` (which must be ordered
  // after the forward). With target outputs asked, rows[b] instead: the
  // forward wrote each token's outputs there, and the hidden part is copied
  // in beside them here (cudaMemcpy2DAsync, row pitch RowBytesPerToken).
  absl::StatusOr<const void*> Payload(int b, const ForwardInput& in, cudaStream_t s);
  // Whether lm_head can be had: a checkpoint's, the embedding where tied, or
  // (real-size random models) one drawn on the device.
  bool ServesTargetOutputs() const;
  // Everything a batch with outputs needs, before its forward is enqueued:
  // lm_head on the device, the logits chunk, rows buffer b, the draft index.
  absl::Status PrepareTargetOutputs(const ForwardInput& in, int b);
  absl::Status UploadLmHead();
  // After the final layer: the final norm into `u`, then per chunk of tokens
  // the lm_head GEMM into `logits` and the outputs into rows[b], on `stream`.
  absl::Status TargetOutputsForward(const ForwardInput& in, int b);
  void FreeTargetOutputs();
  void CopyLoop();
  void StopCopier();
  absl::Status UploadWeights();
  // UploadWeights' steps (cuda_weights.cc): the device bytes of every
  // buffer (sizing `layers` by block), one allocation carved buffer by
  // buffer, then the GPU-made values of a random model.
  size_t SizeWeights(const DeviceWeightPlacement& p);
  absl::Status CarveWeights(DeviceWeightPlacement& p);
  void CarveBuffer(DeviceWeightPlacement& p, DeviceBlock& b, size_t j,
                   const std::vector<size_t>& idx);
  absl::Status FillRandomWeights(const DeviceWeightPlacement& p);
  // Enqueues the forward on `stream`; `sync` waits for it (and surfaces
  // errors of its kernels) before returning.
  absl::Status Run(const ForwardInput& in, bool sync = true);
  // mix = block(u) for the mixer or MLP `b` of a layer; an MoE MLP instead
  // adds its output into the residual itself (AddsToResidual).
  absl::Status Block(const DeviceBlock& b, int64_t T, int32_t nseq, int32_t max_len);
  static bool AddsToResidual(const DeviceBlock& b) { return b.kind == BlockKind::kMoeMlp; }
  // y[T, N] = x[T, K]·W_iᵀ for buffer i of block b: cuBLASLt bf16, or
  // the FP8 GEMM on x quantized (once per activation) for an FP8 buffer, with
  // its bf16 tail rows as a second GEMM into the remaining columns.
  absl::Status Project(const DeviceBlock& b, int i, const bf16* x, bf16* y, int64_t T, int64_t N,
                       int64_t K);
  absl::Status QuantizeForFp8(const bf16* x, int64_t T, int64_t K);
  // Where the norm before block b writes u quantized as well: x8, when the
  // block's first projections of u are FP8 GEMMs; else nowhere.
  cuda::Fp8Activations Fp8InputOf(const DeviceBlock& b) const;
  // After a producer of x (T x K) wrote it, quantized into x8 or not.
  void NoteProduced(const bf16* x, int64_t T, int64_t K, const cuda::Fp8Activations& fp8) {
    x8_source = fp8.q != nullptr ? x : nullptr;
    x8_tokens = T;
    x8_k = K;
    x8_q = fp8.q;
    x8_s = fp8.scale;
  }
  // The MLP down(SwiGLU(gate_up(u))) of block w as FusedGateUp and down,
  // where fused_gate_up allows it for these weights; false: not taken.
  absl::StatusOr<bool> FusedMlp(const DeviceBlock& w, int gate_up, int down, int64_t T,
                                int64_t width, bf16* out);
  // out = down(SwiGLU(proj)) for the MLP block w (dense or shared expert).
  absl::Status SwiGluDown(const DeviceBlock& w, int down, int64_t T, int64_t width, bf16* out);
  // Whether buffer i of b is used through FP8 GEMMs (Project).
  static bool IsFp8(const DeviceBlock& b, int i) {
    return static_cast<size_t>(i) < b.fp8.size() && b.fp8[static_cast<size_t>(i)].rows > 0;
  }
  absl::Status Attention(const DeviceBlock& b, int64_t T, int32_t nseq, int32_t max_len);
  absl::Status GatedDeltaNet(const DeviceBlock& b, int64_t T, int32_t nseq);
  absl::Status DenseMlp(const DeviceBlock& b, int64_t T);
  absl::Status MoeMlp(const DeviceBlock& b, int64_t T);
};
}  // namespace draftfeed
