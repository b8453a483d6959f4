// Target outputs on the CUDA engine (ForwardInput::outputs): the final-norm
// states through lm_head in chunks of tokens (cuBLASLt, bf16 operands, fp32
// logits), then kernels/target_outputs.cuh writing each token's argmax, top-k
// and draft probs straight into its payload row, after the row's hidden part.
// Nothing is made until a batch asks: a target whose trainers never do holds
// no lm_head, logits or row buffers.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/target_outputs.h"
#include "kernels/random_init.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/target_outputs.cuh"
#include "server/model/cuda_engine_impl.h"
#include "server/model/cuda_upload.h"

namespace draftfeed {
namespace {

// The most fp32 logits held at once: at Qwen3.6's 248,320 ids, 1,024 tokens.
constexpr size_t kLogitsChunkBytes = size_t{1} << 30;

bool TiedHead(const Model& m) {
  const ModelWeights& w = m.weights;
  return m.config.tie_word_embeddings ||
         (w.lm_head.valid() && w.lm_head.data == w.embed_tokens.data);
}

absl::Status CannotAllocate(size_t bytes, const std::string& what, int device, cudaError_t e) {
  cudaGetLastError();  // a failed cudaMalloc is not sticky; clear it
  return absl::ResourceExhaustedError(
      absl::StrCat("cannot allocate ", bytes, " bytes (", bytes >> 20, " MiB) for ", what,
                   " on cuda:", device, ": ", cudaGetErrorString(e)));
}

}  // namespace

bool CudaEngine::Impl::ServesTargetOutputs() const {
  const Tensor& head = model->weights.lm_head;
  if (head.valid() || model->config.tie_word_embeddings) return true;
  // A real-size random model's untied head has a shape and no host data:
  // it is drawn on the device like the decoder's tensors.
  return model->weights_on_device_random && !head.shape.empty();
}

absl::Status CudaEngine::Impl::UploadLmHead() {
  const int64_t V = model->config.vocab_size;
  const size_t bytes = static_cast<size_t>(V * D) * 2;
  if (TiedHead(*model)) {
    // The embedding table is already on the device in bf16: no second copy.
    lm_head = embed;
    std::fprintf(stderr,
                 "draftfeed: cuda:%d: target outputs: lm_head is the tied embedding "
                 "[%lld, %lld] bf16 (%.2f GB, already on the device)\n",
                 options.device, static_cast<long long>(V), static_cast<long long>(D),
                 static_cast<double>(bytes) / 1e9);
    return absl::OkStatus();
  }
  if (const cudaError_t e = cudaMalloc(&lm_head_owned, bytes); e != cudaSuccess) {
    lm_head_owned = nullptr;
    return CannotAllocate(bytes, absl::StrCat("lm_head [", V, ", ", D, "] bf16"), options.device,
                          e);
  }
  if (model->weights_on_device_random) {
    // Seeded by its canonical index (after every decoder tensor), as
    // UploadWeights seeds the others.
    const RandomInit r = LmHeadSpec(model->config).init;
    const uint64_t seed = model->device_random_seed * 1000003 + Specs().size() + 1;
    cudaError_t e =
        r.dist == RandomInit::Dist::kLogUniform
            ? cuda::FillLogUniformBf16(lm_head_owned, V * D, seed, static_cast<float>(r.lo),
                                       static_cast<float>(r.hi), stream)
            : cuda::FillRandomBf16(lm_head_owned, V * D, seed, static_cast<float>(r.scale),
                                   static_cast<float>(r.offset), stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) return CudaError(e, "lm_head random fill");
  } else {
    const Tensor& t = model->weights.lm_head;
    if (t.numel() != V * D) {
      return absl::InvalidArgumentError(
          absl::StrCat("lm_head is ", t.ShapeString(), "; the config needs [", V, ", ", D, "]"));
    }
    std::vector<StagedCopy> copies = {Bf16Copy(t, lm_head_owned)};
    StagedReadOptions read;
    read.threads = options.load_threads;
    read.chunk_bytes = options.load_chunk_bytes;
    DF_RETURN_IF_ERROR(UploadToDevice(copies, model->files, options.device, read,
                                      absl::StrCat("cuda:", options.device))
                           .status());
  }
  lm_head = lm_head_owned;
  std::fprintf(stderr,
               "draftfeed: cuda:%d: target outputs: lm_head [%lld, %lld] bf16 on the device "
               "(%.2f GB, %s)\n",
               options.device, static_cast<long long>(V), static_cast<long long>(D),
               static_cast<double>(bytes) / 1e9,
               model->weights_on_device_random ? "drawn on the device" : "uploaded");
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::PrepareTargetOutputs(const ForwardInput& in, int b) {
  if (!ServesTargetOutputs()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "target outputs are not served by cuda:", options.device,
        ": the model has no lm_head (the checkpoint stores none and does not tie it to the "
        "embedding)"));
  }
  const int64_t V = model->config.vocab_size;
  if (lm_head == nullptr) DF_RETURN_IF_ERROR(UploadLmHead());
  if (logits == nullptr) {
    int64_t c = static_cast<int64_t>(kLogitsChunkBytes / (4 * static_cast<size_t>(V)));
    if (c >= 128) c = c / 128 * 128;  // whole GEMM tiles
    logits_tokens = std::clamp<int64_t>(c, 1, options.max_tokens);
    const size_t bytes = static_cast<size_t>(logits_tokens * V) * 4;
    if (const cudaError_t e = cudaMalloc(&logits, bytes); e != cudaSuccess) {
      logits = nullptr;
      return CannotAllocate(bytes, absl::StrCat("the fp32 logits of ", logits_tokens, " tokens"),
                            options.device, e);
    }
  }
  // A row buffer holds max_tokens rows of this batch's width, and grows when
  // a batch asks for wider rows (more layers, a larger draft vocabulary).
  // Buffer b is free (TakeBuffer waited for its last copy).
  const int64_t row = RowBytesPerToken(model->config, in);
  const size_t need = static_cast<size_t>(options.max_tokens * row);
  if (rows_bytes[b] < need) {
    if (rows[b] != nullptr) DF_CUDA(cudaFree(rows[b]));
    rows[b] = nullptr;
    rows_bytes[b] = 0;
    if (const cudaError_t e = cudaMalloc(&rows[b], need); e != cudaSuccess) {
      rows[b] = nullptr;
      return CannotAllocate(
          need,
          absl::StrCat("a payload buffer of ", options.max_tokens, " rows of ", row, " bytes"),
          options.device, e);
    }
    rows_bytes[b] = need;
  }
  const std::vector<int32_t>& draft = in.outputs->draft_vocab;
  if (!draft.empty() && (!draft_built || draft != draft_indexed)) {
    if (draft_ids == nullptr) {
      const size_t bytes = 4 * static_cast<size_t>(kMaxDraftVocab);
      if (const cudaError_t e = cudaMalloc(&draft_ids, bytes); e != cudaSuccess) {
        draft_ids = nullptr;
        return CannotAllocate(bytes, "the draft vocabulary", options.device, e);
      }
    }
    if (draft_index == nullptr) {
      const size_t index_bytes = cuda::DraftIndexBytes(V, kMaxDraftVocab);
      if (const cudaError_t e = cudaMalloc(&draft_index, index_bytes); e != cudaSuccess) {
        draft_index = nullptr;
        return CannotAllocate(index_bytes, "the draft vocabulary's index", options.device, e);
      }
    }
    // Once per distinct draft vocabulary (trainers keep theirs for a run).
    draft_built = false;
    DF_CUDA(
        cudaMemcpyAsync(draft_ids, draft.data(), draft.size() * 4, cudaMemcpyHostToDevice, stream));
    DF_CUDA(cuda::BuildDraftIndex(draft_ids, static_cast<int64_t>(draft.size()), V, draft_index,
                                  stream));
    draft_indexed = draft;
    draft_built = true;
  }
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::TargetOutputsForward(const ForwardInput& in, int b) {
  const ModelConfig& c = model->config;
  const int64_t T = static_cast<int64_t>(in.token_ids.size());
  const int64_t V = c.vocab_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  // `u` is free after the last layer; the final norm goes there whether or
  // not -1 is also captured (its slot gets the same values).
  DF_RETURN_IF_ERROR(Timed("norm", [&] {
    return CudaStatus(cuda::RmsNormF32(residual, D, final_norm, T, D, eps, norm_kind, u, D, stream),
                      "final norm for lm_head");
  }));
  const TargetOutputs& o = *in.outputs;
  const int64_t hidden =
      CaptureBytesPerToken(in.encoding, static_cast<int64_t>(in.layers.size()), D);
  const int64_t row = RowBytesPerToken(c, in);
  const TargetOutputsLayout lay = LayoutOf(o);
  auto at = [hidden](int64_t offset) { return offset < 0 ? int64_t{-1} : hidden + offset; };
  cuda::TargetOutputOffsets off;
  off.argmax = at(lay.argmax);
  off.top_k_ids = at(lay.top_k_ids);
  off.top_k_logprobs = at(lay.top_k_logprobs);
  off.probs_scale = at(lay.probs_scale);
  off.probs = at(lay.probs);
  off.probs_fp8 = o.probs_encoding == CaptureEncoding::kFp8E4m3;
  const auto num_draft = static_cast<int64_t>(o.draft_vocab.size());
  for (int64_t start = 0; start < T; start += logits_tokens) {
    const int64_t n = std::min(logits_tokens, T - start);
    DF_RETURN_IF_ERROR(Timed(
        "lm_head", [&] { return gemm.RunF32(u + start * D, lm_head, logits, n, V, D, stream); }));
    DF_RETURN_IF_ERROR(Timed("target_outputs", [&] {
      return CudaStatus(cuda::TargetOutputsFromLogits(
                            logits, n, V, V, num_draft > 0 ? draft_index : nullptr, num_draft,
                            o.top_k, off, rows[b] + start * row, row, stream),
                        "TargetOutputsFromLogits");
    }));
  }
  return absl::OkStatus();
}

void CudaEngine::Impl::FreeTargetOutputs() {
  for (void* p :
       {static_cast<void*>(lm_head_owned), static_cast<void*>(logits), static_cast<void*>(rows[0]),
        static_cast<void*>(rows[1]), static_cast<void*>(draft_ids), draft_index}) {
    if (p != nullptr) cudaFree(p);
  }
}

}  // namespace draftfeed
