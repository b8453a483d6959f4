// The launchers of hopper_gemm.cuh: tensor maps, argument checks, the
// per-mode parameters, and the kernel of hopper_gemm_kernel.cuh (whose
// header comment holds the design and the measurements).
#include "kernels/hopper_gemm.cuh"

#include <algorithm>

#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/hopper_gemm_kernel.cuh"
#include "kernels/kernel_paths.cuh"
#include "kernels/tma_sm90.cuh"

namespace draftfeed::cuda {
namespace {

using hopper::HopperGemmKernel;
using hopper::kBK;
using hopper::kBM;
using hopper::kBN;
using hopper::kScaleBox;
using hopper::kSmemBytes;
using hopper::kThreads;
using hopper::Mode;
using hopper::Params;

// A row-major [rows, cols] tensor of `bytes`-wide elements read in boxes of
// box_cols x box_rows, 128-byte swizzled or not.
cudaError_t MakeMap(CUtensorMap* map, const void* base, CUtensorMapDataType type, int bytes,
                    int64_t rows, int64_t cols, uint32_t box_cols, uint32_t box_rows,
                    bool swizzle) {
  const sm90::EncodeTiledFn encode = sm90::EncodeTiled();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode(map, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE,
                            swizzle ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool Sm90aKernelLoaded() {
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, HopperGemmKernel<Mode::kDense, true>) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.maxThreadsPerBlock == kThreads;
}

template <Mode kMode, bool kFp8>
cudaError_t Launch(const CUtensorMap& tm_x, const CUtensorMap& tm_w, const CUtensorMap& tm_s,
                   Params prm, cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(HopperGemmKernel<kMode, kFp8>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  }
  if (err != cudaSuccess) return err;
  const int grid = static_cast<int>(std::min<int64_t>(prm.tiles, sms));
  prm.y_vec16 = reinterpret_cast<uintptr_t>(prm.y) % 16 == 0 && prm.ldy % 8 == 0;
  HopperGemmKernel<kMode, kFp8><<<grid, kThreads, kSmemBytes, stream>>>(tm_x, tm_w, tm_s, prm);
  return cudaGetLastError();
}

// A [rows, k] operand (e4m3, or bf16) in 128-byte-wide K blocks and boxes of
// box_rows rows (128 for a weight half or a tile of A).
cudaError_t OperandMap(CUtensorMap* map, const void* base, bool fp8, int64_t rows, int64_t k) {
  return fp8 ? MakeMap(map, base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, rows, k, kBK, 128, true)
             : MakeMap(map, base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, rows, k, kBK / 2, 128, true);
}
// FP8 activations [rows, k] and their scales [k/128][stride] (kScaleBox-row boxes).
cudaError_t ActivationMaps(CUtensorMap* x, CUtensorMap* s, const uint8_t* xq, const float* x_scale,
                           int64_t rows, int64_t k, int64_t stride) {
  cudaError_t err = OperandMap(x, xq, true, rows, k);
  if (err != cudaSuccess) return err;
  return MakeMap(s, x_scale, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, k / kBK, stride, kScaleBox, 1,
                 false);
}

// The dense forms' parameters: m_pad rows in 128-row blocks times n_blocks
// column tiles over K = k, n output columns, n_scale_rows weight-scale rows.
// False when the tiles overflow an int.
bool DenseGrid(bf16* y, int64_t ldy, const float* w_scale, int64_t w_scale_stride, int64_t m_pad,
               int64_t n, int64_t n_blocks, int64_t k, int64_t n_scale_rows, Params* prm) {
  prm->y = y;
  prm->ldy = ldy;
  prm->w_scale = w_scale;
  prm->w_scale_stride = w_scale_stride;
  prm->m = static_cast<int>(m_pad);
  prm->n = static_cast<int>(n);
  prm->m_blocks = static_cast<int>((m_pad + kBM - 1) / kBM);
  prm->n_blocks = static_cast<int>(n_blocks);
  prm->k_blocks = static_cast<int>(k / kBK);
  prm->n_scale_rows = static_cast<int>(n_scale_rows);
  const int64_t tiles = static_cast<int64_t>(prm->m_blocks) * prm->n_blocks;
  if (tiles >= (int64_t{1} << 31)) return false;
  prm->tiles = static_cast<int>(tiles);
  return true;
}

bool ValidMoe(int64_t hidden, int64_t inter, int num_experts, int64_t max_tiles) {
  return hidden > 0 && inter > 0 && hidden % 128 == 0 && inter % 128 == 0 && num_experts >= 1 &&
         max_tiles >= 0 && num_experts * 2 * std::max(hidden, inter) < (int64_t{1} << 31) &&
         max_tiles * ((std::max(hidden, inter) + kBN - 1) / kBN + 1) < (int64_t{1} << 31);
}

// The grouped forms' parameters, all derived from the mode and the widths:
// gate_up writes act [rows, I] from K = D and 2I weight rows an expert (128
// output columns a tile: gate and up halves); down writes y [rows, D] from
// K = I and D rows an expert (256 columns a tile).
Params MoeParams(Mode mode, bf16* out, int64_t hidden, int64_t inter, int elem_bytes,
                 const float* w_scale, const int32_t* tile_map, int64_t max_tiles) {
  const bool gate_up = mode == Mode::kMoeGateUp;
  const int64_t n = gate_up ? inter : hidden, k = gate_up ? hidden : inter;
  Params prm{};
  prm.y = out;
  prm.ldy = n;
  prm.w_scale = w_scale;
  prm.w_scale_stride = Fp8ScaleStride(k);
  prm.n = static_cast<int>(n);
  prm.n_blocks = static_cast<int>(gate_up ? inter / 128 : (hidden + kBN - 1) / kBN);
  prm.k_blocks = static_cast<int>(k * elem_bytes / kBK);
  prm.tiles = static_cast<int>(max_tiles * prm.n_blocks);
  prm.tile_map = reinterpret_cast<const int4*>(tile_map);
  prm.w_rows_per_expert = gate_up ? 2 * inter : hidden;
  prm.w_scale_expert_stride = prm.w_rows_per_expert / 128 * prm.w_scale_stride;
  return prm;
}

}  // namespace

bool HopperGemmsAvailable() { return HopperKernelsAllowed() && Sm90aKernelLoaded(); }

cudaError_t Fp8BlockGemm(const uint8_t* xq, const float* x_scale, const uint8_t* wq,
                         const float* w_scale, int64_t w_scale_stride, bf16* y, int64_t ldy,
                         int64_t m_pad, int64_t n, int64_t k, cudaStream_t stream) {
  if (m_pad < 0 || m_pad % 4 != 0 || n <= 0 || n % 16 != 0 || k <= 0 || k % kBK != 0 || ldy < n ||
      ldy % 2 != 0 || w_scale_stride < k / kBK || m_pad >= (int64_t{1} << 31) ||
      n >= (int64_t{1} << 31) || !Aligned16(xq) || !Aligned16(x_scale) || !Aligned16(wq) ||
      reinterpret_cast<uintptr_t>(y) % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  if (m_pad == 0) return cudaSuccess;
  if (!HopperGemmsAvailable()) return cudaErrorNotSupported;
  CUtensorMap tm_x, tm_w, tm_s;
  cudaError_t err = ActivationMaps(&tm_x, &tm_s, xq, x_scale, m_pad, k, m_pad);
  if (err == cudaSuccess) err = OperandMap(&tm_w, wq, true, n, k);
  if (err != cudaSuccess) return err;
  Params prm{};
  if (!DenseGrid(y, ldy, w_scale, w_scale_stride, m_pad, n, (n + kBN - 1) / kBN, k,
                 (n + 127) / 128, &prm)) {
    return cudaErrorInvalidValue;
  }
  return Launch<Mode::kDense, true>(tm_x, tm_w, tm_s, prm, stream);
}

cudaError_t Fp8GemmSwiGluQuantize(const uint8_t* xq, const float* x_scale, const uint8_t* wq,
                                  const float* w_scale, int64_t w_scale_stride, int64_t m,
                                  int64_t f, int64_t k, Fp8Activations act8, cudaStream_t stream) {
  const int64_t m_pad = Fp8RowsPadded(m);
  if (m < 0 || f <= 0 || f % 128 != 0 || k <= 0 || k % kBK != 0 || w_scale_stride < k / kBK ||
      m_pad >= (int64_t{1} << 31) || 2 * f >= (int64_t{1} << 31) || act8.q == nullptr ||
      act8.scale == nullptr || !Aligned16(xq) || !Aligned16(x_scale) || !Aligned16(wq) ||
      !Aligned16(act8.q)) {
    return cudaErrorInvalidValue;
  }
  if (m_pad == 0) return cudaSuccess;
  if (!HopperGemmsAvailable()) return cudaErrorNotSupported;
  CUtensorMap tm_x, tm_w, tm_s;
  cudaError_t err = ActivationMaps(&tm_x, &tm_s, xq, x_scale, m_pad, k, m_pad);
  if (err == cudaSuccess) err = OperandMap(&tm_w, wq, true, 2 * f, k);
  if (err != cudaSuccess) return err;
  Params prm{};
  if (!DenseGrid(nullptr, f, w_scale, w_scale_stride, m_pad, f, f / 128, k, 2 * f / 128, &prm)) {
    return cudaErrorInvalidValue;
  }
  prm.act8 = act8.q;
  prm.act8_scale = act8.scale;
  prm.act8_rows = m;
  prm.act8_rows_pad = m_pad;
  return Launch<Mode::kDenseGateUp, true>(tm_x, tm_w, tm_s, prm, stream);
}

cudaError_t Fp8MoeGateUpSwiGlu(const uint8_t* xq, const float* x_scale, int64_t x_scale_stride,
                               const uint8_t* gate_up, const float* gate_up_scale, int64_t hidden,
                               int64_t inter, int num_experts, const int32_t* tile_map,
                               int64_t max_tiles, const int32_t* row_token, bf16* act,
                               cudaStream_t stream, Fp8Activations act8, int64_t act8_rows) {
  if (!ValidMoe(hidden, inter, num_experts, max_tiles) || !Aligned16(xq) || !Aligned16(gate_up) ||
      reinterpret_cast<uintptr_t>(act) % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  if (max_tiles == 0) return cudaSuccess;
  if (!HopperGemmsAvailable()) return cudaErrorNotSupported;
  CUtensorMap tm_w;
  const cudaError_t err = OperandMap(&tm_w, gate_up, true, num_experts * 2 * inter, hidden);
  if (err != cudaSuccess) return err;
  // With act8 the bf16 activations are not written: down reads act8 only.
  Params prm = MoeParams(Mode::kMoeGateUp, act8.q != nullptr ? nullptr : act, hidden, inter, 1,
                         gate_up_scale, tile_map, max_tiles);
  prm.x = xq;
  prm.x_row_bytes = hidden;
  prm.x_scale = x_scale;
  prm.x_scale_stride = x_scale_stride;
  prm.row_token = row_token;
  if (act8.q != nullptr) {
    if (act8.scale == nullptr || act8_rows < 0 || inter % 128 != 0 || !Aligned16(act8.q)) {
      return cudaErrorInvalidValue;
    }
    prm.act8 = act8.q;
    prm.act8_scale = act8.scale;
    prm.act8_rows = act8_rows;
    prm.act8_rows_pad = Fp8RowsPadded(act8_rows);
  }
  return Launch<Mode::kMoeGateUp, true>(tm_w, tm_w, tm_w, prm, stream);
}

cudaError_t Fp8MoeDown(const uint8_t* actq, const float* act_scale, int64_t act_scale_stride,
                       const uint8_t* down, const float* down_scale, int64_t hidden, int64_t inter,
                       int num_experts, const int32_t* tile_map, int64_t max_tiles, bf16* y,
                       cudaStream_t stream) {
  if (!ValidMoe(hidden, inter, num_experts, max_tiles) || act_scale_stride <= 0 ||
      act_scale_stride % 4 != 0 || !Aligned16(actq) || !Aligned16(act_scale) || !Aligned16(down) ||
      reinterpret_cast<uintptr_t>(y) % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  if (max_tiles == 0) return cudaSuccess;
  if (!HopperGemmsAvailable()) return cudaErrorNotSupported;
  CUtensorMap tm_x, tm_w, tm_s;
  // The activations' rows: act_scale_stride (the padded row count) of them.
  cudaError_t err =
      ActivationMaps(&tm_x, &tm_s, actq, act_scale, act_scale_stride, inter, act_scale_stride);
  if (err == cudaSuccess) err = OperandMap(&tm_w, down, true, num_experts * hidden, inter);
  if (err != cudaSuccess) return err;
  const Params prm =
      MoeParams(Mode::kMoeDown, y, hidden, inter, 1, down_scale, tile_map, max_tiles);
  return Launch<Mode::kMoeDown, true>(tm_x, tm_w, tm_s, prm, stream);
}

cudaError_t HopperMoeGateUpSwiGlu(const bf16* x, int64_t x_stride, const bf16* gate_up,
                                  int64_t hidden, int64_t inter, int num_experts,
                                  const int32_t* tile_map, int64_t max_tiles,
                                  const int32_t* row_token, bf16* act, cudaStream_t stream) {
  if (!ValidMoe(hidden, inter, num_experts, max_tiles) || x_stride < hidden || x_stride % 8 != 0 ||
      !Aligned16(x) || !Aligned16(gate_up) || reinterpret_cast<uintptr_t>(act) % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  if (max_tiles == 0) return cudaSuccess;
  if (!HopperGemmsAvailable()) return cudaErrorNotSupported;
  CUtensorMap tm_w;
  const cudaError_t err = OperandMap(&tm_w, gate_up, false, num_experts * 2 * inter, hidden);
  if (err != cudaSuccess) return err;
  Params prm = MoeParams(Mode::kMoeGateUp, act, hidden, inter, 2, nullptr, tile_map, max_tiles);
  prm.x = reinterpret_cast<const uint8_t*>(x);
  prm.x_row_bytes = x_stride * 2;
  prm.row_token = row_token;
  return Launch<Mode::kMoeGateUp, false>(tm_w, tm_w, tm_w, prm, stream);
}

cudaError_t HopperMoeDown(const bf16* act, int64_t rows, const bf16* down, int64_t hidden,
                          int64_t inter, int num_experts, const int32_t* tile_map,
                          int64_t max_tiles, bf16* y, cudaStream_t stream) {
  if (!ValidMoe(hidden, inter, num_experts, max_tiles) || rows < 0 || rows >= (int64_t{1} << 31) ||
      !Aligned16(act) || !Aligned16(down) || reinterpret_cast<uintptr_t>(y) % 4 != 0) {
    return cudaErrorInvalidValue;
  }
  if (max_tiles == 0 || rows == 0) return cudaSuccess;
  if (!HopperGemmsAvailable()) return cudaErrorNotSupported;
  CUtensorMap tm_x, tm_w;
  cudaError_t err = OperandMap(&tm_x, act, false, rows, inter);
  if (err == cudaSuccess) err = OperandMap(&tm_w, down, false, num_experts * hidden, inter);
  if (err != cudaSuccess) return err;
  const Params prm = MoeParams(Mode::kMoeDown, y, hidden, inter, 2, nullptr, tile_map, max_tiles);
  return Launch<Mode::kMoeDown, false>(tm_x, tm_w, tm_x, prm, stream);
}

}  // namespace draftfeed::cuda
