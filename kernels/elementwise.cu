#include "kernels/elementwise.cuh"

#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

using vec::kVec;

// In the vector functors `c` counts 16-byte vectors of a row (8 elements).

struct SwiGluVec {
  const bf16* gate_up;
  int64_t ffn_dim;
  bf16* out;

  __device__ void operator()(int64_t t, int64_t c) const {
    const bf16* g = gate_up + t * 2 * ffn_dim + c * kVec;
    float gv[kVec], uv[kVec], y[kVec];
    vec::LoadBf16x8(g, gv);
    vec::LoadBf16x8(g + ffn_dim, uv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) y[k] = vec::Silu(gv[k]) * uv[k];
    vec::StoreBf16x8(out + t * ffn_dim + c * kVec, y);
  }
};

struct SwiGluScalar {
  const bf16* gate_up;
  int64_t ffn_dim;
  bf16* out;

  __device__ void operator()(int64_t t, int64_t i) const {
    const bf16* g = gate_up + t * 2 * ffn_dim + i;
    out[t * ffn_dim + i] =
        __float2bfloat16(vec::Silu(__bfloat162float(g[0])) * __bfloat162float(g[ffn_dim]));
  }
};

using vec::Gate;

// Rows are tokens; a row's vectors run over heads, head_vecs per head.
struct GateVec {
  bf16* o;
  const bf16* gate;
  int64_t row_vecs;  // heads·head_dim / 8
  int head_vecs;
  int64_t gate_token_stride;
  int64_t gate_head_stride;

  __device__ void operator()(int64_t t, int64_t c) const {
    const int h = static_cast<int>(c) / head_vecs;
    const int j = static_cast<int>(c) - h * head_vecs;
    bf16* op = o + (t * row_vecs + c) * kVec;
    float ov[kVec], gv[kVec];
    vec::LoadBf16x8(op, ov);
    vec::LoadBf16x8(gate + t * gate_token_stride + h * gate_head_stride + j * kVec, gv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) ov[k] = Gate(ov[k], gv[k]);
    vec::StoreBf16x8(op, ov);
  }
};

struct GateScalar {
  bf16* o;
  const bf16* gate;
  int64_t row_len;  // heads·head_dim
  int head_dim;
  int64_t gate_token_stride;
  int64_t gate_head_stride;

  __device__ void operator()(int64_t t, int64_t i) const {
    const int h = static_cast<int>(i) / head_dim;
    const int j = static_cast<int>(i) - h * head_dim;
    bf16& oi = o[t * row_len + i];
    const float g = __bfloat162float(gate[t * gate_token_stride + h * gate_head_stride + j]);
    oi = __float2bfloat16(Gate(__bfloat162float(oi), g));
  }
};

struct CaptureVec {
  const float* residual;
  int64_t width;
  bf16* slot;               // capture + slot·width
  int64_t slot_row_stride;  // K·width

  __device__ void operator()(int64_t t, int64_t c) const {
    float v[kVec];
    vec::LoadF32x8(residual + t * width + c * kVec, v);
    vec::StoreBf16x8(slot + t * slot_row_stride + c * kVec, v);
  }
};

struct CaptureScalar {
  const float* residual;
  int64_t width;
  bf16* slot;
  int64_t slot_row_stride;

  __device__ void operator()(int64_t t, int64_t i) const {
    slot[t * slot_row_stride + i] = __float2bfloat16(residual[t * width + i]);
  }
};

__global__ void RowDotKernel(const bf16* x, int64_t x_stride, const bf16* w, int64_t rows,
                             int64_t width, bf16* out) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  if (row >= rows) return;
  const bf16* xr = x + row * x_stride;
  float acc = 0.f;
  for (int64_t i = lane; i < width; i += 32) {
    acc = fmaf(__bfloat162float(xr[i]), __bfloat162float(w[i]), acc);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) out[row] = __float2bfloat16(acc);
}

}  // namespace

cudaError_t RowDot(const bf16* x, int64_t x_stride, const bf16* w, int64_t num_tokens,
                   int64_t width, bf16* out, cudaStream_t stream) {
  if (num_tokens < 0 || width < 0 || x_stride < width) return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  constexpr int kWarps = 8;
  const int64_t blocks = (num_tokens + kWarps - 1) / kWarps;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  RowDotKernel<<<static_cast<unsigned>(blocks), kWarps * 32, 0, stream>>>(x, x_stride, w,
                                                                          num_tokens, width, out);
  return cudaGetLastError();
}

cudaError_t SwiGlu(const bf16* gate_up, int64_t num_tokens, int64_t ffn_dim, bf16* out,
                   cudaStream_t stream) {
  if (num_tokens < 0 || ffn_dim < 0) return cudaErrorInvalidValue;
  if (ffn_dim % kVec == 0 && vec::Aligned16(gate_up) && vec::Aligned16(out)) {
    return vec::LaunchRows(SwiGluVec{gate_up, ffn_dim, out}, num_tokens, ffn_dim / kVec, stream);
  }
  return vec::LaunchRows(SwiGluScalar{gate_up, ffn_dim, out}, num_tokens, ffn_dim, stream);
}

cudaError_t SigmoidGateMul(bf16* o, const bf16* gate, int64_t num_tokens, int64_t heads,
                           int64_t head_dim, int64_t gate_token_stride, int64_t gate_head_stride,
                           cudaStream_t stream) {
  if (num_tokens < 0 || heads < 0 || head_dim < 0 || heads * head_dim > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  const int64_t row = heads * head_dim;
  if (head_dim % kVec == 0 && gate_token_stride % kVec == 0 && gate_head_stride % kVec == 0 &&
      vec::Aligned16(o) && vec::Aligned16(gate)) {
    return vec::LaunchRows(GateVec{o, gate, row / kVec, static_cast<int>(head_dim / kVec),
                                   gate_token_stride, gate_head_stride},
                           num_tokens, row / kVec, stream);
  }
  return vec::LaunchRows(
      GateScalar{o, gate, row, static_cast<int>(head_dim), gate_token_stride, gate_head_stride},
      num_tokens, row, stream);
}

cudaError_t CaptureResidual(const float* residual, int64_t num_tokens, int64_t width, bf16* capture,
                            int64_t num_slots, int64_t slot, cudaStream_t stream) {
  if (num_tokens < 0 || width < 0 || slot < 0 || slot >= num_slots) return cudaErrorInvalidValue;
  bf16* dst = capture + slot * width;
  const int64_t dst_stride = num_slots * width;
  if (width % kVec == 0 && vec::Aligned16(residual) && vec::Aligned16(dst)) {
    return vec::LaunchRows(CaptureVec{residual, width, dst, dst_stride}, num_tokens, width / kVec,
                           stream);
  }
  return vec::LaunchRows(CaptureScalar{residual, width, dst, dst_stride}, num_tokens, width,
                         stream);
}

}  // namespace draftfeed::cuda
