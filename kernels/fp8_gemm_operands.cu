#include <cuda_fp8.h>

#include <algorithm>

#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/fp8_quantize_group.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

// Sixteen lanes per (token, 128-group), 8 values (one 16-byte load) a lane:
// the group's amax by shuffles within the half warp, then one 8-byte store a
// lane, so a warp reads and writes two whole groups per step. Each thread
// walks several groups (grid-stride) to keep enough loads in flight.
constexpr int kLanesPerGroup = 16;
constexpr int kThreads = 256;

__device__ __forceinline__ uint8_t ToE4m3(float v) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float WarpMax(float v) { return fp8::LanesMax<32>(v); }

// Quantizes the lane's 8 values of one group and writes them and the scale.
__device__ __forceinline__ void QuantizeGroup(const float (&v)[vec::kVec], int sub,
                                              uint8_t* group_out, float* scale_out, bool live,
                                              bool in_range) {
  const float amax = fp8::LanesMax<kLanesPerGroup>(fp8::AbsMax8(v));
  const fp8::GroupScale g = fp8::ScaleOf(amax);
  const uint2 packed = live ? fp8::Quantize8(v, g) : make_uint2(0, 0);
  if (!in_range) return;
  reinterpret_cast<uint2*>(group_out)[sub] = packed;
  if (sub == 0) *scale_out = live ? g.s : 0.0f;
}

// Quantizes every group of every row < m_pad of an operand k wide, a half
// warp a group, two groups a warp per step. The values come from an Op in
// two phases, so that a thread's kUnroll groups can have all their loads in
// flight before the first is used (1 measured as fast as or faster than 2
// and 4: docs/performance.md, "Figures behind the code's choices"):
//   Op::Raw; Load(row, g, sub, raw) for a live row; Values(row, g, sub,
//   raw, v, store) gives the 8 values (and with `store` writes any output
//   of its own).
// The steps are warp-uniform so every shuffle has all 32 lanes; a half past
// the end computes on row 0 and stores nothing. Index is 32-bit where the
// groups fit (a 64-bit division per step costs more than the group's
// quantization).
template <int kUnroll, typename Index, class Op>
__device__ __forceinline__ void QuantizeGroupsOf(const Op& op, Index m, Index m_pad, Index groups,
                                                 int64_t k, uint8_t* xq, float* x_scale) {
  const Index items = m_pad * groups;
  const Index pairs = (items + 1) / 2;
  const Index warps = static_cast<Index>(gridDim.x) * (kThreads / 32);
  const int half = (threadIdx.x & 31) / kLanesPerGroup;
  const int sub = threadIdx.x % kLanesPerGroup;
  for (Index p0 = static_cast<Index>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; p0 < pairs;
       p0 += warps * kUnroll) {
    typename Op::Raw raw[kUnroll];
    int64_t row[kUnroll], g[kUnroll];
    bool in_range[kUnroll], live[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Index item = 2 * (p0 + u * warps) + half;
      in_range[u] = item < items;
      const Index it = in_range[u] ? item : 0;
      row[u] = static_cast<int64_t>(it / groups);
      g[u] = static_cast<int64_t>(it % groups);
      live[u] = row[u] < static_cast<int64_t>(m);
      if (live[u]) op.Load(row[u], g[u], sub, raw[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float v[vec::kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (live[u]) op.Values(row[u], g[u], sub, raw[u], v, in_range[u]);
      QuantizeGroup(v, sub, xq + row[u] * k + g[u] * kFp8Block,
                    x_scale + g[u] * static_cast<int64_t>(m_pad) + row[u], live[u], in_range[u]);
    }
  }
}

template <int kUnroll, class Op>
__global__ void __launch_bounds__(kThreads)
    QuantizeGroupsKernel(Op op, int64_t m, int64_t m_pad, int64_t k, uint8_t* __restrict__ xq,
                         float* __restrict__ x_scale) {
  const int64_t groups = k / kFp8Block;
  if (m_pad * groups < (int64_t{1} << 31)) {
    QuantizeGroupsOf<kUnroll, uint32_t>(op, static_cast<uint32_t>(m), static_cast<uint32_t>(m_pad),
                                        static_cast<uint32_t>(groups), k, xq, x_scale);
  } else {
    QuantizeGroupsOf<kUnroll, int64_t>(op, m, m_pad, groups, k, xq, x_scale);
  }
}

// Plain bf16 activations, 16-byte aligned rows.
struct ActivationsOp {
  const bf16* x;
  int64_t ldx;
  using Raw = uint4;
  __device__ void Load(int64_t row, int64_t g, int sub, Raw& raw) const {
    raw = vec::LoadRaw16(x + row * ldx + g * kFp8Block + sub * vec::kVec);
  }
  __device__ void Values(int64_t, int64_t, int, const Raw& raw, float (&v)[vec::kVec], bool) const {
    vec::UnpackBf16x8(raw, v);
  }
};

// Rows that are not 16-byte aligned: element loads, the same values.
struct UnalignedActivationsOp {
  const bf16* x;
  int64_t ldx;
  struct Raw {
    bf16 e[vec::kVec];
  };
  __device__ void Load(int64_t row, int64_t g, int sub, Raw& raw) const {
    const bf16* p = x + row * ldx + g * kFp8Block + sub * vec::kVec;
#pragma unroll
    for (int j = 0; j < vec::kVec; ++j) raw.e[j] = p[j];
  }
  __device__ void Values(int64_t, int64_t, int, const Raw& raw, float (&v)[vec::kVec], bool) const {
#pragma unroll
    for (int j = 0; j < vec::kVec; ++j) v[j] = __bfloat162float(raw.e[j]);
  }
};

// SiLU(gate)·up from the fused [gate; up] rows.
struct SwiGluOp {
  const bf16* gate_up;
  int64_t f;
  struct Raw {
    uint4 gate, up;
  };
  __device__ void Load(int64_t row, int64_t g, int sub, Raw& raw) const {
    const bf16* gp = gate_up + row * 2 * f + g * kFp8Block + sub * vec::kVec;
    raw.gate = vec::LoadRaw16(gp);
    raw.up = vec::LoadRaw16(gp + f);
  }
  __device__ void Values(int64_t, int64_t, int, const Raw& raw, float (&v)[vec::kVec], bool) const {
    float gv[vec::kVec], uv[vec::kVec];
    vec::UnpackBf16x8(raw.gate, gv);
    vec::UnpackBf16x8(raw.up, uv);
#pragma unroll
    for (int j = 0; j < vec::kVec; ++j) {
      // SwiGlu's value, rounded to bf16 as the unfused path stores it.
      v[j] = __bfloat162float(__float2bfloat16(vec::Silu(gv[j]) * uv[j]));
    }
  }
};

// The gated attention output, o *= sigmoid(gate) as SigmoidGateMul stores
// it (o is written back), then quantized: a lane's 8-vector never straddles
// a head (head_dim % 8 == 0).
struct OutputGateOp {
  bf16* o;
  const bf16* gate;
  int64_t row_len;
  int head_dim;
  int64_t gate_token_stride, gate_head_stride;
  struct Raw {
    uint4 o, gate;
  };
  __device__ void Load(int64_t t, int64_t g, int sub, Raw& raw) const {
    const int col = static_cast<int>(g * kFp8Block) + sub * vec::kVec;
    const int h = col / head_dim, j = col - h * head_dim;
    raw.o = vec::LoadRaw16(o + t * row_len + col);
    raw.gate = vec::LoadRaw16(gate + t * gate_token_stride + h * gate_head_stride + j);
  }
  __device__ void Values(int64_t t, int64_t g, int sub, const Raw& raw, float (&v)[vec::kVec],
                         bool store) const {
    float gv[vec::kVec];
    vec::UnpackBf16x8(raw.o, v);
    vec::UnpackBf16x8(raw.gate, gv);
#pragma unroll
    for (int j = 0; j < vec::kVec; ++j) v[j] = vec::Gate(v[j], gv[j]);
    if (store) vec::StoreBf16x8(o + t * row_len + g * kFp8Block + sub * vec::kVec, v);
#pragma unroll
    for (int j = 0; j < vec::kVec; ++j) v[j] = __bfloat162float(__float2bfloat16(v[j]));
  }
};

// One 256-thread block per 128x128 weight block (partial at the edges).
__global__ void QuantizeWeightBlocksKernel(const bf16* __restrict__ w, int64_t n, int64_t k,
                                           uint8_t* __restrict__ wq, float* __restrict__ w_scale,
                                           int64_t scale_stride) {
  const int64_t nb = blockIdx.y, kb = blockIdx.x;
  const int64_t r0 = nb * kFp8Block, c0 = kb * kFp8Block;
  const int64_t rows = min(kFp8Block, n - r0), cols = min(kFp8Block, k - c0);
  float amax = 0.0f;
  for (int64_t i = threadIdx.x; i < rows * cols; i += blockDim.x) {
    amax = fmaxf(amax, fabsf(__bfloat162float(w[(r0 + i / cols) * k + c0 + i % cols])));
  }
  __shared__ float warp_max[8];
  amax = WarpMax(amax);
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, warp_max[i]);
  const float s = amax > 0.0f ? amax / kFp8Max : 1.0f;
  for (int64_t i = threadIdx.x; i < rows * cols; i += blockDim.x) {
    const int64_t at = (r0 + i / cols) * k + c0 + i % cols;
    wq[at] = ToE4m3(__fdiv_rn(__bfloat162float(w[at]), s));
  }
  if (threadIdx.x == 0) w_scale[nb * scale_stride + kb] = s;
}

__global__ void DequantizeWeightBlocksKernel(const uint8_t* __restrict__ wq,
                                             const float* __restrict__ scale, int64_t scale_stride,
                                             int64_t n, int64_t k, bf16* __restrict__ w) {
  const int64_t total = n * k;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / k, c = i % k;
    __nv_fp8_e4m3 q;
    q.__x = wq[i];
    w[i] = __float2bfloat16(static_cast<float>(q) *
                            scale[(r / kFp8Block) * scale_stride + c / kFp8Block]);
  }
}

// Enough blocks to fill the GPU many times over; each warp then walks its
// share of the group pairs.
unsigned GroupBlocks(int64_t m_pad, int64_t k) {
  const int64_t pairs = (m_pad * (k / kFp8Block) + 1) / 2;
  const int64_t blocks = (pairs + kThreads / 32 - 1) / (kThreads / 32);
  return static_cast<unsigned>(std::min<int64_t>(blocks, 132 * 16));
}

}  // namespace

cudaError_t QuantizeActivationsFp8(const bf16* x, int64_t ldx, int64_t m, int64_t k, uint8_t* xq,
                                   float* x_scale, cudaStream_t stream) {
  if (m < 0 || k <= 0 || k % kFp8Block != 0 || ldx < k) return cudaErrorInvalidValue;
  const int64_t m_pad = Fp8RowsPadded(m);
  if (m_pad == 0) return cudaSuccess;
  if (vec::Aligned16(x) && ldx % vec::kVec == 0) {
    QuantizeGroupsKernel<1><<<GroupBlocks(m_pad, k), kThreads, 0, stream>>>(
        ActivationsOp{x, ldx}, m, m_pad, k, xq, x_scale);
  } else {
    QuantizeGroupsKernel<1><<<GroupBlocks(m_pad, k), kThreads, 0, stream>>>(
        UnalignedActivationsOp{x, ldx}, m, m_pad, k, xq, x_scale);
  }
  return cudaGetLastError();
}

cudaError_t SwiGluQuantizeFp8(const bf16* gate_up, int64_t m, int64_t ffn_dim, uint8_t* xq,
                              float* x_scale, cudaStream_t stream) {
  if (m < 0 || ffn_dim <= 0 || ffn_dim % kFp8Block != 0 || !vec::Aligned16(gate_up)) {
    return cudaErrorInvalidValue;
  }
  const int64_t m_pad = Fp8RowsPadded(m);
  if (m_pad == 0) return cudaSuccess;
  QuantizeGroupsKernel<1><<<GroupBlocks(m_pad, ffn_dim), kThreads, 0, stream>>>(
      SwiGluOp{gate_up, ffn_dim}, m, m_pad, ffn_dim, xq, x_scale);
  return cudaGetLastError();
}

cudaError_t SigmoidGateMulQuantizeFp8(bf16* o, const bf16* gate, int64_t num_tokens, int64_t heads,
                                      int64_t head_dim, int64_t gate_token_stride,
                                      int64_t gate_head_stride, Fp8Activations fp8,
                                      cudaStream_t stream) {
  const int64_t row = heads * head_dim;
  if (num_tokens < 0 || heads <= 0 || head_dim <= 0 || row > INT32_MAX || row % kFp8Block != 0 ||
      head_dim % vec::kVec != 0 || gate_token_stride % vec::kVec != 0 ||
      gate_head_stride % vec::kVec != 0 || !vec::Aligned16(o) || !vec::Aligned16(gate) ||
      fp8.q == nullptr || fp8.scale == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t m_pad = Fp8RowsPadded(num_tokens);
  if (m_pad == 0) return cudaSuccess;
  QuantizeGroupsKernel<1><<<GroupBlocks(m_pad, row), kThreads, 0, stream>>>(
      OutputGateOp{o, gate, row, static_cast<int>(head_dim), gate_token_stride, gate_head_stride},
      num_tokens, m_pad, row, fp8.q, fp8.scale);
  return cudaGetLastError();
}

cudaError_t QuantizeWeightBlocksFp8(const bf16* w, int64_t n, int64_t k, uint8_t* wq,
                                    float* w_scale, int64_t scale_stride, cudaStream_t stream) {
  const int64_t kb = (k + kFp8Block - 1) / kFp8Block, nb = (n + kFp8Block - 1) / kFp8Block;
  if (n <= 0 || k <= 0 || scale_stride < kb || nb > 65535) return cudaErrorInvalidValue;
  QuantizeWeightBlocksKernel<<<dim3(static_cast<unsigned>(kb), static_cast<unsigned>(nb)), 256, 0,
                               stream>>>(w, n, k, wq, w_scale, scale_stride);
  return cudaGetLastError();
}

cudaError_t DequantizeWeightBlocksFp8(const uint8_t* wq, const float* scale, int64_t scale_stride,
                                      int64_t n, int64_t k, bf16* w, cudaStream_t stream) {
  if (n <= 0 || k <= 0) return cudaErrorInvalidValue;
  const int64_t total = n * k;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 1 << 16));
  DequantizeWeightBlocksKernel<<<blocks, 256, 0, stream>>>(wq, scale, scale_stride, n, k, w);
  return cudaGetLastError();
}

}  // namespace draftfeed::cuda
