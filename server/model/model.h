// A loaded target model: validated config, the decoder's weights as typed
// views, and the fingerprint that clients check before trusting its states.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/model/config.h"
#include "server/model/mapped_file.h"
#include "server/model/tensor.h"

namespace draftfeed {

// Names follow the HF checkpoint's tensor suffixes (q_proj, in_proj_qkv, A_log,
// ...) so a reader can map them.
struct LayerWeights {
  LayerKind kind = LayerKind::kFullAttention;
  Tensor input_layernorm;           // [D]
  Tensor post_attention_layernorm;  // [D]
  Tensor gate_proj, up_proj;        // [F, D]
  Tensor down_proj;                 // [D, F]
  // Full attention (self_attn.*).
  Tensor q_proj;          // [Hq*hd*(2 if output gate else 1), D]; gate interleaved per head
  Tensor k_proj, v_proj;  // [Hkv*hd, D]
  Tensor o_proj;          // [D, Hq*hd]
  Tensor q_norm, k_norm;  // [hd]
  // Gated DeltaNet (linear_attn.*).
  Tensor in_proj_qkv;  // [2*Nk*dk + Nv*dv, D]
  Tensor in_proj_z;    // [Nv*dv, D]
  Tensor in_proj_b;    // [Nv, D]
  Tensor in_proj_a;    // [Nv, D]
  Tensor conv1d;       // [2*Nk*dk + Nv*dv, 1, kernel]
  Tensor A_log;        // [Nv]
  Tensor dt_bias;      // [Nv]
  Tensor norm;         // [dv]  gated RMSNorm, multiplicative
  Tensor out_proj;     // [D, Nv*dv]
  // Mixture of experts (mlp.*): E experts of width I, shared expert width I_s.
  Tensor router;                            // [E, D]  mlp.gate.weight
  Tensor experts_gate_up;                   // [E, 2I, D]  per expert [gate; up], out x in
  Tensor experts_down;                      // [E, D, I]
  Tensor shared_gate_proj, shared_up_proj;  // [I_s, D]  mlp.shared_expert.*
  Tensor shared_down_proj;                  // [D, I_s]
  Tensor shared_expert_gate;                // [1, D]  mlp.shared_expert_gate.weight
};

struct ModelWeights {
  Tensor embed_tokens;  // [V, D]
  Tensor norm;          // [D] final norm
  Tensor lm_head;       // [V, D]; equals embed_tokens when tied, absent is allowed
  std::vector<LayerWeights> layers;
};

struct Model {
  std::string id;  // "tiny-random:7", or the checkpoint directory
  ModelConfig config;
  ModelWeights weights;
  // Hex digest over the canonical config and every decoder tensor's name,
  // dtype, shape and a sample of its bytes: two targets with the same
  // fingerprint produce the same hidden states.
  std::string fingerprint;
  // Keeps the mmaps / in-memory buffers behind every Tensor alive.
  std::shared_ptr<const void> storage;
  // The checkpoint files the Tensors map (empty for in-memory models): an
  // engine's upload preads the ranges that lie in one instead of faulting the
  // mapping in. A Model of views into another's files (a tensor-parallel
  // rank's) should copy them.
  std::vector<std::shared_ptr<const MappedFile>> files;
  // Real-size random models ("random:qwen3.6-27b"): the Tensors carry shapes
  // and dtypes but no host data; a GPU engine fills them on the device from
  // this seed (a 54 GB host buffer and its upload would dominate start-up).
  bool weights_on_device_random = false;
  uint64_t device_random_seed = 0;
};

// Loads an HF directory (config.json + model.safetensors or a sharded index).
absl::StatusOr<std::unique_ptr<Model>> LoadModel(const std::string& dir);

// Built-in random models. Specs: "tiny-random" or "tiny-random:SEED" (a small
// Qwen3.5 hybrid with both layer kinds), "tiny-random-qwen3[:SEED]" (dense),
// "tiny-random-moe[:SEED]" / "tiny-random-qwen3-moe[:SEED]" (their MoE
// variants), "small-random*" (real head sizes), and real shapes whose weights
// are made on the GPU: "random:qwen3.6-27b[:SEED]", "random:qwen3-8b[:SEED]",
// "random:qwen3.6-35b-a3b[:SEED]", "random:qwen3-30b-a3b[:SEED]",
// "random:qwen3.5-122b-a10b[:SEED]" (two GPUs' worth in bf16).
absl::StatusOr<std::unique_ptr<Model>> MakeRandomModel(const std::string& spec);
// The built-in specs as the table above defines them ("tiny-random[:SEED]")
// with what each is ("qwen3_5, 4 layers, hidden 128, ..."), for --help.
struct BuiltinModel {
  std::string spec;
  std::string description;
};
std::vector<BuiltinModel> BuiltinModels();
// A model of any config (checked with Validate) with host random weights drawn
// as the built-ins' are, for tests that need a shape the table lacks.
absl::StatusOr<std::unique_ptr<Model>> MakeRandomModel(const ModelConfig& config, uint64_t seed);

// Resolves --model: a built-in spec, else a checkpoint directory.
absl::StatusOr<std::unique_ptr<Model>> OpenModel(const std::string& spec);

struct HfWriteOptions {
  bool multimodal_naming = false;  // model.language_model.* + config under text_config
  int num_shards = 1;              // >1 writes model-0000i-of-0000n + index.json
  DType dtype = DType::kBF16;      // of the written weight tensors (BF16, F16 or F32)
  // FP8 tensors are written as they are (F8_E4M3 + weight_scale_inv, with a
  // quantization_config) unless this is set: then as their dequantized
  // values in `dtype`, an unquantized checkpoint of what the FP8 one means.
  bool dequantize_fp8 = false;
};
// Saves a model as an HF-format directory that LoadModel (and transformers) read.
absl::Status WriteHfCheckpoint(const Model& model, const std::string& dir,
                               const HfWriteOptions& options);

}  // namespace draftfeed

namespace draftfeed {
// Computes Model::fingerprint (see there). Used by the loader and the random models.
std::string ComputeFingerprint(const Model& model);
}  // namespace draftfeed
