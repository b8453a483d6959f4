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
// rules) is dequantised to bf16 at load.
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

absl::Status CudaEngine::Impl::UploadWeights() {
  const ModelWeights& mw = model->weights;
  const std::vector<WeightSpec> specs = Specs();
  // Where each tensor (by its index in `specs`) goes on the device: a
  // block's device buffer stacks its tensors row after row.
  std::vector<char*> dst(specs.size(), nullptr);
  std::vector<std::vector<size_t>> of_layer(static_cast<size_t>(L));
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].layer >= 0) of_layer[static_cast<size_t>(specs[i].layer)].push_back(i);
  }
  auto element_bytes = [&](size_t i) -> size_t { return specs[i].device_f32 ? 4 : 2; };
  auto is_fp8 = [&](size_t i) { return WeightSlot(mw, specs[i]).fp8(); };
  auto rows_of = [&](size_t i) { return specs[i].numel() / specs[i].shape.back(); };
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
  // The rows of a buffer's FP8 head kept FP8 on the device (0: all bf16).
  auto fp8_rows = [&](BlockKind kind, size_t buffer, const std::vector<size_t>& idx) -> int64_t {
    if (kind == BlockKind::kMoeMlp && (buffer == kMoeExpertsGateUp || buffer == kMoeExpertsDown)) {
      // Stacked experts [E, R, K]: the FP8 grouped GEMMs take whole 128 x 128
      // blocks per expert.
      if (!options.fp8_expert_gemms || idx.size() != 1 || !is_fp8(idx[0])) return 0;
      const WeightSpec& spec = specs[idx[0]];
      const int64_t r = spec.shape[1], k = spec.shape[2];
      return r % cuda::kFp8Block == 0 && k % cuda::kFp8Block == 0 ? rows_of(idx[0]) : 0;
    }
    size_t head = 0;
    while (head < idx.size() && is_fp8(idx[head])) ++head;
    if (head == 0) return 0;
    for (size_t j = head; j < idx.size(); ++j) {
      if (is_fp8(idx[j])) return 0;  // FP8 after bf16: not one GEMM's prefix
    }
    const int64_t k = specs[idx[0]].shape.back();
    int64_t rows = 0;
    for (size_t j = 0; j < head; ++j) {
      const WeightSpec& spec = specs[idx[j]];
      if (spec.shape.size() != 2 || spec.shape.back() != k) return 0;
      if (j + 1 < head && rows_of(idx[j]) % cuda::kFp8Block != 0) return 0;
      rows += rows_of(idx[j]);
    }
    if (k % cuda::kFp8Block != 0 || rows % 16 != 0) return 0;
    return rows;
  };
  // Device bytes of a buffer: FP8 head (e4m3 + its scales), then the rest.
  auto bytes_of = [&](const std::vector<size_t>& idx, int64_t head_rows) {
    size_t bytes = 0;
    int64_t rows = 0;
    for (size_t i : idx) {
      if (rows < head_rows) {
        rows += rows_of(i);
        continue;
      }
      bytes += static_cast<size_t>(specs[i].numel()) * element_bytes(i);
    }
    if (head_rows == 0) return bytes;
    const int64_t k = specs[idx[0]].shape.back();
    const int64_t scale_rows = (head_rows + cuda::kFp8Block - 1) / cuda::kFp8Block;
    return bytes + DeviceArena::Round(static_cast<size_t>(head_rows * k)) +
           DeviceArena::Round(static_cast<size_t>(scale_rows * cuda::Fp8ScaleStride(k)) * 4);
  };
  // Where each FP8-kept tensor's e4m3 rows and scale rows go.
  std::vector<uint8_t*> dst_q(specs.size(), nullptr);
  std::vector<float*> dst_scale(specs.size(), nullptr);

  // Sizes first, then one allocation.
  size_t total = 0;
  size_t embed_index = 0, norm_index = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].layer >= 0) continue;
    total += DeviceArena::Round(static_cast<size_t>(specs[i].numel()) * element_bytes(i));
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
      const std::vector<DeviceBuffer>& buffers = BlockDeviceBuffers(b->kind);
      for (size_t j = 0; j < buffers.size(); ++j) {
        const std::vector<size_t> idx = members(l, buffers[j]);
        const size_t bytes = bytes_of(idx, fp8_rows(b->kind, j, idx));
        if (bytes > 0) total += DeviceArena::Round(bytes);
      }
    }
  }
  DF_RETURN_IF_ERROR(CheckFits(total, "weights", total));
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
      const std::vector<DeviceBuffer>& buffers = BlockDeviceBuffers(b->kind);
      for (size_t j = 0; j < buffers.size(); ++j) {
        const std::vector<size_t> idx = members(l, buffers[j]);
        const int64_t head_rows = fp8_rows(b->kind, j, idx);
        const size_t bytes = bytes_of(idx, head_rows);
        char* base = bytes > 0 ? weights.Take<char>(static_cast<int64_t>(bytes)) : nullptr;
        Fp8Weight fp8;
        size_t next = 0;
        if (head_rows > 0) {
          const int64_t k = specs[idx[0]].shape.back();
          const int64_t stride = cuda::Fp8ScaleStride(k);
          fp8.rows = head_rows;
          uint8_t* q = reinterpret_cast<uint8_t*>(base);
          float* scale = reinterpret_cast<float*>(
              base + DeviceArena::Round(static_cast<size_t>(head_rows * k)));
          fp8.q = q;
          fp8.scale = scale;
          for (int64_t rows = 0; rows < head_rows; ++next) {
            dst_q[idx[next]] = q + rows * k;
            dst_scale[idx[next]] = scale + rows / cuda::kFp8Block * stride;
            rows += rows_of(idx[next]);
          }
          const int64_t scale_rows = (head_rows + cuda::kFp8Block - 1) / cuda::kFp8Block;
          base = reinterpret_cast<char*>(scale) +
                 DeviceArena::Round(static_cast<size_t>(scale_rows * stride) * 4);
          ++fp8_gemm_buffers;
        }
        for (size_t n = next; n < idx.size(); ++n) fp8_dequantized_buffers += is_fp8(idx[n]);
        b->fp8.push_back(fp8);
        b->buffers.push_back(next < idx.size() ? base : nullptr);
        for (size_t n = next; n < idx.size(); ++n) {
          dst[idx[n]] = base;
          base += static_cast<size_t>(specs[idx[n]].numel()) * element_bytes(idx[n]);
        }
      }
    }
  }
  if (weights.used() > total) return absl::InternalError("weight carve overflow");

  // Then each tensor, in canonical order: copied from the host, or filled by
  // its RandomInit (seeded by its canonical index, so the values do not
  // depend on the device layout).
  const bool random = model->weights_on_device_random;
  // GPU-made FP8 weights are drawn in bf16 as the bf16 model's are, then
  // quantised by blocks (and, where they run in bf16, dequantised again).
  bf16* fp8_stage = nullptr;
  uint8_t* fp8_stage_q = nullptr;
  float* fp8_stage_scale = nullptr;
  if (random) {
    int64_t most = 0, most_scales = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      if (!is_fp8(i)) continue;
      const int64_t experts = specs[i].shape.size() == 3 ? specs[i].shape[0] : 1;
      const int64_t per = rows_of(i) / experts;
      most = std::max(most, specs[i].numel());
      most_scales =
          std::max(most_scales, experts * ((per + cuda::kFp8Block - 1) / cuda::kFp8Block) *
                                    cuda::Fp8ScaleStride(specs[i].shape.back()));
    }
    if (most > 0) {
      DF_CUDA(cudaMalloc(&fp8_stage, static_cast<size_t>(most) * 2));
      DF_CUDA(cudaMalloc(&fp8_stage_q, static_cast<size_t>(most)));
      DF_CUDA(cudaMalloc(&fp8_stage_scale, static_cast<size_t>(most_scales) * 4));
    }
  }
  struct StageFree {
    void* p[3];
    ~StageFree() {
      for (void* q : p) cudaFree(q);
    }
  } stage_free{{fp8_stage, fp8_stage_q, fp8_stage_scale}};
  // Host tensors go to the device together at the end, read in parallel into
  // pinned chunks (UploadToDevice); those that need converting are converted
  // when their first chunk is read.
  std::vector<StagedCopy> copies;
  for (size_t i = 0; i < specs.size(); ++i) {
    const WeightSpec& spec = specs[i];
    const int64_t n = spec.numel();
    if (random && is_fp8(i)) {
      const uint64_t seed = model->device_random_seed * 1000003 + i + 1;
      const RandomInit& r = spec.init;
      if (r.dist != RandomInit::Dist::kNormal || r.row_log_sigma > 0) {
        return absl::InternalError(absl::StrCat(spec.name, ": FP8 weights are drawn kNormal"));
      }
      const int64_t cols = spec.shape.back();
      const int64_t rows = rows_of(i);
      const int64_t stride = cuda::Fp8ScaleStride(cols);
      cudaError_t e = cuda::FillRandomBf16(fp8_stage, n, seed, static_cast<float>(r.scale),
                                           static_cast<float>(r.offset), stream);
      if (dst_q[i] != nullptr) {
        if (e == cudaSuccess) {
          e = cuda::QuantizeWeightBlocksFp8(fp8_stage, rows, cols, dst_q[i], dst_scale[i], stride,
                                            stream);
        }
      } else {
        // Stacked experts [E, R, C]: blocks never straddle two experts.
        const int64_t experts = spec.shape.size() == 3 ? spec.shape[0] : 1;
        const int64_t per = rows / experts;
        const int64_t scale_rows = (per + cuda::kFp8Block - 1) / cuda::kFp8Block;
        bf16* out = reinterpret_cast<bf16*>(dst[i]);
        for (int64_t x = 0; x < experts && e == cudaSuccess; ++x) {
          e = cuda::QuantizeWeightBlocksFp8(
              fp8_stage + x * per * cols, per, cols, fp8_stage_q + x * per * cols,
              fp8_stage_scale + x * scale_rows * stride, stride, stream);
          if (e == cudaSuccess) {
            e = cuda::DequantizeWeightBlocksFp8(fp8_stage_q + x * per * cols,
                                                fp8_stage_scale + x * scale_rows * stride, stride,
                                                per, cols, out + x * per * cols, stream);
          }
        }
      }
      if (e != cudaSuccess) return CudaError(e, "FP8 random weight fill");
      // The stage is reused by the next tensor.
      DF_CUDA(cudaStreamSynchronize(stream));
      continue;
    }
    if (dst_q[i] != nullptr) {
      const Tensor& t = WeightSlot(mw, spec);
      copies.push_back({.src = t.data, .bytes = static_cast<size_t>(n), .dst = dst_q[i]});
      const int64_t stride = cuda::Fp8ScaleStride(spec.shape.back());
      const int64_t scale_rows = t.scale_inv.numel() / t.scale_inv.shape.back();
      copies.push_back(ComputedCopy(static_cast<size_t>(scale_rows * stride) * 4, dst_scale[i],
                                    [&t, stride] { return Bytes(PaddedScales(t, stride)); }));
      continue;
    }
    if (random) {
      const uint64_t seed = model->device_random_seed * 1000003 + i + 1;
      const RandomInit& r = spec.init;
      const bool log_uniform = r.dist == RandomInit::Dist::kLogUniform;
      const float a = static_cast<float>(log_uniform ? r.lo : r.scale);
      const float b = static_cast<float>(log_uniform ? r.hi : r.offset);
      cudaError_t e;
      if (r.row_log_sigma > 0) {  // bf16 projections only (the MoE router)
        const int64_t cols = spec.shape.back();
        e = cuda::FillRowScaledRandomBf16(reinterpret_cast<bf16*>(dst[i]), n / cols, cols, seed, a,
                                          b, static_cast<float>(r.row_log_sigma), stream);
      } else if (spec.device_f32) {
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
      copies.push_back(
          ComputedCopy(static_cast<size_t>(n) * 4, dst[i], [&t] { return Bytes(ToFloat(t)); }));
    } else if (t.dtype == DType::kBF16) {
      copies.push_back({.src = t.data, .bytes = static_cast<size_t>(n) * 2, .dst = dst[i]});
    } else {
      copies.push_back(ComputedCopy(static_cast<size_t>(n) * 2, dst[i], [&t] {
        const std::vector<float> f = ToFloat(t);
        std::vector<std::byte> h(f.size() * 2);
        for (size_t k = 0; k < f.size(); ++k) {
          const uint16_t v = FloatToBf16(f[k]);
          std::memcpy(h.data() + 2 * k, &v, 2);
        }
        return h;
      }));
    }
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
