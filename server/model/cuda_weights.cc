// The weights on the device, laid out by weight_layout's BlockDeviceBuffers:
// copied from the host model, or (real-size random models) filled on the GPU
// by each tensor's RandomInit.
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/random_init.cuh"
#include "server/model/cuda_engine_impl.h"

namespace draftfeed {

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
      for (const DeviceBuffer& buffer : BlockDeviceBuffers(b->kind)) {
        const size_t bytes = bytes_of(members(l, buffer));
        if (bytes > 0) total += DeviceArena::Round(bytes);
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

}  // namespace draftfeed
