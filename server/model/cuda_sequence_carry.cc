// Chunked prefill on the CUDA engine: the one sequence a forward hands to
// the next. ReserveCarry sizes its arena for the longest sequence at
// start-up; Run (cuda_blocks.cc) reads and writes it through the pieces
// here. K/V are kept as the attention kernel reads a prefix (one buffer of
// every token so far), conv tails and delta-rule states as ping-pong pairs.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/attention.cuh"
#include "server/model/cuda_engine_impl.h"

namespace draftfeed {

size_t CudaEngine::Impl::CarryBytes(int64_t tokens) const {
  size_t bytes = 0;
  for (int64_t l = 0; l < L; ++l) {
    if (layers[static_cast<size_t>(l)].mixer.kind == BlockKind::kAttention) {
      bytes += DeviceArena::Round(static_cast<size_t>(tokens * 2 * Hkv * hd) * sizeof(bf16));
    } else if (layers[static_cast<size_t>(l)].mixer.kind == BlockKind::kGatedDeltaNet) {
      bytes += 2 * DeviceArena::Round(static_cast<size_t>((KC - 1) * C) * sizeof(bf16));
      bytes += 2 * DeviceArena::Round(static_cast<size_t>(Nv * dk * dv) * sizeof(float));
    }
  }
  // The positions and the two attention calls' cu_seqlens.
  return bytes + DeviceArena::Round(static_cast<size_t>(options.max_tokens + 2 + options.max_seqs) *
                                    sizeof(int32_t));
}

void CudaEngine::Impl::FreeCarry() {
  carry_arena.Release();
  carry_layers.clear();
  carry_max = carry_tokens = 0;
  if (h_carry_i32 != nullptr) cudaFreeHost(h_carry_i32);
  h_carry_i32 = d_carry_i32 = nullptr;
}

absl::Status CudaEngine::Impl::ReserveCarry(int64_t tokens) {
  DF_CUDA(cudaSetDevice(options.device));
  FreeCarry();
  if (tokens <= 0) return absl::OkStatus();
  const size_t bytes = CarryBytes(tokens);
  size_t free_b = 0, total_b = 0;
  DF_CUDA(cudaMemGetInfo(&free_b, &total_b));
  if (bytes > free_b) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "carrying one sequence of ", tokens, " tokens takes ", bytes >> 20, " MiB (K/V of ",
        tokens, " tokens per attention layer, GDN states) but ", free_b >> 20,
        " MiB of the GPU are free after the weights and workspace"));
  }
  DF_RETURN_IF_ERROR(carry_arena.Reserve(bytes));
  carry_layers.assign(static_cast<size_t>(L), CarryLayer{});
  for (int64_t l = 0; l < L; ++l) {
    CarryLayer& c = carry_layers[static_cast<size_t>(l)];
    const BlockKind kind = layers[static_cast<size_t>(l)].mixer.kind;
    if (kind == BlockKind::kAttention) {
      c.kv = carry_arena.Take<bf16>(tokens * 2 * Hkv * hd);
    } else if (kind == BlockKind::kGatedDeltaNet) {
      for (int s = 0; s < 2; ++s) c.tail[s] = carry_arena.Take<bf16>((KC - 1) * C);
      for (int s = 0; s < 2; ++s) c.state[s] = carry_arena.Take<float>(Nv * dk * dv);
    }
  }
  const int64_t ints = options.max_tokens + 2 + options.max_seqs;
  d_carry_i32 = carry_arena.Take<int32_t>(ints);
  if (d_carry_i32 == nullptr) return absl::InternalError("carry arena sized short");
  DF_CUDA(cudaMallocHost(&h_carry_i32, static_cast<size_t>(ints) * sizeof(int32_t)));
  carry_max = tokens;
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::UploadCarriedLayout(const ForwardInput& in) {
  const int64_t T = static_cast<int64_t>(in.token_ids.size());
  const int32_t nseq = static_cast<int32_t>(in.seq_lens.size());
  int32_t* pos = h_carry_i32;
  int32_t* cu = h_carry_i32 + options.max_tokens;  // {0, len0}, then the rest's from 0
  int64_t t = 0;
  for (int32_t s = 0; s < nseq; ++s) {
    const int64_t start = s == 0 ? in.resume_tokens : 0;
    for (int32_t i = 0; i < in.seq_lens[s]; ++i) pos[t++] = static_cast<int32_t>(start + i);
  }
  cu[0] = 0;
  cu[1] = in.seq_lens[0];
  cu[2] = 0;
  for (int32_t s = 1; s < nseq; ++s) cu[2 + s] = cu[1 + s] + in.seq_lens[s];
  DF_CUDA(cudaMemcpyAsync(d_pos, pos, static_cast<size_t>(T) * 4, cudaMemcpyHostToDevice, stream));
  DF_CUDA(cudaMemcpyAsync(d_carry_i32 + options.max_tokens, cu, static_cast<size_t>(2 + nseq) * 4,
                          cudaMemcpyHostToDevice, stream));
  return absl::OkStatus();
}

absl::Status CudaEngine::Impl::CarriedAttention(const bf16* q, int64_t q_head_stride,
                                                const bf16* k, const bf16* v, int64_t T,
                                                int32_t nseq, float scale) {
  bf16* kv = carry_layers[static_cast<size_t>(layer_now)].kv;
  const int64_t kv_row = 2 * Hkv * hd;  // elements per carried token
  const size_t width = static_cast<size_t>(Hkv * hd) * sizeof(bf16);
  const size_t src_pitch = static_cast<size_t>(p_attn) * sizeof(bf16);
  const size_t dst_pitch = static_cast<size_t>(kv_row) * sizeof(bf16);
  // Rows [first, first + n) of this forward's K and V to carried rows from `to`.
  auto keep = [&](int64_t first, int64_t n, int64_t to) -> absl::Status {
    DF_CUDA(cudaMemcpy2DAsync(kv + to * kv_row, dst_pitch, k + first * p_attn, src_pitch, width,
                              static_cast<size_t>(n), cudaMemcpyDeviceToDevice, stream));
    DF_CUDA(cudaMemcpy2DAsync(kv + to * kv_row + Hkv * hd, dst_pitch, v + first * p_attn,
                              src_pitch, width, static_cast<size_t>(n), cudaMemcpyDeviceToDevice,
                              stream));
    return absl::OkStatus();
  };
  const int64_t len0 = h_cu[1];
  cuda::AttentionArgs a;
  a.q_stride = p_attn;
  a.q_head_stride = q_head_stride;
  a.num_q_heads = Hq;
  a.num_kv_heads = Hkv;
  a.head_dim = hd;
  a.scale = scale;
  int32_t* d_cu_split = d_carry_i32 + options.max_tokens;
  int64_t rest_begin = 0;  // first token of the ordinary call
  if (resume_now > 0) {
    // Sequence 0: its keys after the carried ones, then its queries at
    // positions resume_now.. over all of them.
    DF_RETURN_IF_ERROR(keep(0, len0, resume_now));
    a.q = q;
    a.k = kv;
    a.k_stride = kv_row;
    a.v = kv + Hkv * hd;
    a.v_stride = kv_row;
    a.num_tokens = len0;
    a.num_kv_tokens = resume_now + len0;
    a.q_offset = static_cast<int32_t>(resume_now);
    a.cu_seqlens = d_cu_split;
    a.num_seqs = 1;
    a.max_seqlen = static_cast<int32_t>(len0);
    a.out = core;
    DF_RETURN_IF_ERROR(Timed("attention", [&] {
      return CudaStatus(cuda::VarlenCausalAttention(a, stream), "VarlenCausalAttention (prefix)");
    }));
    rest_begin = len0;
  }
  if (rest_begin < T) {
    int32_t max_len = 0;
    const int32_t first_seq = rest_begin > 0 ? 1 : 0;
    for (int32_t s = first_seq; s < nseq; ++s) max_len = std::max(max_len, h_cu[s + 1] - h_cu[s]);
    a.q = q + rest_begin * p_attn;
    a.k = k + rest_begin * p_attn;
    a.k_stride = p_attn;
    a.v = v + rest_begin * p_attn;
    a.v_stride = p_attn;
    a.num_tokens = T - rest_begin;
    a.num_kv_tokens = 0;
    a.q_offset = 0;
    a.cu_seqlens = rest_begin > 0 ? d_cu_split + 2 : d_cu;
    a.num_seqs = nseq - first_seq;
    a.max_seqlen = max_len;
    a.out = core + rest_begin * Hq * hd;
    DF_RETURN_IF_ERROR(Timed("attention", [&] {
      return CudaStatus(cuda::VarlenCausalAttention(a, stream), "VarlenCausalAttention");
    }));
  }
  if (!carry_last_now) return absl::OkStatus();
  // The carried sequence goes on: a resumed one alone is in the carry
  // already; otherwise the last sequence's K/V become it (after the prefix
  // call above read the old one: same stream).
  if (resume_now > 0 && nseq == 1) return absl::OkStatus();
  const int64_t last_begin = h_cu[nseq - 1];
  return keep(last_begin, T - last_begin, 0);
}

absl::Status CudaEngine::Impl::CarryConvTail(const bf16* x, int64_t T, int32_t nseq) {
  CarryLayer& c = carry_layers[static_cast<size_t>(layer_now)];
  const bf16* old_tail = c.tail[carry_side];
  bf16* tail = c.tail[1 - carry_side];
  const int64_t rows = KC - 1;
  const int64_t begin = h_cu[nseq - 1];
  const int64_t own = std::min<int64_t>(rows, T - begin);  // rows from this forward
  const size_t row_bytes = static_cast<size_t>(C) * sizeof(bf16);
  const bool resumed = nseq == 1 && resume_now > 0;
  if (own < rows) {
    // The first rows − own: the old tail's last ones where the sequence was
    // carried in, else zeros (before its start).
    if (resumed) {
      DF_CUDA(cudaMemcpyAsync(tail, old_tail + own * C, static_cast<size_t>(rows - own) * row_bytes,
                              cudaMemcpyDeviceToDevice, stream));
    } else {
      DF_CUDA(cudaMemsetAsync(tail, 0, static_cast<size_t>(rows - own) * row_bytes, stream));
    }
  }
  DF_CUDA(cudaMemcpy2DAsync(tail + (rows - own) * C, row_bytes, x + (T - own) * p_gdn,
                            static_cast<size_t>(p_gdn) * sizeof(bf16), row_bytes,
                            static_cast<size_t>(own), cudaMemcpyDeviceToDevice, stream));
  return absl::OkStatus();
}

}  // namespace draftfeed
