#include "kernels/rmsnorm.cuh"

#include <algorithm>

#include "kernels/fp8_quantize_group.cuh"
#include "kernels/vec_io.cuh"

namespace draftfeed::cuda {
namespace {

using vec::kVec;

// Rows are cut into 16-byte vectors (8 elements) that each thread holds in
// registers between the row's reduction and its write, so x is read from
// memory once: kItems of them per thread, all loads issued before the first
// is used. Wide rows take 4 per thread; blocks stop at 512 threads so that
// the fp32 rows (8 registers a vector, 12 while the residual add's delta is
// live) fit without spilling, i.e. rows of up to 16384 elements. Rows of at
// most 512 take 2 per thread: the GDN norm's x and z double the registers,
// and a narrow row wants more threads (occupancy) rather than more items.
constexpr int kWideItems = 4;
constexpr int kNarrowItems = 2;
constexpr int kMaxBlock = 512;

// One norm = one Op: what a row is made of and what is written from x̂.
// Vector path: Load only issues the reads of one vector into an Item (so all
// of a thread's loads are in flight before any is used), Prepare finishes it
// (the residual add) and returns its Σx², Store writes y from it and
// inv = (mean(x²) + eps)^−½. bf16 rows stay packed in their Item and are
// widened twice, which is cheaper than twice the registers. Scalar path (odd
// widths, unaligned pointers): First reads element i during the reduction,
// Again re-reads it for the write, StoreOne writes it.

__device__ __forceinline__ float SumSquares(const float (&v)[kVec]) {
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < kVec; ++k) ss += v[k] * v[k];
  return ss;
}

// The values a bf16 store keeps: what a quantizer reading `out` back would see.
__device__ __forceinline__ void StoreRounded(bf16* out, float (&y)[kVec]) {
  vec::StoreBf16x8(out, y);
#pragma unroll
  for (int k = 0; k < kVec; ++k) y[k] = __bfloat162float(__float2bfloat16(y[k]));
}

// y = x̂·(w + w_offset) from the fp32 row values, written as 8 bf16 (and
// left in y as stored).
__device__ __forceinline__ void ScaleStore(const float (&v)[kVec], float inv, const bf16* w,
                                           float w_offset, bf16* out, float (&y)[kVec]) {
  float wv[kVec];
  vec::LoadBf16x8(w, wv);
#pragma unroll
  for (int k = 0; k < kVec; ++k) y[k] = (v[k] * inv) * (wv[k] + w_offset);
  StoreRounded(out, y);
}

struct F32ToBf16 {
  struct Item {
    float v[kVec];
  };
  const float* x;
  int64_t x_stride;
  const bf16* w;
  float w_offset;  // 1 for y = x̂·(1 + w), 0 for y = x̂·w
  bf16* out;
  int64_t out_stride;

  __device__ void Load(int64_t r, int64_t c, Item& it) const {
    vec::LoadF32x8(x + r * x_stride + c * kVec, it.v);
  }
  __device__ float Prepare(int64_t, int64_t, Item& it) const { return SumSquares(it.v); }
  __device__ void Store(int64_t r, int64_t c, const Item& it, float inv, float (&y)[kVec]) const {
    ScaleStore(it.v, inv, w + c * kVec, w_offset, out + r * out_stride + c * kVec, y);
  }
  __device__ float First(int64_t r, int64_t i) const { return x[r * x_stride + i]; }
  __device__ float Again(int64_t r, int64_t i) const { return First(r, i); }
  __device__ void StoreOne(int64_t r, int64_t i, float v, float inv) const {
    out[r * out_stride + i] = __float2bfloat16((v * inv) * (__bfloat162float(w[i]) + w_offset));
  }
};

// residual += delta first; the norm then reads the updated residual.
struct AddF32ToBf16 {
  struct Item {
    float v[kVec];
    uint4 delta;  // dead once Prepare has added it
  };
  float* residual;
  const bf16* delta;
  const bf16* w;
  float w_offset;
  bf16* out;
  int64_t width;

  __device__ void Load(int64_t r, int64_t c, Item& it) const {
    vec::LoadF32x8(residual + r * width + c * kVec, it.v);
    it.delta = vec::LoadRaw16(delta + r * width + c * kVec);
  }
  __device__ float Prepare(int64_t r, int64_t c, Item& it) const {
    float d[kVec];
    vec::UnpackBf16x8(it.delta, d);
#pragma unroll
    for (int k = 0; k < kVec; ++k) it.v[k] += d[k];
    vec::StoreF32x8(residual + r * width + c * kVec, it.v);
    return SumSquares(it.v);
  }
  __device__ void Store(int64_t r, int64_t c, const Item& it, float inv, float (&y)[kVec]) const {
    ScaleStore(it.v, inv, w + c * kVec, w_offset, out + r * width + c * kVec, y);
  }
  __device__ float First(int64_t r, int64_t i) const {
    const float s = residual[r * width + i] + __bfloat162float(delta[r * width + i]);
    residual[r * width + i] = s;
    return s;
  }
  __device__ float Again(int64_t r, int64_t i) const { return residual[r * width + i]; }
  __device__ void StoreOne(int64_t r, int64_t i, float v, float inv) const {
    out[r * width + i] = __float2bfloat16((v * inv) * (__bfloat162float(w[i]) + w_offset));
  }
};

struct Bf16InPlace {
  struct Item {
    uint4 x;
  };
  bf16* x;
  int64_t x_stride;
  const bf16* w;
  float w_offset;

  __device__ void Load(int64_t r, int64_t c, Item& it) const {
    it.x = vec::LoadRaw16(x + r * x_stride + c * kVec);
  }
  __device__ float Prepare(int64_t, int64_t, Item& it) const {
    float v[kVec];
    vec::UnpackBf16x8(it.x, v);
    return SumSquares(v);
  }
  __device__ void Store(int64_t r, int64_t c, const Item& it, float inv, float (&y)[kVec]) const {
    float v[kVec];
    vec::UnpackBf16x8(it.x, v);
    ScaleStore(v, inv, w + c * kVec, w_offset, x + r * x_stride + c * kVec, y);
  }
  __device__ float First(int64_t r, int64_t i) const {
    return __bfloat162float(x[r * x_stride + i]);
  }
  __device__ float Again(int64_t r, int64_t i) const { return First(r, i); }
  __device__ void StoreOne(int64_t r, int64_t i, float v, float inv) const {
    x[r * x_stride + i] = __float2bfloat16((v * inv) * (__bfloat162float(w[i]) + w_offset));
  }
};

// y = (w·x̂)·SiLU(z), in the CPU reference's order.
struct GatedBf16 {
  struct Item {
    uint4 x, z;  // z is read with x so that both are in flight together
  };
  const bf16* x;
  const bf16* z;
  int64_t z_stride;
  const bf16* w;
  bf16* out;
  int64_t width;

  __device__ void Load(int64_t r, int64_t c, Item& it) const {
    it.x = vec::LoadRaw16(x + r * width + c * kVec);
    it.z = vec::LoadRaw16(z + r * z_stride + c * kVec);
  }
  __device__ float Prepare(int64_t, int64_t, Item& it) const {
    float v[kVec];
    vec::UnpackBf16x8(it.x, v);
    return SumSquares(v);
  }
  __device__ void Store(int64_t r, int64_t c, const Item& it, float inv, float (&y)[kVec]) const {
    float v[kVec], wv[kVec], zv[kVec];
    vec::UnpackBf16x8(it.x, v);
    vec::UnpackBf16x8(it.z, zv);
    vec::LoadBf16x8(w + c * kVec, wv);
#pragma unroll
    for (int k = 0; k < kVec; ++k) y[k] = (wv[k] * (v[k] * inv)) * vec::Silu(zv[k]);
    StoreRounded(out + r * width + c * kVec, y);
  }
  __device__ float First(int64_t r, int64_t i) const { return __bfloat162float(x[r * width + i]); }
  __device__ float Again(int64_t r, int64_t i) const { return First(r, i); }
  __device__ void StoreOne(int64_t r, int64_t i, float v, float inv) const {
    const float zi = __bfloat162float(z[r * z_stride + i]);
    out[r * width + i] = __float2bfloat16((__bfloat162float(w[i]) * (v * inv)) * vec::Silu(zi));
  }
};

// Sum over the kGroup consecutive lanes that share a row (kGroup ≤ 32), or
// over the whole block when kGroup == 0 (blockDim.x a multiple of 32).
template <int kGroup>
__device__ __forceinline__ float RowSum(float v, float* smem) {
  if constexpr (kGroup > 0) {
#pragma unroll
    for (int o = kGroup / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
  } else {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    if (warp == 0) {
      v = lane < static_cast<int>(blockDim.x / 32) ? smem[lane] : 0.0f;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
      // A separate slot: a fast warp's next-row partial cannot overwrite it
      // before every warp has read it (they all pass the next barrier first).
      if (lane == 0) smem[32] = v;
    }
    __syncthreads();
    return smem[32];
  }
}

// Where a norm's output also goes quantized for the FP8 GEMM that reads it
// (fp8_gemm_operands.cuh's layout): row r is token r, k = width wide.
struct Fp8Sink {
  uint8_t* q = nullptr;
  float* scale = nullptr;
  int64_t tokens = 0, m_pad = 0, k = 0;

  struct Row {
    uint8_t* q;
    float* scale;  // the row's first group's
  };
  __device__ Row RowOf(int64_t r) const { return {q + r * k, scale + r}; }
  // Vector c of the row (8 values) and, from the group's first vector, its scale.
  __device__ void Put(const Row& row, int c, const uint2& bytes, float s) const {
    *reinterpret_cast<uint2*>(row.q + c * kVec) = bytes;
    constexpr int kGroupVecs = kFp8Block / kVec;
    if (c % kGroupVecs == 0) row.scale[(c / kGroupVecs) * m_pad] = s;
  }
};

// kGroup threads per row (several rows per block), or kGroup == 0: one row
// per block. Every lane of a warp runs the same number of row iterations, so
// the shuffles always see full warps; lanes past the last row add zeros.
// kFp8: each 128-wide group of the stored row is also quantized into `sink`.
// A group is 16 vectors, and with 16 or more lanes a row (a multiple of 16,
// vector c = lane + i·lanes) an aligned run of 16 lanes holds one group per
// item (LaunchNorm takes no narrower rows fused).
template <class Op, int kGroup, int kItems, bool kFp8>
__global__ void __launch_bounds__(kMaxBlock)
    NormVecKernel(Op op, Fp8Sink sink, int64_t rows, int vecs, float width, float eps) {
  __shared__ float smem[33];
  const int group = kGroup > 0 ? kGroup : static_cast<int>(blockDim.x);
  const int lane = static_cast<int>(threadIdx.x) % group;
  const int rows_per_block = static_cast<int>(blockDim.x) / group;
  if constexpr (kFp8) {
    if (blockIdx.x == 0) fp8::ZeroPadRows(sink.q, sink.scale, sink.tokens, sink.m_pad, sink.k);
  }
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * rows_per_block; first < rows;
       first += static_cast<int64_t>(gridDim.x) * rows_per_block) {
    const int64_t row = first + static_cast<int>(threadIdx.x) / group;
    const bool active = row < rows;
    typename Op::Item items[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int c = lane + i * group;
      if (active && c < vecs) op.Load(row, c, items[i]);
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int c = lane + i * group;
      if (active && c < vecs) ss += op.Prepare(row, c, items[i]);
    }
    ss = RowSum<kGroup>(ss, smem);
    const float inv = 1.0f / sqrtf(ss / width + eps);
    float y[kItems][kVec] = {};
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int c = lane + i * group;
      if (active && c < vecs) op.Store(row, c, items[i], inv, y[i]);
    }
    static_assert(!kFp8 || kGroup == 0 || kGroup >= 16, "a group is 16 lanes' vectors");
    if constexpr (kFp8) {
      const Fp8Sink::Row to = sink.RowOf(active ? row : 0);
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const int c = lane + i * group;
        const fp8::GroupScale g = fp8::ScaleOf(fp8::LanesMax<16>(fp8::AbsMax8(y[i])));
        if (active && c < vecs) sink.Put(to, c, fp8::Quantize8(y[i], g), g.s);
      }
    }
  }
}

// One row per block, two passes over global memory (the second mostly hits
// L1/L2). Only for shapes the vector path cannot take.
template <class Op>
__global__ void __launch_bounds__(256)
    NormScalarKernel(Op op, int64_t rows, int64_t width, float eps) {
  __shared__ float smem[33];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
      const float v = op.First(row, i);
      ss += v * v;
    }
    ss = RowSum<0>(ss, smem);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(width) + eps);
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) {
      op.StoreOne(row, i, op.Again(row, i), inv);
    }
  }
}

template <class Op, int kGroup, int kItems>
void LaunchVec(const Op& op, const Fp8Sink& sink, int64_t rows, int64_t vecs, int64_t width,
               float eps, int threads, cudaStream_t stream) {
  const int rows_per_block = kGroup > 0 ? threads / kGroup : 1;
  const int64_t blocks = std::min<int64_t>((rows + rows_per_block - 1) / rows_per_block, INT32_MAX);
  if constexpr (kGroup == 0 || kGroup >= 16) {  // LaunchNorm sends no narrower row with a sink
    if (sink.q != nullptr) {
      NormVecKernel<Op, kGroup, kItems, true>
          <<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
              op, sink, rows, static_cast<int>(vecs), static_cast<float>(width), eps);
      return;
    }
  }
  NormVecKernel<Op, kGroup, kItems, false><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      op, sink, rows, static_cast<int>(vecs), static_cast<float>(width), eps);
}

// vectorised: the caller checked width % 8 == 0 and the alignment of every
// pointer and stride the Op touches. With a sink the vector path must be
// taken and width be a multiple of 128 (the callers fall back otherwise).
template <class Op>
cudaError_t LaunchNorm(const Op& op, bool vectorised, int64_t rows, int64_t width, float eps,
                       cudaStream_t stream, const Fp8Sink& sink = {}) {
  if (rows < 0 || width < 0) return cudaErrorInvalidValue;
  if (rows == 0 || width == 0) return cudaSuccess;
  const int64_t vecs = width / kVec;
  constexpr int kBlock = 256;  // threads of the blocks that hold several rows
  if (sink.q != nullptr && !(vectorised && width % kFp8Block == 0 && width >= 2 * kFp8Block &&
                             vecs <= kMaxBlock * kWideItems)) {
    return cudaErrorInvalidValue;
  }
  if (vectorised && vecs <= 32 * kNarrowItems) {
    // q/k heads, GDN heads: a power-of-two slice of a warp per row.
    using Launch =
        void (*)(const Op&, const Fp8Sink&, int64_t, int64_t, int64_t, float, int, cudaStream_t);
    constexpr Launch kByLog2Group[] = {
        LaunchVec<Op, 1, kNarrowItems>,  LaunchVec<Op, 2, kNarrowItems>,
        LaunchVec<Op, 4, kNarrowItems>,  LaunchVec<Op, 8, kNarrowItems>,
        LaunchVec<Op, 16, kNarrowItems>, LaunchVec<Op, 32, kNarrowItems>};
    int log2_group = 0;
    while ((int64_t{kNarrowItems} << log2_group) < vecs) ++log2_group;
    kByLog2Group[log2_group](op, sink, rows, vecs, width, eps, kBlock, stream);
  } else if (vectorised && vecs <= 32 * kWideItems) {
    LaunchVec<Op, 32, kWideItems>(op, sink, rows, vecs, width, eps, kBlock, stream);
  } else if (vectorised && vecs <= kMaxBlock * kWideItems) {
    // The hidden size: one row per block.
    const int64_t threads = (vecs + kWideItems - 1) / kWideItems;
    LaunchVec<Op, 0, kWideItems>(op, sink, rows, vecs, width, eps,
                                 static_cast<int>((threads + 31) / 32 * 32), stream);
  } else {
    const int threads = static_cast<int>(std::min<int64_t>(256, (width + 31) / 32 * 32));
    const int64_t blocks = std::min<int64_t>(rows, INT32_MAX);
    NormScalarKernel<Op>
        <<<static_cast<unsigned>(blocks), threads, 0, stream>>>(op, rows, width, eps);
  }
  return cudaGetLastError();
}

// The fused norm where it can run (rows of at least 256, a multiple of 128:
// 16 lanes or more a row), else the norm and then the quantizer over its
// output (out: rows of width, `ld` apart).
template <class Op>
cudaError_t NormMaybeQuantized(const Op& op, bool vectorised, int64_t rows, int64_t width,
                               float eps, const Fp8Activations& fp8, const bf16* out, int64_t ld,
                               cudaStream_t stream) {
  if (fp8.q == nullptr) return LaunchNorm(op, vectorised, rows, width, eps, stream);
  if (width % kFp8Block != 0 || fp8.scale == nullptr) return cudaErrorInvalidValue;
  if (vectorised && width >= 2 * kFp8Block && width / kVec <= kMaxBlock * kWideItems) {
    Fp8Sink sink;
    sink.q = fp8.q;
    sink.scale = fp8.scale;
    sink.tokens = rows;
    sink.m_pad = Fp8RowsPadded(rows);
    sink.k = width;
    return LaunchNorm(op, vectorised, rows, width, eps, stream, sink);
  }
  const cudaError_t e = LaunchNorm(op, vectorised, rows, width, eps, stream);
  if (e != cudaSuccess) return e;
  return QuantizeActivationsFp8(out, ld, rows, width, fp8.q, fp8.scale, stream);
}

float WeightOffset(NormKind kind) { return kind == NormKind::kZeroCentred ? 1.0f : 0.0f; }

// A bf16 row of `stride`-spaced rows takes 16-byte loads when every row start is aligned.
bool Bf16Rows(const void* p, int64_t stride) { return vec::Aligned16(p) && stride % kVec == 0; }
bool F32Rows(const void* p, int64_t stride) { return vec::Aligned16(p) && stride % 4 == 0; }

}  // namespace

cudaError_t RmsNormF32(const float* x, int64_t x_stride, const bf16* w, int64_t rows, int64_t width,
                       float eps, NormKind kind, bf16* out, int64_t out_stride, cudaStream_t stream,
                       Fp8Activations fp8) {
  const bool vectorised =
      width % kVec == 0 && F32Rows(x, x_stride) && vec::Aligned16(w) && Bf16Rows(out, out_stride);
  return NormMaybeQuantized(F32ToBf16{x, x_stride, w, WeightOffset(kind), out, out_stride},
                            vectorised, rows, width, eps, fp8, out, out_stride, stream);
}

cudaError_t AddRmsNormF32(float* residual, const bf16* delta, const bf16* w, int64_t rows,
                          int64_t width, float eps, NormKind kind, bf16* out, cudaStream_t stream,
                          Fp8Activations fp8) {
  const bool vectorised = width % kVec == 0 && vec::Aligned16(residual) && vec::Aligned16(delta) &&
                          vec::Aligned16(w) && vec::Aligned16(out);
  return NormMaybeQuantized(AddF32ToBf16{residual, delta, w, WeightOffset(kind), out, width},
                            vectorised, rows, width, eps, fp8, out, width, stream);
}

cudaError_t RmsNormBf16InPlace(bf16* x, int64_t x_stride, const bf16* w, int64_t rows,
                               int64_t width, float eps, NormKind kind, cudaStream_t stream) {
  const bool vectorised = width % kVec == 0 && Bf16Rows(x, x_stride) && vec::Aligned16(w);
  return LaunchNorm(Bf16InPlace{x, x_stride, w, WeightOffset(kind)}, vectorised, rows, width, eps,
                    stream);
}

cudaError_t GatedRmsNorm(const bf16* x, const bf16* z, int64_t z_stride, const bf16* w,
                         int64_t rows, int64_t width, float eps, bf16* out, cudaStream_t stream) {
  const bool vectorised = width % kVec == 0 && vec::Aligned16(x) && Bf16Rows(z, z_stride) &&
                          vec::Aligned16(w) && vec::Aligned16(out);
  return LaunchNorm(GatedBf16{x, z, z_stride, w, out, width}, vectorised, rows, width, eps, stream);
}

namespace {

struct AddVec {
  float* residual;
  const bf16* delta;

  __device__ void operator()(int64_t, int64_t c) const {
    float r[kVec], d[kVec];
    vec::LoadF32x8(residual + c * kVec, r);
    vec::LoadBf16x8(delta + c * kVec, d);
#pragma unroll
    for (int k = 0; k < kVec; ++k) r[k] += d[k];
    vec::StoreF32x8(residual + c * kVec, r);
  }
};

struct AddScalar {
  float* residual;
  const bf16* delta;

  __device__ void operator()(int64_t, int64_t i) const {
    residual[i] += __bfloat162float(delta[i]);
  }
};

}  // namespace

// Both operands are dense, so the rows flatten into one run of elements.
cudaError_t AddResidual(float* residual, const bf16* delta, int64_t rows, int64_t width,
                        cudaStream_t stream) {
  if (rows < 0 || width < 0) return cudaErrorInvalidValue;
  const int64_t n = rows * width;
  if (n % kVec == 0 && vec::Aligned16(residual) && vec::Aligned16(delta)) {
    return vec::LaunchRows(AddVec{residual, delta}, 1, n / kVec, stream);
  }
  return vec::LaunchRows(AddScalar{residual, delta}, 1, n, stream);
}

}  // namespace draftfeed::cuda
