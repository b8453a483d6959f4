// The weights on the device, laid out by weight_layout's BlockDeviceBuffers:
// copied from the host model, or (real-size random models) filled on the GPU
// by each tensor's RandomInit.
//
// FP8 weights stay FP8 where an FP8 GEMM takes them (Project): a device
// buffer whose FP8 members come first, share K (a multiple of 128) and stack
// on 128-row block edges holds them as e4m3 plus fp32 block scales in the
// GEMM's layout, and its bf16 members after them (GDN's in_proj_b/a) as a
// bf16 tail; the routed experts stay FP8 for the FP8 grouped GEMMs when their
// widths are whole blocks. Anything else FP8 (a buffer that breaks those
// rules) is dequantized to bf16 at load.
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/random_init.cuh"
#include "server/model/cuda_engine_impl.h"
#include "server/model/cuda_upload.h"

namespace draftfeed {
namespace {

// A host FP8 tensor's block scales as fp32, in the GEMM's padded layout:
// block (nb, g) at nb * stride + g.
std::vector<float> PaddedScales(const Tensor& t, int64_t stride) {
  const BlockScales& s = t.scale_inv;
  const int64_t kb = s.shape.back();
  const int64_t nb = s.numel() / kb;
  std::vector<float> out(static_cast<size_t>(nb * stride), 0.0f);
  for (int64_t r = 0; r < nb; ++r) {
    for (int64_t g = 0; g < kb; ++g) {
      const int64_t i = r * kb + g;
      float v = 0;
      switch (s.dtype) {
        case DType::kF32:
          std::memcpy(&v, s.data + i * 4, 4);
          break;
        case DType::kBF16: {
          uint16_t h;
          std::memcpy(&h, s.data + i * 2, 2);
          v = Bf16ToFloat(h);
          break;
        }
        case DType::kF16: {
          uint16_t h;
          std::memcpy(&h, s.data + i * 2, 2);
          v = Fp16ToFloat(h);
          break;
        }
        default:
          break;  // the loader admits only the three
      }
      out[static_cast<size_t>(r * stride + g)] = v;
    }
  }
  return out;
}

template <typename T>
std::vector<std::byte> Bytes(const std::vector<T>& v) {
  std::vector<std::byte> out(v.size() * sizeof(T));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

}  // namespace

DeviceWeightPlacement::DeviceWeightPlacement(const ModelWeights& weights,
                                             std::vector<WeightSpec> all, int64_t num_layers,
                                             bool experts_fp8)
    : mw(weights),
      specs(std::move(all)),
      dst(specs.size(), nullptr),
      dst_q(specs.size(), nullptr),
      dst_scale(specs.size(), nullptr),
      fp8_expert_gemms(experts_fp8),
      of_layer(static_cast<size_t>(num_layers)) {
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].layer >= 0) {
      of_layer[static_cast<size_t>(specs[i].layer)].push_back(i);
    } else {
      (specs[i].global == &ModelWeights::embed_tokens ? embed_index : norm_index) = i;
    }
  }
}

std::vector<size_t> DeviceWeightPlacement::Members(int64_t l, const DeviceBuffer& buffer) const {
  std::vector<size_t> out;
  for (Tensor LayerWeights::*m : buffer) {
    for (size_t i : of_layer[static_cast<size_t>(l)]) {
      if (specs[i].member == m) out.push_back(i);
    }
  }
  return out;
}

int64_t DeviceWeightPlacement::Fp8Rows(BlockKind kind, size_t buffer,
                                       const std::vector<size_t>& idx) const {
  if (kind == BlockKind::kMoeMlp && (buffer == kMoeExpertsGateUp || buffer == kMoeExpertsDown)) {
    // Stacked experts [E, R, K]: the FP8 grouped GEMMs take whole 128 x 128
    // blocks per expert.
    if (!fp8_expert_gemms || idx.size() != 1 || !IsFp8(idx[0])) return 0;
    const WeightSpec& spec = specs[idx[0]];
    const int64_t r = spec.shape[1], k = spec.shape[2];
    return r % cuda::kFp8Block == 0 && k % cuda::kFp8Block == 0 ? RowsOf(idx[0]) : 0;
  }
  size_t head = 0;
  while (head < idx.size() && IsFp8(idx[head])) ++head;
  if (head == 0) return 0;
  for (size_t j = head; j < idx.size(); ++j) {
    if (IsFp8(idx[j])) return 0;  // FP8 after bf16: not one GEMM's prefix
  }
  const int64_t k = specs[idx[0]].shape.back();
  int64_t rows = 0;
  for (size_t j = 0; j < head; ++j) {
    const WeightSpec& spec = specs[idx[j]];
    if (spec.shape.size() != 2 || spec.shape.back() != k) return 0;
    if (j + 1 < head && RowsOf(idx[j]) % cuda::kFp8Block != 0) return 0;
    rows += RowsOf(idx[j]);
  }
  if (k % cuda::kFp8Block != 0 || rows % 16 != 0) return 0;
  return rows;
}

size_t DeviceWeightPlacement::BytesOf(const std::vector<size_t>& idx, int64_t head_rows) const {
  size_t bytes = 0;
  int64_t rows = 0;
  for (size_t i : idx) {
    if (rows < head_rows) {
      rows += RowsOf(i);
      continue;
    }
    bytes += static_cast<size_t>(specs[i].numel()) * ElementBytes(i);
  }
  if (head_rows == 0) return bytes;
  const int64_t k = specs[idx[0]].shape.back();
  const int64_t scale_rows = (head_rows + cuda::kFp8Block - 1) / cuda::kFp8Block;
  return bytes + DeviceArena::Round(static_cast<size_t>(head_rows * k)) +
         DeviceArena::Round(static_cast<size_t>(scale_rows * cuda::Fp8ScaleStride(k)) * 4);
}

namespace {

// GPU-made FP8 weights are drawn in bf16 as the bf16 model's are, then
// quantized by blocks (and, where they run in bf16, dequantized again)
// through this stage, sized for the largest and reused tensor after tensor.
struct Fp8Stage {
  cuda::bf16* bf16 = nullptr;
  uint8_t* q = nullptr;
  float* scale = nullptr;
  ~Fp8Stage() {
    cudaFree(bf16);
    cudaFree(q);
    cudaFree(scale);
  }
};

absl::Status AllocateFp8Stage(const DeviceWeightPlacement& p, Fp8Stage& stage) {
  int64_t most = 0, most_scales = 0;
  for (size_t i = 0; i < p.specs.size(); ++i) {
    if (!p.IsFp8(i)) continue;
    const WeightSpec& spec = p.specs[i];
    const int64_t experts = spec.shape.size() == 3 ? spec.shape[0] : 1;
    const int64_t per = p.RowsOf(i) / experts;
    most = std::max(most, spec.numel());
    most_scales = std::max(most_scales, experts *
                                            ((per + cuda::kFp8Block - 1) / cuda::kFp8Block) *
                                            cuda::Fp8ScaleStride(spec.shape.back()));
  }
  if (most > 0) {
    DF_CUDA(cudaMalloc(&stage.bf16, static_cast<size_t>(most) * 2));
    DF_CUDA(cudaMalloc(&stage.q, static_cast<size_t>(most)));
    DF_CUDA(cudaMalloc(&stage.scale, static_cast<size_t>(most_scales) * 4));
  }
  return absl::OkStatus();
}

// Tensor i of a GPU-made FP8 model: drawn in bf16, quantized by blocks into
// its FP8 place, or (a tensor that runs in bf16) through the stage and back.
absl::Status FillRandomFp8(const DeviceWeightPlacement& p, size_t i, uint64_t seed,
                           const Fp8Stage& stage, cudaStream_t stream) {
  const WeightSpec& spec = p.specs[i];
  const RandomInit& r = spec.init;
  if (r.dist != RandomInit::Dist::kNormal || r.row_log_sigma > 0) {
    return absl::InternalError(absl::StrCat(spec.name, ": FP8 weights are drawn kNormal"));
  }
  const int64_t n = spec.numel();
  const int64_t cols = spec.shape.back();
  const int64_t rows = p.RowsOf(i);
  const int64_t stride = cuda::Fp8ScaleStride(cols);
  cudaError_t e = cuda::FillRandomBf16(stage.bf16, n, seed, static_cast<float>(r.scale),
                                       static_cast<float>(r.offset), stream);
  if (p.dst_q[i] != nullptr) {
    if (e == cudaSuccess) {
      e = cuda::QuantizeWeightBlocksFp8(stage.bf16, rows, cols, p.dst_q[i], p.dst_scale[i], stride,
                                        stream);
    }
  } else {
    // Stacked experts [E, R, C]: blocks never straddle two experts.
    const int64_t experts = spec.shape.size() == 3 ? spec.shape[0] : 1;
    const int64_t per = rows / experts;
    const int64_t scale_rows = (per + cuda::kFp8Block - 1) / cuda::kFp8Block;
    cuda::bf16* out = reinterpret_cast<cuda::bf16*>(p.dst[i]);
    for (int64_t x = 0; x < experts && e == cudaSuccess; ++x) {
      e = cuda::QuantizeWeightBlocksFp8(stage.bf16 + x * per * cols, per, cols,
                                        stage.q + x * per * cols,
                                        stage.scale + x * scale_rows * stride, stride, stream);
      if (e == cudaSuccess) {
        e = cuda::DequantizeWeightBlocksFp8(stage.q + x * per * cols,
                                            stage.scale + x * scale_rows * stride, stride, per,
                                            cols, out + x * per * cols, stream);
      }
    }
  }
  if (e != cudaSuccess) return CudaError(e, "FP8 random weight fill");
  // The stage is reused by the next tensor.
  DF_CUDA(cudaStreamSynchronize(stream));
  return absl::OkStatus();
}

// Tensor i of a GPU-made model, bf16 or fp32 in place, by its RandomInit.
absl::Status FillRandom(const DeviceWeightPlacement& p, size_t i, uint64_t seed,
                        cudaStream_t stream) {
  const WeightSpec& spec = p.specs[i];
  const int64_t n = spec.numel();
  const RandomInit& r = spec.init;
  const bool log_uniform = r.dist == RandomInit::Dist::kLogUniform;
  const float a = static_cast<float>(log_uniform ? r.lo : r.scale);
  const float b = static_cast<float>(log_uniform ? r.hi : r.offset);
  cudaError_t e;
  if (r.row_log_sigma > 0) {  // bf16 projections only (the MoE router)
    const int64_t cols = spec.shape.back();
    e = cuda::FillRowScaledRandomBf16(reinterpret_cast<cuda::bf16*>(p.dst[i]), n / cols, cols,
                                      seed, a, b, static_cast<float>(r.row_log_sigma), stream);
  } else if (spec.device_f32) {
    float* f = reinterpret_cast<float*>(p.dst[i]);
    e = log_uniform ? cuda::FillLogUniformF32(f, n, seed, a, b, stream)
                    : cuda::FillRandomF32(f, n, seed, a, b, stream);
  } else {
    cuda::bf16* h = reinterpret_cast<cuda::bf16*>(p.dst[i]);
    e = log_uniform ? cuda::FillLogUniformBf16(h, n, seed, a, b, stream)
                    : cuda::FillRandomBf16(h, n, seed, a, b, stream);
  }
  if (e != cudaSuccess) return CudaError(e, "random weight fill");
  return absl::OkStatus();
}

// The host tensors' copies to their places, in canonical order: FP8-kept
// ones as e4m3 plus their scales padded to the GEMM's layout, the rest as
// bf16 (or fp32), converted when their first chunk is read.
std::vector<StagedCopy> HostCopies(const DeviceWeightPlacement& p) {
  std::vector<StagedCopy> copies;
  for (size_t i = 0; i < p.specs.size(); ++i) {
    const WeightSpec& spec = p.specs[i];
    const int64_t n = spec.numel();
    const Tensor& t = WeightSlot(p.mw, spec);
    if (p.dst_q[i] != nullptr) {
      copies.push_back({.src = t.data, .bytes = static_cast<size_t>(n), .dst = p.dst_q[i]});
      const int64_t stride = cuda::Fp8ScaleStride(spec.shape.back());
      const int64_t scale_rows = t.scale_inv.numel() / t.scale_inv.shape.back();
      copies.push_back(ComputedCopy(static_cast<size_t>(scale_rows * stride) * 4, p.dst_scale[i],
                                    [&t, stride] { return Bytes(PaddedScales(t, stride)); }));
    } else if (spec.device_f32) {
      copies.push_back(
          ComputedCopy(static_cast<size_t>(n) * 4, p.dst[i], [&t] { return Bytes(ToFloat(t)); }));
    } else {
      copies.push_back(Bf16Copy(t, p.dst[i]));
    }
  }
  return copies;
}

}  // namespace

size_t CudaEngine::Impl::SizeWeights(const DeviceWeightPlacement& p) {
  size_t total = 0;
  for (size_t i = 0; i < p.specs.size(); ++i) {
    if (p.specs[i].layer >= 0) continue;
    total += DeviceArena::Round(static_cast<size_t>(p.specs[i].numel()) * p.ElementBytes(i));
  }
  layers.resize(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l) {
    const LayerBlocks blocks = BlocksOfLayer(model->config, l);
    Layer& w = layers[static_cast<size_t>(l)];
    w.norms.kind = BlockKind::kNorms;
    w.mixer.kind = blocks.mixer;
    w.mlp.kind = blocks.mlp;
    for (DeviceBlock* b : {&w.norms, &w.mixer, &w.mlp}) {
      const std::vector<DeviceBuffer>& buffers = BlockDeviceBuffers(b->kind);
      for (size_t j = 0; j < buffers.size(); ++j) {
        const std::vector<size_t> idx = p.Members(l, buffers[j]);
        const size_t bytes = p.BytesOf(idx, p.Fp8Rows(b->kind, j, idx));
        if (bytes > 0) total += DeviceArena::Round(bytes);
      }
    }
  }
  return total;
}

void CudaEngine::Impl::CarveBuffer(DeviceWeightPlacement& p, DeviceBlock& b, size_t j,
                                   const std::vector<size_t>& idx) {
  const int64_t head_rows = p.Fp8Rows(b.kind, j, idx);
  const size_t bytes = p.BytesOf(idx, head_rows);
  char* base = bytes > 0 ? weights.Take<char>(static_cast<int64_t>(bytes)) : nullptr;
  Fp8Weight fp8;
  size_t next = 0;
  if (head_rows > 0) {
    const int64_t k = p.specs[idx[0]].shape.back();
    const int64_t stride = cuda::Fp8ScaleStride(k);
    fp8.rows = head_rows;
    uint8_t* q = reinterpret_cast<uint8_t*>(base);
    float* scale =
        reinterpret_cast<float*>(base + DeviceArena::Round(static_cast<size_t>(head_rows * k)));
    fp8.q = q;
    fp8.scale = scale;
    for (int64_t rows = 0; rows < head_rows; ++next) {
      p.dst_q[idx[next]] = q + rows * k;
      p.dst_scale[idx[next]] = scale + rows / cuda::kFp8Block * stride;
      rows += p.RowsOf(idx[next]);
    }
    const int64_t scale_rows = (head_rows + cuda::kFp8Block - 1) / cuda::kFp8Block;
    base = reinterpret_cast<char*>(scale) +
           DeviceArena::Round(static_cast<size_t>(scale_rows * stride) * 4);
    ++fp8_gemm_buffers;
  }
  for (size_t n = next; n < idx.size(); ++n) fp8_dequantized_buffers += p.IsFp8(idx[n]);
  b.fp8.push_back(fp8);
  b.buffers.push_back(next < idx.size() ? base : nullptr);
  for (size_t n = next; n < idx.size(); ++n) {
    p.dst[idx[n]] = base;
    base += static_cast<size_t>(p.specs[idx[n]].numel()) * p.ElementBytes(idx[n]);
  }
}

absl::Status CudaEngine::Impl::CarveWeights(DeviceWeightPlacement& p) {
  // Sizes first, then one allocation.
  const size_t total = SizeWeights(p);
  DF_RETURN_IF_ERROR(CheckFits(total, "weights", total));
  if (absl::Status s = weights.Reserve(total); !s.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", total >> 20, " MiB for the weights: ", s.message()));
  }
  embed = weights.Take<bf16>(p.specs[p.embed_index].numel());
  p.dst[p.embed_index] = reinterpret_cast<char*>(embed);
  final_norm = weights.Take<bf16>(p.specs[p.norm_index].numel());
  p.dst[p.norm_index] = reinterpret_cast<char*>(final_norm);
  for (int64_t l = 0; l < L; ++l) {
    Layer& w = layers[static_cast<size_t>(l)];
    for (DeviceBlock* b : {&w.norms, &w.mixer, &w.mlp}) {
      const std::vector<DeviceBuffer>& buffers = BlockDeviceBuffers(b->kind);
      for (size_t j = 0; j < buffers.size(); ++j) CarveBuffer(p, *b, j, p.Members(l, buffers[j]));
    }
  }
  if (weights.used() > total) return absl::InternalError("weight carve overflow");
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::FillRandomWeights(const DeviceWeightPlacement& p) {
  Fp8Stage stage;
  DF_RETURN_IF_ERROR(AllocateFp8Stage(p, stage));
  for (size_t i = 0; i < p.specs.size(); ++i) {
    // Seeded by the canonical index, so that the values do not depend on the
    // device layout.
    const uint64_t seed = model->device_random_seed * 1000003 + i + 1;
    DF_RETURN_IF_ERROR(p.IsFp8(i) ? FillRandomFp8(p, i, seed, stage, stream)
                                  : FillRandom(p, i, seed, stream));
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::UploadWeights() {
  DeviceWeightPlacement p(model->weights, Specs(), L, options.fp8_expert_gemms);
  DF_RETURN_IF_ERROR(CarveWeights(p));
  // Then each tensor, in canonical order: filled by its RandomInit, or
  // copied from the host. Host tensors go to the device together at the
  // end, read in parallel into pinned chunks (UploadToDevice).
  std::vector<StagedCopy> copies;
  if (model->weights_on_device_random) {
    DF_RETURN_IF_ERROR(FillRandomWeights(p));
  } else {
    copies = HostCopies(p);
  }
  DF_CUDA(cudaStreamSynchronize(stream));
  if (!copies.empty()) {
    StagedReadOptions read;
    read.threads = options.load_threads;
    read.chunk_bytes = options.load_chunk_bytes;
    DF_RETURN_IF_ERROR(UploadToDevice(copies, model->files, options.device, read,
                                      absl::StrCat("cuda:", options.device))
                           .status());
  }
  return absl::OkStatus();
}

}  // namespace draftfeed
