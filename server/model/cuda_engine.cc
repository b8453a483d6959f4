#include "server/model/cuda_engine.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/attention.cuh"
#include "kernels/checksum.cuh"
#include "common/thread_name.h"
#include "server/model/cuda_gemm.h"
#include "kernels/elementwise.cuh"
#include "kernels/embedding.cuh"
#include "kernels/gdn.cuh"
#include "kernels/random_init.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "common/payload_checksum.h"
#include "common/status_macros.h"
#include "server/model/weight_layout.h"

namespace draftfeed {

namespace {

using cuda::bf16;

absl::Status CudaError(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat("CUDA error in ", what, ": ", cudaGetErrorString(e)));
}

#define DF_CUDA(expr)                                         \
  do {                                                        \
    cudaError_t df_e_ = (expr);                               \
    if (df_e_ != cudaSuccess) return CudaError(df_e_, #expr); \
  } while (0)

// A bump allocator over one cudaMalloc: everything is carved at start-up.
class Arena {
 public:
  ~Arena() {
    if (base_) cudaFree(base_);
  }
  absl::Status Reserve(size_t bytes) {
    DF_CUDA(cudaMalloc(&base_, bytes));
    size_ = bytes;
    return absl::OkStatus();
  }
  template <typename T>
  T* Take(int64_t n) {
    const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 255) & ~size_t{255};
    T* p = reinterpret_cast<T*>(static_cast<char*>(base_) + used_);
    used_ += bytes;
    return used_ <= size_ ? p : nullptr;
  }
  static size_t Round(size_t bytes) { return (bytes + 255) & ~size_t{255}; }
  size_t used() const { return used_; }

 private:
  void* base_ = nullptr;
  size_t size_ = 0;
  size_t used_ = 0;
};

}  // namespace

struct CudaEngine::Impl {
  // One block's device buffers, in its BlockDeviceBuffers order
  // (weight_layout.h); null where the config has no such tensor.
  struct DeviceBlock {
    BlockKind kind = BlockKind::kNorms;
    std::vector<void*> buffers;
    bf16* bf(int i) const { return static_cast<bf16*>(buffers[static_cast<size_t>(i)]); }
    float* f32(int i) const { return static_cast<float*>(buffers[static_cast<size_t>(i)]); }
  };
  struct Layer {
    DeviceBlock norms, mixer, mlp;
  };

  const Model* model = nullptr;
  CudaEngineOptions options;
  cudaStream_t stream = nullptr;
  Arena weights;
  Arena work;
  CublasLtGemm gemm;
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
  // Double-buffered capture: ForwardAsync copies one buffer to the host on
  // copy_stream while the next forward writes the other. `capture` is the
  // buffer of the current (or last) forward.
  bf16* captures[2] = {nullptr, nullptr};
  bf16* capture = nullptr;
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
    DeviceWait sink_wait;          // ForwardToDevice: waits for the sink's work
    absl::Status forward_status;   // ForwardToDevice: how the forward itself ended
  };
  std::mutex copy_mu;
  std::condition_variable copy_cv;
  std::deque<PendingCopy> pending;  // at most 2: one per buffer
  bool busy[2] = {false, false};    // a copy (or send) out of this buffer is not retired yet
  bool stop_copier = false;
  std::thread copier;
  void* gdn_ws = nullptr;
  size_t workspace_total = 0;
  int64_t capture_tokens = 0, capture_slots = 0;
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

  absl::Status Check(cudaError_t e, const char* what) {
    return e == cudaSuccess ? absl::OkStatus() : CudaError(e, what);
  }

  absl::Status Init(const Model* m, const CudaEngineOptions& opt);
  int TakeBuffer();
  // Hands `job` to the copy thread; its buffer stays busy until it retires.
  void Queue(PendingCopy job);
  size_t CaptureBytes(const ForwardInput& in) const {
    return draftfeed::CaptureBytes(model->config, in);
  }
  void CopyLoop();
  void StopCopier();
  absl::Status UploadWeights();
  // Enqueues the forward on `stream`; `sync` waits for it (and surfaces
  // errors of its kernels) before returning.
  absl::Status Run(const ForwardInput& in, bool sync = true);
  // mix = block(u) for the mixer or MLP `b` of a layer.
  absl::Status Block(const DeviceBlock& b, int64_t T, int32_t nseq, int32_t max_len);
  absl::Status Attention(const DeviceBlock& b, int64_t T, int32_t nseq, int32_t max_len);
  absl::Status GatedDeltaNet(const DeviceBlock& b, int64_t T, int32_t nseq);
  absl::Status DenseMlp(const DeviceBlock& b, int64_t T);
};

absl::Status CudaEngine::Impl::Init(const Model* m, const CudaEngineOptions& opt) {
  model = m;
  options = opt;
  const ModelConfig& c = m->config;
  D = c.hidden_size;
  F = c.intermediate_size;
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
  if (options.max_layers <= 0) options.max_layers = L + 1;

  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    return absl::FailedPreconditionError("no CUDA device: use --device cpu");
  }
  if (opt.device < 0 || opt.device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuda:", opt.device, " does not exist (", count, " devices)"));
  }
  DF_CUDA(cudaSetDevice(opt.device));
  DF_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  // Workspace, sized once from the token budget.
  const int64_t T = options.max_tokens;
  const int64_t proj_cols = std::max({p_attn, p_gdn, 2 * F});
  cuda::GdnArgs probe;
  probe.num_tokens = T;
  probe.num_k_heads = Nk;
  probe.num_v_heads = Nv;
  probe.key_dim = dk;
  probe.value_dim = dv;
  probe.num_seqs = static_cast<int32_t>(options.max_seqs);
  const size_t gdn_bytes = c.features.linear_attention ? cuda::GdnWorkspaceBytes(probe) : 0;
  const size_t gemm_ws = 64 << 20;
  size_t total = 0;
  auto add = [&](size_t bytes) { total += Arena::Round(std::max<size_t>(bytes, 1)); };
  add(T * 4);                               // ids
  add((options.max_seqs + 1) * 4);          // cu_seqlens
  add(T * 4);                               // positions
  add(T * D * 4);                           // residual
  add(T * D * 2);                           // u
  add(T * proj_cols * 2);                   // proj
  add(T * std::max<int64_t>(Nv * dv, 1) * 2);  // z
  add(T * std::max<int64_t>(C, 1) * 2);     // conv_out
  add(T * std::max(Nv * dv, Hq * hd) * 2);  // core
  add(T * std::max(Nv * dv, Hq * hd) * 2);  // normed
  add(T * D * 2);                           // mix
  add(T * F * 2);                           // act
  add(T * options.max_layers * D * 2);      // capture, twice
  add(T * options.max_layers * D * 2);
  add(gdn_bytes);
  add(gemm_ws);
  if (absl::Status s = work.Reserve(total); !s.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate the ", total >> 20, " MiB workspace for a token budget of ", T, ": ",
        s.message()));
  }
  workspace_total = total;
  d_ids = work.Take<int32_t>(T);
  d_cu = work.Take<int32_t>(options.max_seqs + 1);
  d_pos = work.Take<int32_t>(T);
  residual = work.Take<float>(T * D);
  u = work.Take<bf16>(T * D);
  proj = work.Take<bf16>(T * proj_cols);
  zbuf = work.Take<bf16>(T * std::max<int64_t>(Nv * dv, 1));
  conv_out = work.Take<bf16>(T * std::max<int64_t>(C, 1));
  core = work.Take<bf16>(T * std::max(Nv * dv, Hq * hd));
  normed = work.Take<bf16>(T * std::max(Nv * dv, Hq * hd));
  mix = work.Take<bf16>(T * D);
  act = work.Take<bf16>(T * F);
  captures[0] = work.Take<bf16>(T * options.max_layers * D);
  captures[1] = work.Take<bf16>(T * options.max_layers * D);
  capture = captures[current];
  gdn_ws = work.Take<char>(static_cast<int64_t>(gdn_bytes));
  void* gemm_workspace = work.Take<char>(gemm_ws);
  if (gemm_workspace == nullptr) return absl::InternalError("workspace carve overflow");
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
  if (absl::Status s = gemm.Init(gemm_workspace, gemm_ws); !s.ok()) return s;
  return UploadWeights();
}

// The buffer the next forward writes: the other one than last time, once the
// copy out of it (if any) is retired. A forward of batch N+1 therefore runs
// while batch N's capture is copied, and never overwrites it.
int CudaEngine::Impl::TakeBuffer() {
  const int b = 1 - current;
  std::unique_lock<std::mutex> lock(copy_mu);
  copy_cv.wait(lock, [&] { return !busy[b]; });
  current = b;
  capture = captures[b];
  return b;
}

void CudaEngine::Impl::Queue(PendingCopy job) {
  {
    std::lock_guard<std::mutex> lock(copy_mu);
    busy[job.buffer] = true;
    pending.push_back(std::move(job));
  }
  copy_cv.notify_all();
}

void CudaEngine::Impl::CopyLoop() {
  cudaSetDevice(options.device);
  for (;;) {
    PendingCopy job;
    {
      std::unique_lock<std::mutex> lock(copy_mu);
      copy_cv.wait(lock, [&] { return stop_copier || !pending.empty(); });
      if (pending.empty()) return;  // stopping and drained
      job = std::move(pending.front());
      pending.pop_front();
    }
    Copied done;
    if (job.sink_wait) {
      done = job.sink_wait();
      if (!job.forward_status.ok()) done.status = job.forward_status;
    } else if (const cudaError_t e = cudaEventSynchronize(copied[job.buffer]); e == cudaSuccess) {
      done.checksum =
          v1::FinishPayloadChecksum(h_lanes + job.buffer * v1::kChecksumLanes, job.bytes);
    } else {
      done.status = CudaError(e, "device-to-host copy of the capture");
    }
    job.on_copied(std::move(done));
    {
      std::lock_guard<std::mutex> lock(copy_mu);
      busy[job.buffer] = false;
    }
    copy_cv.notify_all();
  }
}

void CudaEngine::Impl::StopCopier() {
  if (!copier.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(copy_mu);
    stop_copier = true;
  }
  copy_cv.notify_all();
  copier.join();
}

absl::Status CudaEngine::Impl::UploadWeights() {
  const ModelWeights& mw = model->weights;
  const std::vector<WeightSpec> specs = DecoderWeightSpecs(model->config);
  // Where each tensor (by its index in `specs`) goes on the device: a
  // block's device buffer stacks its tensors row after row.
  std::vector<char*> dst(specs.size(), nullptr);
  std::vector<std::vector<size_t>> of_layer(static_cast<size_t>(L));
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].layer >= 0) of_layer[static_cast<size_t>(specs[i].layer)].push_back(i);
  }
  auto element_bytes = [&](size_t i) -> size_t { return specs[i].device_f32 ? 4 : 2; };
  // The members of one device buffer that this layer has, as spec indices.
  auto members = [&](int64_t l, const DeviceBuffer& buffer) {
    std::vector<size_t> out;
    for (Tensor LayerWeights::*m : buffer) {
      for (size_t i : of_layer[static_cast<size_t>(l)]) {
        if (specs[i].member == m) out.push_back(i);
      }
    }
    return out;
  };
  auto bytes_of = [&](const std::vector<size_t>& idx) {
    size_t bytes = 0;
    for (size_t i : idx) bytes += static_cast<size_t>(specs[i].numel()) * element_bytes(i);
    return bytes;
  };

  // Sizes first, then one allocation.
  size_t total = 0;
  size_t embed_index = 0, norm_index = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].layer >= 0) continue;
    total += Arena::Round(static_cast<size_t>(specs[i].numel()) * element_bytes(i));
    (specs[i].global == &ModelWeights::embed_tokens ? embed_index : norm_index) = i;
  }
  layers.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    const LayerBlocks blocks = BlocksOfLayer(model->config, l);
    Layer& w = layers[static_cast<size_t>(l)];
    w.norms.kind = BlockKind::kNorms;
    w.mixer.kind = blocks.mixer;
    w.mlp.kind = blocks.mlp;
    for (DeviceBlock* b : {&w.norms, &w.mixer, &w.mlp}) {
      for (const DeviceBuffer& buffer : BlockDeviceBuffers(b->kind)) {
        const size_t bytes = bytes_of(members(l, buffer));
        if (bytes > 0) total += Arena::Round(bytes);
      }
    }
  }
  if (absl::Status s = weights.Reserve(total); !s.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", total >> 20, " MiB for the weights: ", s.message()));
  }
  embed = weights.Take<bf16>(specs[embed_index].numel());
  dst[embed_index] = reinterpret_cast<char*>(embed);
  final_norm = weights.Take<bf16>(specs[norm_index].numel());
  dst[norm_index] = reinterpret_cast<char*>(final_norm);
  for (int64_t l = 0; l < L; ++l) {
    Layer& w = layers[static_cast<size_t>(l)];
    for (DeviceBlock* b : {&w.norms, &w.mixer, &w.mlp}) {
      for (const DeviceBuffer& buffer : BlockDeviceBuffers(b->kind)) {
        const std::vector<size_t> idx = members(l, buffer);
        const size_t bytes = bytes_of(idx);
        char* base = bytes > 0 ? weights.Take<char>(static_cast<int64_t>(bytes)) : nullptr;
        b->buffers.push_back(base);
        for (size_t i : idx) {
          dst[i] = base;
          base += static_cast<size_t>(specs[i].numel()) * element_bytes(i);
        }
      }
    }
  }
  if (weights.used() > total) return absl::InternalError("weight carve overflow");

  // Then each tensor, in canonical order: copied from the host, or filled by
  // its RandomInit (seeded by its canonical index, so the values do not
  // depend on the device layout).
  const bool random = model->weights_on_device_random;
  for (size_t i = 0; i < specs.size(); ++i) {
    const WeightSpec& spec = specs[i];
    const int64_t n = spec.numel();
    if (random) {
      const uint64_t seed = model->device_random_seed * 1000003 + i + 1;
      const RandomInit& r = spec.init;
      const bool log_uniform = r.dist == RandomInit::Dist::kLogUniform;
      const float a = static_cast<float>(log_uniform ? r.lo : r.scale);
      const float b = static_cast<float>(log_uniform ? r.hi : r.offset);
      cudaError_t e;
      if (spec.device_f32) {
        float* p = reinterpret_cast<float*>(dst[i]);
        e = log_uniform ? cuda::FillLogUniformF32(p, n, seed, a, b, stream)
                        : cuda::FillRandomF32(p, n, seed, a, b, stream);
      } else {
        bf16* p = reinterpret_cast<bf16*>(dst[i]);
        e = log_uniform ? cuda::FillLogUniformBf16(p, n, seed, a, b, stream)
                        : cuda::FillRandomBf16(p, n, seed, a, b, stream);
      }
      if (e != cudaSuccess) return CudaError(e, "random weight fill");
      continue;
    }
    const Tensor& t = WeightSlot(mw, spec);
    if (spec.device_f32) {
      std::vector<float> f = ToFloat(t);
      DF_CUDA(cudaMemcpy(dst[i], f.data(), f.size() * 4, cudaMemcpyHostToDevice));
      continue;
    }
    std::vector<uint16_t> host(static_cast<size_t>(n));
    if (t.dtype == DType::kBF16) {
      std::memcpy(host.data(), t.data, static_cast<size_t>(n) * 2);
    } else {
      std::vector<float> f = ToFloat(t);
      for (int64_t k = 0; k < n; ++k) host[k] = FloatToBf16(f[k]);
    }
    DF_CUDA(cudaMemcpy(dst[i], host.data(), static_cast<size_t>(n) * 2, cudaMemcpyHostToDevice));
  }
  DF_CUDA(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::Block(const DeviceBlock& b, int64_t T, int32_t nseq,
                                     int32_t max_len) {
  switch (b.kind) {
    case BlockKind::kAttention:
      return Attention(b, T, nseq, max_len);
    case BlockKind::kGatedDeltaNet:
      return GatedDeltaNet(b, T, nseq);
    case BlockKind::kDenseMlp:
      return DenseMlp(b, T);
    case BlockKind::kNorms:
      break;  // fused into the residual adds by Run
  }
  return absl::InternalError("a layer's mixer or MLP is a norms block");
}

// §3.7: in_proj (qkv, b, a fused) and z, causal conv + SiLU, the gated delta
// rule, the gated norm and out_proj.
absl::Status CudaEngine::Impl::GatedDeltaNet(const DeviceBlock& w, int64_t T, int32_t nseq) {
  const float eps = static_cast<float>(model->config.rms_norm_eps);
  DF_RETURN_IF_ERROR(
      Timed("gemm", [&] { return gemm.Run(u, w.bf(kGdnInQkvBA), proj, T, p_gdn, D, stream); }));
  DF_RETURN_IF_ERROR(
      Timed("gemm", [&] { return gemm.Run(u, w.bf(kGdnZ), zbuf, T, Nv * dv, D, stream); }));
  DF_RETURN_IF_ERROR(Timed("gdn_conv", [&] {
    return Check(cuda::CausalConv1dSilu(proj, p_gdn, w.bf(kGdnConv), T, C, KC, d_cu, nseq,
                                        conv_out, stream),
                 "CausalConv1dSilu");
  }));
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
  DF_RETURN_IF_ERROR(Timed("gdn_rule", [&] {
    return Check(cuda::GatedDeltaRule(g, gdn_ws, stream), "GatedDeltaRule");
  }));
  DF_RETURN_IF_ERROR(Timed("norm", [&] {
    return Check(
        cuda::GatedRmsNorm(core, zbuf, dv, w.bf(kGdnNorm), T * Nv, dv, eps, normed, stream),
        "GatedRmsNorm");
  }));
  return Timed("gemm",
               [&] { return gemm.Run(normed, w.bf(kGdnOut), mix, T, D, Nv * dv, stream); });
}

// §3.6 (gated: the sigmoid output gate interleaved in q_proj) and §4.
absl::Status CudaEngine::Impl::Attention(const DeviceBlock& w, int64_t T, int32_t nseq,
                                         int32_t max_len) {
  const float eps = static_cast<float>(model->config.rms_norm_eps);
  DF_RETURN_IF_ERROR(
      Timed("gemm", [&] { return gemm.Run(u, w.bf(kAttnQkv), proj, T, p_attn, D, stream); }));
  const int64_t q_head_stride = gated ? 2 * hd : hd;
  bf16* q = proj;
  bf16* k = proj + q_rows;
  bf16* v = k + Hkv * hd;
  if (qk_norm) {
    DF_RETURN_IF_ERROR(Timed("norm", [&]() -> absl::Status {
      for (int64_t h = 0; h < Hq; ++h) {
        cudaError_t e = cuda::RmsNormBf16InPlace(q + h * q_head_stride, p_attn, w.bf(kAttnQNorm),
                                                 T, hd, eps, norm_kind, stream);
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
    return Check(e, "ApplyRope");
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
  DF_RETURN_IF_ERROR(Timed("attention", [&] {
    return Check(cuda::VarlenCausalAttention(a, stream), "VarlenCausalAttention");
  }));
  if (gated) {
    DF_RETURN_IF_ERROR(Timed("elementwise", [&] {
      return Check(cuda::SigmoidGateMul(core, q + hd, T, Hq, hd, p_attn, q_head_stride, stream),
                   "SigmoidGateMul");
    }));
  }
  return Timed("gemm", [&] { return gemm.Run(core, w.bf(kAttnO), mix, T, D, Hq * hd, stream); });
}

// §3.9: down_proj(SiLU(gate) * up), gate and up from one fused GEMM.
absl::Status CudaEngine::Impl::DenseMlp(const DeviceBlock& w, int64_t T) {
  DF_RETURN_IF_ERROR(
      Timed("gemm", [&] { return gemm.Run(u, w.bf(kMlpGateUp), proj, T, 2 * F, D, stream); }));
  DF_RETURN_IF_ERROR(
      Timed("elementwise", [&] { return Check(cuda::SwiGlu(proj, T, F, act, stream), "SwiGlu"); }));
  return Timed("gemm", [&] { return gemm.Run(act, w.bf(kMlpDown), mix, T, D, F, stream); });
}

absl::Status CudaEngine::Impl::Run(const ForwardInput& in, bool sync) {
  DF_CUDA(cudaSetDevice(options.device));
  DF_RETURN_IF_ERROR(ValidateForwardInput(model->config, in, options.max_tokens));
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
  const float eps = static_cast<float>(model->config.rms_norm_eps);
  DF_RETURN_IF_ERROR(Timed("embed", [&]() -> absl::Status {
    cudaError_t e = cuda::PositionsFromCuSeqlens(d_cu, nseq, T, d_pos, stream);
    if (e == cudaSuccess) e = cuda::EmbeddingLookup(d_ids, T, embed, D, residual, stream);
    return Check(e, "embedding");
  }));
  DF_RETURN_IF_ERROR(Timed("norm", [&] {
    return Check(cuda::RmsNormF32(residual, D, layers[0].norms.bf(kInputNorm), T, D, eps,
                                  norm_kind, u, D, stream),
                 "RmsNormF32");
  }));
  for (int64_t l = 0; l <= last; ++l) {
    const Layer& w = layers[static_cast<size_t>(l)];
    DF_RETURN_IF_ERROR(Block(w.mixer, T, nseq, max_len));
    DF_RETURN_IF_ERROR(Timed("norm", [&] {
      return Check(cuda::AddRmsNormF32(residual, mix, w.norms.bf(kPostNorm), T, D, eps, norm_kind,
                                       u, stream),
                   "AddRmsNormF32");
    }));
    DF_RETURN_IF_ERROR(Block(w.mlp, T, nseq, max_len));
    // After the last layer run no next input is needed: the final norm, when
    // asked for, is written straight into its capture slot below.
    const bf16* next_norm =
        l + 1 < L ? layers[static_cast<size_t>(l + 1)].norms.bf(kInputNorm) : final_norm;
    DF_RETURN_IF_ERROR(Timed("norm", [&] {
      return Check(l == last ? cuda::AddResidual(residual, mix, T, D, stream)
                             : cuda::AddRmsNormF32(residual, mix, next_norm, T, D, eps, norm_kind,
                                                   u, stream),
                   "AddRmsNormF32");
    }));
    if (slot_of[l] >= 0) {
      DF_RETURN_IF_ERROR(Timed("capture", [&] {
        return Check(cuda::CaptureResidual(residual, T, D, capture, K, slot_of[l], stream),
                     "CaptureResidual");
      }));
    }
  }
  if (final_slot >= 0) {
    DF_RETURN_IF_ERROR(Timed("capture", [&] {
      return Check(cuda::RmsNormF32(residual, D, final_norm, T, D, eps, norm_kind,
                                    capture + final_slot * D, K * D, stream),
                   "final norm");
    }));
  }
  capture_tokens = T;
  capture_slots = K;
  if (sync) DF_CUDA(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

CudaEngine::CudaEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudaEngine::~CudaEngine() {
  if (impl_) {
    impl_->StopCopier();  // every pending copy's callback runs first
    for (cudaEvent_t e : impl_->copied) {
      if (e) cudaEventDestroy(e);
    }
    for (cudaEvent_t e : impl_->forwarded) {
      if (e) cudaEventDestroy(e);
    }
    if (impl_->send_stream) cudaStreamDestroy(impl_->send_stream);
    if (impl_->copy_stream) cudaStreamDestroy(impl_->copy_stream);
    if (impl_->d_lanes) cudaFree(impl_->d_lanes);
    if (impl_->h_lanes) cudaFreeHost(impl_->h_lanes);
    if (impl_->h_ids) cudaFreeHost(impl_->h_ids);
    if (impl_->h_cu) cudaFreeHost(impl_->h_cu);
    if (impl_->stream) cudaStreamDestroy(impl_->stream);
  }
}

absl::StatusOr<std::unique_ptr<CudaEngine>> CudaEngine::Create(const Model* model,
                                                               const CudaEngineOptions& options) {
  if (model == nullptr) return absl::InvalidArgumentError("CudaEngine::Create: model is null");
  if (options.max_tokens < 1) return absl::InvalidArgumentError("max_tokens must be >= 1");
  auto impl = std::make_unique<Impl>();
  if (absl::Status s = impl->Init(model, options); !s.ok()) return s;
  impl->copier = std::thread([p = impl.get()] {
    NameThisThread("df-gpu-copy");
    p->CopyLoop();
  });
  return std::unique_ptr<CudaEngine>(new CudaEngine(std::move(impl)));
}

const Model& CudaEngine::model() const { return *impl_->model; }

std::string CudaEngine::device_name() const { return absl::StrCat("cuda:", impl_->options.device); }

absl::Status CudaEngine::ForwardOnDevice(const ForwardInput& in) {
  impl_->TakeBuffer();
  return impl_->Run(in);
}

absl::Status CudaEngine::Forward(const ForwardInput& in, std::span<std::byte> out) {
  if (absl::Status s = CheckCaptureOutput(*this, in, out.size()); !s.ok()) return s;
  impl_->TakeBuffer();
  if (absl::Status s = impl_->Run(in); !s.ok()) return s;
  DF_CUDA(cudaMemcpy(out.data(), impl_->capture,
                     impl_->CaptureBytes(in),
                     cudaMemcpyDeviceToHost));
  return absl::OkStatus();
}

absl::Status CudaEngine::ForwardAsync(const ForwardInput& in, std::span<std::byte> out,
                                      CopiedCallback on_copied) {
  if (absl::Status s = CheckCaptureOutput(*this, in, out.size()); !s.ok()) return s;
  Impl& m = *impl_;
  const int b = m.TakeBuffer();
  // Run ends with the compute stream synchronised, so the copy stream needs
  // no event to order itself after the forward.
  if (absl::Status s = m.Run(in); !s.ok()) return s;
  const size_t bytes = m.CaptureBytes(in);
  DF_CUDA(cudaMemcpyAsync(out.data(), m.captures[b], bytes, cudaMemcpyDeviceToHost, m.copy_stream));
  // The checksum is taken on the GPU beside the copy (tens of microseconds),
  // not by a pass over the host copy on the target's CPU.
  DF_CUDA(cuda::EnqueuePayloadLanes(m.captures[b], bytes, m.d_lanes + b * v1::kChecksumLanes,
                                    m.h_lanes + b * v1::kChecksumLanes, m.copy_stream));
  DF_CUDA(cudaEventRecord(m.copied[b], m.copy_stream));
  m.Queue(Impl::PendingCopy{b, bytes, std::move(on_copied)});
  return absl::OkStatus();
}

absl::Status CudaEngine::ForwardToDevice(const ForwardInput& in, const DeviceSink& sink,
                                         CopiedCallback on_sent) {
  if (absl::Status s = CheckEncodingServed(*this, in.encoding); !s.ok()) return s;
  Impl& m = *impl_;
  // TakeBuffer waits out any copy or send still reading the buffer; the one
  // this batch's sink starts keeps it busy until its DeviceWait returns.
  const int b = m.TakeBuffer();
  if (absl::Status s = m.Run(in, /*sync=*/false); !s.ok()) return s;
  DF_CUDA(cudaEventRecord(m.forwarded[b], m.stream));
  DF_CUDA(cudaStreamWaitEvent(m.send_stream, m.forwarded[b], 0));
  DeviceView view;
  view.data = m.captures[b];
  view.bytes = m.CaptureBytes(in);
  view.encoding = in.encoding;
  view.bytes_per_token = CaptureBytesPerToken(in.encoding, static_cast<int64_t>(in.layers.size()), m.D);
  view.device = m.options.device;
  view.stream = m.send_stream;
  // The sink is called while the forward runs, so its host-side work (an
  // NCCL send: ~0.35 ms) is done by the time the capture is ready.
  absl::StatusOr<DeviceWait> wait = sink(view);
  const cudaError_t e = cudaStreamSynchronize(m.stream);
  absl::Status forward = e == cudaSuccess ? absl::OkStatus() : CudaError(e, "forward");
  if (!wait.ok()) return forward.ok() ? wait.status() : forward;
  m.Queue(Impl::PendingCopy{b, view.bytes, std::move(on_sent), *std::move(wait), std::move(forward)});
  return absl::OkStatus();
}

const void* CudaEngine::DeviceCapture() const { return impl_->capture; }
int64_t CudaEngine::max_capture_layers() const { return impl_->options.max_layers; }

int64_t CudaEngine::weight_bytes() const { return static_cast<int64_t>(impl_->weights.used()); }
int64_t CudaEngine::workspace_bytes() const { return static_cast<int64_t>(impl_->workspace_total); }
const OpTimes& CudaEngine::last_op_times() const { return impl_->times; }
void CudaEngine::set_profile(bool on) { impl_->options.profile = on; }

int CudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

HostAllocator PinnedHostAllocator() {
  return HostAllocator{.allocate = [](size_t bytes) -> void* {
                         void* p = nullptr;
                         return cudaHostAlloc(&p, bytes, cudaHostAllocPortable) == cudaSuccess
                                    ? p
                                    : nullptr;
                       },
                       .release = [](void* p) { cudaFreeHost(p); }};
}

}  // namespace draftfeed
