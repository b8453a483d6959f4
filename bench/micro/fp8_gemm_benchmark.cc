// The FP8 GEMMs at the Qwen3.6-27B shapes: cuBLASLt's block-scaled GEMM,
// draftfeed's own Hopper one (Fp8OwnBlockGemm) and its portable mma.sync one
// (Fp8PortableBlockGemm, what sm_100 and sm_120 run), all as the engine runs them
// (activations per token and 128 group, weights per 128x128 block), beside
// two ceilings measured in the same run, cuBLASLt's bf16 GEMM and its
// per-tensor-scaled FP8 GEMM (the fastest FP8 mode it has, the limit block
// scaling approaches), plus the activation quantizers, which are
// memory-bound. Operands are real data: random bf16 quantized by the engine's
// own kernels (tensor cores draw less power on zeros, so zeros flatter).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bench/micro/gpu_benchmark.h"
#include "benchmark/benchmark.h"
#include "kernels/elementwise.cuh"
#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/fp8_gemm_portable.cuh"
#include "kernels/hopper_gemm.cuh"
#include "kernels/rmsnorm.cuh"
#include "server/model/cuda_fp8_gemm.h"
#include "server/model/cuda_gemm.h"

namespace draftfeed::bench {
namespace {

using cuda::bf16;
namespace s27 = qwen36_27b;

struct Operands {
  Operands(int64_t m, int64_t n, int64_t k)
      : x(m * k),
        w(n * k),
        xq(m * k),
        wq(n * k),
        xs(m * (k / 128)),
        ws((n + 127) / 128 * cuda::Fp8ScaleStride(k)),
        y(m * n),
        workspace(64 << 20) {
    FillRandom(x, 5);
    FillRandom(w, 6, 0.02f);
    if (x.get() && xq.get() && xs.get()) {
      NoteSetup(cuda::QuantizeActivationsFp8(x.get(), k, m, k, xq.get(), xs.get(), nullptr));
    }
    if (w.get() && wq.get() && ws.get()) {
      NoteSetup(cuda::QuantizeWeightBlocksFp8(w.get(), n, k, wq.get(), ws.get(),
                                              cuda::Fp8ScaleStride(k), nullptr));
    }
  }
  DeviceArray<bf16> x, w;
  DeviceArray<uint8_t> xq, wq;
  DeviceArray<float> xs, ws;
  DeviceArray<bf16> y;
  DeviceArray<char> workspace;
};

void RunBlockScaled(benchmark::State& state, int64_t n, int64_t k) {
  const int64_t m = state.range(0);
  Operands o(m, n, k);
  CublasLtFp8Gemm gemm;
  if (!gemm.Init(o.workspace.get(), o.workspace.bytes()).ok()) NoteSetup(cudaErrorUnknown);
  TimeKernel(state, {0, 2.0 * m * n * k}, [&] {
    absl::Status s =
        gemm.Run(o.xq.get(), o.xs.get(), o.wq.get(), o.ws.get(), o.y.get(), m, n, k, nullptr);
    return s.ok() ? cudaSuccess : cudaErrorNotSupported;
  });
}

// One of draftfeed's block-scaled GEMMs on the same operands: the Hopper one
// (kernels/hopper_gemm.cuh) or the portable one (kernels/fp8_gemm_portable.cuh).
using OwnGemm = cudaError_t (*)(const uint8_t*, const float*, const uint8_t*, const float*, int64_t,
                                bf16*, int64_t, int64_t, int64_t, int64_t, cudaStream_t);
void RunOwnBlockScaled(benchmark::State& state, int64_t n, int64_t k, OwnGemm gemm,
                       bool available) {
  const int64_t m = state.range(0);
  Operands o(m, n, k);
  if (!available) NoteSetup(cudaErrorNotSupported);
  TimeKernel(state, {0, 2.0 * m * n * k}, [&] {
    return gemm(o.xq.get(), o.xs.get(), o.wq.get(), o.ws.get(), cuda::Fp8ScaleStride(k), o.y.get(),
                n, m, n, k, nullptr);
  });
}

// The dense MLP's gate_up on our Hopper GEMM with SwiGLU and down's
// quantization in its epilogue (Fp8GemmSwiGluQuantize, the engine's path on
// Hopper): the GEMM's FLOPs, beside the plain GEMM of the same shape and the
// SwiGLU pass it saves.
void RunOwnGateUpSwiGluQuantize(benchmark::State& state, int64_t f, int64_t k) {
  const int64_t m = state.range(0);
  Operands o(m, 2 * f, k);
  DeviceArray<uint8_t> act8(m * f);
  DeviceArray<float> act8_scale(m * (f / 128));
  if (!cuda::HopperGemmsAvailable()) NoteSetup(cudaErrorNotSupported);
  TimeKernel(state, {0, 2.0 * m * 2 * f * k}, [&] {
    return cuda::Fp8GemmSwiGluQuantize(o.xq.get(), o.xs.get(), o.wq.get(), o.ws.get(),
                                       cuda::Fp8ScaleStride(k), m, f, k,
                                       {act8.get(), act8_scale.get()}, nullptr);
  });
}

void RunBf16(benchmark::State& state, int64_t n, int64_t k) {
  const int64_t m = state.range(0);
  Operands o(m, n, k);
  CublasLtGemm gemm;
  if (!gemm.Init(o.workspace.get(), o.workspace.bytes()).ok()) NoteSetup(cudaErrorUnknown);
  TimeKernel(state, {0, 2.0 * m * n * k}, [&] {
    return gemm.Run(o.x.get(), o.w.get(), o.y.get(), m, n, k, nullptr).ok() ? cudaSuccess
                                                                            : cudaErrorUnknown;
  });
}

// cuBLASLt's FP8 GEMM with one fp32 scale per tensor: not the checkpoint's
// maths, only the ceiling. Its own descriptor, the block-scaled one's layouts.
void RunTensorScaled(benchmark::State& state, int64_t n, int64_t k) {
  const int64_t m = state.range(0);
  Operands o(m, n, k);
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  size_t ws_bytes = static_cast<size_t>(o.workspace.bytes());
  const float* scale = o.ws.get();  // its first element, as the one scale of each operand
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  bool ok =
      cublasLtCreate(&handle) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ==
          CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb) ==
          CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale,
                                     sizeof scale) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale,
                                     sizeof scale) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&a, CUDA_R_8F_E4M3, k, n, k) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&b, CUDA_R_8F_E4M3, k, m, k) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatrixLayoutCreate(&c, CUDA_R_16BF, n, m, n) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &ws_bytes, sizeof ws_bytes) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, pref, 1, &result, &found) ==
          CUBLAS_STATUS_SUCCESS &&
      found > 0;
  if (!ok) NoteSetup(cudaErrorNotSupported);
  const float alpha = 1.0f, beta = 0.0f;
  TimeKernel(state, {0, 2.0 * m * n * k}, [&] {
    return cublasLtMatmul(handle, desc, &alpha, o.wq.get(), a, o.xq.get(), b, &beta, o.y.get(), c,
                          o.y.get(), c, &result.algo, o.workspace.get(), ws_bytes,
                          nullptr) == CUBLAS_STATUS_SUCCESS
               ? cudaSuccess
               : cudaErrorUnknown;
  });
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  for (cublasLtMatrixLayout_t l : {a, b, c}) {
    if (l) cublasLtMatrixLayoutDestroy(l);
  }
  if (desc) cublasLtMatmulDescDestroy(desc);
  if (handle) cublasLtDestroy(handle);
}

void RunQuantize(benchmark::State& state, int64_t k) {
  const int64_t m = state.range(0);
  DeviceArray<bf16> x(m * k);
  DeviceArray<uint8_t> xq(m * k);
  DeviceArray<float> xs(m * (k / 128));
  FillRandom(x, 3);
  TimeKernel(state, {m * k * 3.0 + m * (k / 128) * 4.0, 0}, [&] {
    return cuda::QuantizeActivationsFp8(x.get(), k, m, k, xq.get(), xs.get(), nullptr);
  });
}

void RunSwiGluQuantize(benchmark::State& state, int64_t f) {
  const int64_t m = state.range(0);
  DeviceArray<bf16> gate_up(m * 2 * f);
  DeviceArray<uint8_t> xq(m * f);
  DeviceArray<float> xs(m * (f / 128));
  FillRandom(gate_up, 4);
  TimeKernel(state, {m * f * 5.0 + m * (f / 128) * 4.0, 0}, [&] {
    return cuda::SwiGluQuantizeFp8(gate_up.get(), m, f, xq.get(), xs.get(), nullptr);
  });
}

// The producers of FP8 GEMM inputs, each fused with the quantization of its
// output (one pass) and unfused (the producer, then the quantizer), so the
// pass saved is measured in the same run. Bytes are the fused pass's.
void RunAddNormQuantize(benchmark::State& state, bool fused) {
  const int64_t m = state.range(0), d = s27::kHidden;
  DeviceArray<float> residual(m * d);
  DeviceArray<bf16> delta(m * d), w(d), out(m * d);
  DeviceArray<uint8_t> xq(m * d);
  DeviceArray<float> xs(m * (d / 128));
  FillRandom(residual, 5);
  FillRandom(delta, 6);
  FillRandom(w, 7, 0.1f);
  const cuda::Fp8Activations fp8{xq.get(), xs.get()};
  TimeKernel(state, {m * d * (4.0 + 2 + 4 + 2 + 1) + m * (d / 128) * 4.0, 0}, [&] {
    if (fused) {
      return cuda::AddRmsNormF32(residual.get(), delta.get(), w.get(), m, d, 1e-6f,
                                 cuda::NormKind::kZeroCentred, out.get(), nullptr, fp8);
    }
    const cudaError_t e = cuda::AddRmsNormF32(residual.get(), delta.get(), w.get(), m, d, 1e-6f,
                                              cuda::NormKind::kZeroCentred, out.get(), nullptr);
    if (e != cudaSuccess) return e;
    return cuda::QuantizeActivationsFp8(out.get(), d, m, d, xq.get(), xs.get(), nullptr);
  });
}

void RunOutputGateQuantize(benchmark::State& state, bool fused) {
  const int64_t m = state.range(0), heads = s27::kQHeads, hd = s27::kHeadDim;
  const int64_t row = heads * hd;
  DeviceArray<bf16> o(m * row), qg(m * s27::kAttnRow);
  DeviceArray<uint8_t> xq(m * row);
  DeviceArray<float> xs(m * (row / 128));
  FillRandom(o, 11);
  FillRandom(qg, 12, 1.0f, 30.0f);  // sigmoid = 1: o keeps its size over the repeats
  const bf16* gate = qg.get() + hd;
  const cuda::Fp8Activations fp8{xq.get(), xs.get()};
  TimeKernel(state, {m * row * (2.0 + 2 + 2 + 1) + m * (row / 128) * 4.0, 0}, [&] {
    if (fused) {
      return cuda::SigmoidGateMulQuantizeFp8(o.get(), gate, m, heads, hd, s27::kAttnRow, 2 * hd,
                                             fp8, nullptr);
    }
    const cudaError_t e =
        cuda::SigmoidGateMul(o.get(), gate, m, heads, hd, s27::kAttnRow, 2 * hd, nullptr);
    if (e != cudaSuccess) return e;
    return cuda::QuantizeActivationsFp8(o.get(), row, m, row, xq.get(), xs.get(), nullptr);
  });
}

#define DF_FP8_BENCHMARK(fn) DF_GPU_BENCHMARK(fn)->Arg(16384)->Arg(49152)
// The 27B's projections: attention [q·gate; k; v], GDN [qkv] and z, the
// MLP's [gate; up] and down, and the attention/GDN output projections.
#define DF_FP8_SHAPE(name, n, k)                                                              \
  void BM_Fp8BlockGemm_##name(benchmark::State& s) { RunBlockScaled(s, n, k); }               \
  DF_FP8_BENCHMARK(BM_Fp8BlockGemm_##name);                                                   \
  void BM_Fp8OwnBlockGemm_##name(benchmark::State& s) {                                       \
    RunOwnBlockScaled(s, n, k, cuda::Fp8BlockGemm, cuda::HopperGemmsAvailable());             \
  }                                                                                           \
  DF_FP8_BENCHMARK(BM_Fp8OwnBlockGemm_##name);                                                \
  void BM_Fp8PortableBlockGemm_##name(benchmark::State& s) {                                  \
    RunOwnBlockScaled(s, n, k, cuda::Fp8BlockGemmPortable, cuda::PortableFp8GemmAvailable()); \
  }                                                                                           \
  DF_FP8_BENCHMARK(BM_Fp8PortableBlockGemm_##name);                                           \
  void BM_Fp8TensorScaledCeiling_##name(benchmark::State& s) { RunTensorScaled(s, n, k); }    \
  DF_FP8_BENCHMARK(BM_Fp8TensorScaledCeiling_##name);                                         \
  void BM_Bf16Gemm_##name(benchmark::State& s) { RunBf16(s, n, k); }                          \
  DF_FP8_BENCHMARK(BM_Bf16Gemm_##name)

DF_FP8_SHAPE(MlpGateUp_Qwen36_27B, 2 * s27::kFfn, s27::kHidden);
DF_FP8_SHAPE(MlpDown_Qwen36_27B, s27::kHidden, s27::kFfn);
DF_FP8_SHAPE(AttnQkv_Qwen36_27B, s27::kAttnRow, s27::kHidden);
DF_FP8_SHAPE(GdnQkv_Qwen36_27B, s27::kConvChannels, s27::kHidden);
DF_FP8_SHAPE(GdnOut_Qwen36_27B, s27::kHidden, s27::kValueHeads* s27::kValueDim);

void BM_Fp8OwnGateUpSwiGluQuantize_Qwen36_27B(benchmark::State& s) {
  RunOwnGateUpSwiGluQuantize(s, s27::kFfn, s27::kHidden);
}
DF_FP8_BENCHMARK(BM_Fp8OwnGateUpSwiGluQuantize_Qwen36_27B);
void BM_Fp8QuantizeActivations_Hidden_Qwen36_27B(benchmark::State& s) {
  RunQuantize(s, s27::kHidden);
}
DF_FP8_BENCHMARK(BM_Fp8QuantizeActivations_Hidden_Qwen36_27B);
void BM_SwiGluQuantizeFp8_Qwen36_27B(benchmark::State& s) { RunSwiGluQuantize(s, s27::kFfn); }
DF_FP8_BENCHMARK(BM_SwiGluQuantizeFp8_Qwen36_27B);
void BM_AddRmsNormQuantizeFp8_Fused_Qwen36_27B(benchmark::State& s) { RunAddNormQuantize(s, true); }
DF_FP8_BENCHMARK(BM_AddRmsNormQuantizeFp8_Fused_Qwen36_27B);
void BM_AddRmsNormQuantizeFp8_Unfused_Qwen36_27B(benchmark::State& s) {
  RunAddNormQuantize(s, false);
}
DF_FP8_BENCHMARK(BM_AddRmsNormQuantizeFp8_Unfused_Qwen36_27B);
void BM_OutputGateQuantizeFp8_Fused_Qwen36_27B(benchmark::State& s) {
  RunOutputGateQuantize(s, true);
}
DF_FP8_BENCHMARK(BM_OutputGateQuantizeFp8_Fused_Qwen36_27B);
void BM_OutputGateQuantizeFp8_Unfused_Qwen36_27B(benchmark::State& s) {
  RunOutputGateQuantize(s, false);
}
DF_FP8_BENCHMARK(BM_OutputGateQuantizeFp8_Unfused_Qwen36_27B);

}  // namespace
}  // namespace draftfeed::bench
