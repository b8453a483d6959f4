// The memory-bound kernel families at Qwen3.6-27B shapes, in GB/s against HBM's spec and a copy.
//
// Bytes count each input read once and each output written once (weights of
// one row, a few KB, are left out). DeviceCopy is the measured ceiling: a
// device-to-device copy of the fp32 residual stream, read and written.
#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <vector>

#include "bench/micro/gpu_benchmark.h"
#include "benchmark/benchmark.h"
#include "kernels/capture_fp8.cuh"
#include "kernels/checksum.cuh"
#include "kernels/checksum_terms.h"
#include "kernels/elementwise.cuh"
#include "kernels/embedding.cuh"
#include "kernels/random_init.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"

namespace draftfeed::bench {
namespace {

using cuda::bf16;
using cuda::NormKind;
using qwen36_27b::kAttnRow;
using qwen36_27b::kCaptureSlots;
using qwen36_27b::kEps;
using qwen36_27b::kFfn;
using qwen36_27b::kHeadDim;
using qwen36_27b::kHidden;
using qwen36_27b::kKvHeads;
using qwen36_27b::kQHeads;
using qwen36_27b::kRopeTheta;
using qwen36_27b::kRotaryDim;
using qwen36_27b::kTokens;
using qwen36_27b::kValueDim;
using qwen36_27b::kValueHeads;
using qwen36_27b::kVocab;

constexpr double kF32 = sizeof(float), kBf16 = sizeof(bf16);
constexpr int64_t kT = kTokens, kD = kHidden;

void BM_DeviceCopy(benchmark::State& state) {
  DeviceArray<float> src(kT * kD), dst(kT * kD);
  FillRandom(src, 1);
  TimeKernel(state, {2.0 * src.bytes()}, [&] {
    return cudaMemcpyAsync(dst.get(), src.get(), src.bytes(), cudaMemcpyDeviceToDevice);
  });
}
DF_GPU_BENCHMARK(BM_DeviceCopy);

// ------------------------------------------------------------------ rmsnorm

// The final norm (and the input norm of every layer): fp32 residual -> bf16.
void BM_RmsNormF32(benchmark::State& state) {
  DeviceArray<float> x(kT * kD);
  DeviceArray<bf16> w(kD), out(kT * kD);
  FillRandom(x, 1);
  FillRandom(w, 2, 0.1f);
  TimeKernel(state, {kT * kD * (kF32 + kBf16)}, [&] {
    return cuda::RmsNormF32(x.get(), kD, w.get(), kT, kD, kEps, NormKind::kZeroCentred, out.get(),
                            kD, nullptr);
  });
}
DF_GPU_BENCHMARK(BM_RmsNormF32);

// A captured layer's norm written straight into its slot of [T, 5, D].
void BM_RmsNormF32IntoCaptureSlot(benchmark::State& state) {
  DeviceArray<float> x(kT * kD);
  DeviceArray<bf16> w(kD), capture(kT * kCaptureSlots * kD);
  FillRandom(x, 1);
  FillRandom(w, 2, 0.1f);
  TimeKernel(state, {kT * kD * (kF32 + kBf16)}, [&] {
    return cuda::RmsNormF32(x.get(), kD, w.get(), kT, kD, kEps, NormKind::kZeroCentred,
                            capture.get() + 2 * kD, kCaptureSlots * kD, nullptr);
  });
}
DF_GPU_BENCHMARK(BM_RmsNormF32IntoCaptureSlot);

// residual += mixer output, then the next norm: reads residual and delta,
// writes residual and the normed bf16. Each launch adds delta again; the
// values stay finite over any benchmark's iterations.
void BM_AddRmsNormF32(benchmark::State& state) {
  DeviceArray<float> residual(kT * kD);
  DeviceArray<bf16> delta(kT * kD), w(kD), out(kT * kD);
  FillRandom(residual, 1);
  FillRandom(delta, 2, 1e-3f);
  FillRandom(w, 3, 0.1f);
  TimeKernel(state, {kT * kD * (2 * kF32 + 2 * kBf16)}, [&] {
    return cuda::AddRmsNormF32(residual.get(), delta.get(), w.get(), kT, kD, kEps,
                               NormKind::kZeroCentred, out.get(), nullptr);
  });
}
DF_GPU_BENCHMARK(BM_AddRmsNormF32);

void BM_AddResidual(benchmark::State& state) {
  DeviceArray<float> residual(kT * kD);
  DeviceArray<bf16> delta(kT * kD);
  FillRandom(residual, 1);
  FillRandom(delta, 2, 1e-3f);
  TimeKernel(state, {kT * kD * (2 * kF32 + kBf16)},
             [&] { return cuda::AddResidual(residual.get(), delta.get(), kT, kD, nullptr); });
}
DF_GPU_BENCHMARK(BM_AddResidual);

// q_norm and k_norm as the engine runs them: one launch per head, in place
// in the attention projection (rows kAttnRow apart).
void BM_RmsNormBf16InPlaceQkHeads(benchmark::State& state) {
  DeviceArray<bf16> proj(kT * kAttnRow), w(kHeadDim);
  FillRandom(proj, 1);
  FillRandom(w, 2, 0.1f);
  const int64_t q_head_stride = 2 * kHeadDim, q_rows = kQHeads * q_head_stride;
  TimeKernel(state, {2.0 * kT * (kQHeads + kKvHeads) * kHeadDim * kBf16}, [&] {
    cudaError_t e = cudaSuccess;
    for (int64_t h = 0; h < kQHeads && e == cudaSuccess; ++h) {
      e = cuda::RmsNormBf16InPlace(proj.get() + h * q_head_stride, kAttnRow, w.get(), kT, kHeadDim,
                                   kEps, NormKind::kZeroCentred, nullptr);
    }
    for (int64_t h = 0; h < kKvHeads && e == cudaSuccess; ++h) {
      e = cuda::RmsNormBf16InPlace(proj.get() + q_rows + h * kHeadDim, kAttnRow, w.get(), kT,
                                   kHeadDim, kEps, NormKind::kZeroCentred, nullptr);
    }
    return e;
  });
}
DF_GPU_BENCHMARK(BM_RmsNormBf16InPlaceQkHeads);

// The GDN output norm: core [T*Nv, dv] gated by SiLU(z), z dense.
void BM_GatedRmsNorm(benchmark::State& state) {
  const int64_t rows = kT * kValueHeads;
  DeviceArray<bf16> core(rows * kValueDim), z(rows * kValueDim), w(kValueDim),
      out(rows * kValueDim);
  FillRandom(core, 1);
  FillRandom(z, 2);
  FillRandom(w, 3, 0.1f, 1.0f);
  TimeKernel(state, {3.0 * rows * kValueDim * kBf16}, [&] {
    return cuda::GatedRmsNorm(core.get(), z.get(), kValueDim, w.get(), rows, kValueDim, kEps,
                              out.get(), nullptr);
  });
}
DF_GPU_BENCHMARK(BM_GatedRmsNorm);

// --------------------------------------------------------------------- rope

// q and k rotated in place in the attention projection, as the engine does
// (two launches); only the first kRotaryDim dims of a head move.
void BM_ApplyRopeQk(benchmark::State& state) {
  DeviceArray<bf16> proj(kT * kAttnRow);
  const std::vector<int32_t> cu = Offsets({8192, 4096, 2048, 1024, 1024});
  DeviceArray<int32_t> d_cu(cu), pos(kT);
  FillRandom(proj, 1);
  if (SetupError() == cudaSuccess) {
    NoteSetup(cuda::PositionsFromCuSeqlens(d_cu.get(), static_cast<int32_t>(cu.size() - 1), kT,
                                           pos.get(), nullptr));
  }
  const int64_t q_head_stride = 2 * kHeadDim, q_rows = kQHeads * q_head_stride;
  TimeKernel(state, {2.0 * kT * (kQHeads + kKvHeads) * kRotaryDim * kBf16}, [&] {
    cudaError_t e = cuda::ApplyRope(proj.get(), kT, kQHeads, kHeadDim, kAttnRow, q_head_stride,
                                    kRotaryDim, pos.get(), kRopeTheta, nullptr);
    if (e != cudaSuccess) return e;
    return cuda::ApplyRope(proj.get() + q_rows, kT, kKvHeads, kHeadDim, kAttnRow, kHeadDim,
                           kRotaryDim, pos.get(), kRopeTheta, nullptr);
  });
}
DF_GPU_BENCHMARK(BM_ApplyRopeQk);

// -------------------------------------------------------------- elementwise

void BM_SwiGlu(benchmark::State& state) {
  DeviceArray<bf16> gate_up(kT * 2 * kFfn), out(kT * kFfn);
  FillRandom(gate_up, 1);
  TimeKernel(state, {3.0 * kT * kFfn * kBf16},
             [&] { return cuda::SwiGlu(gate_up.get(), kT, kFfn, out.get(), nullptr); });
}
DF_GPU_BENCHMARK(BM_SwiGlu);

// The attention output [T, Hq, hd] times sigmoid of the gate, read in place
// from the projection's interleaved query|gate heads.
void BM_SigmoidGateMul(benchmark::State& state) {
  DeviceArray<bf16> o(kT * kQHeads * kHeadDim), proj(kT * kAttnRow);
  FillRandom(o, 1);
  // Gates near +30: sigmoid rounds to 1, so o keeps its size over the
  // repeats instead of halving each time into denormals (whose division
  // takes the slow path: that measured the decay, at a quarter of HBM).
  FillRandom(proj, 2, 1.0f, 30.0f);
  TimeKernel(state, {3.0 * kT * kQHeads * kHeadDim * kBf16}, [&] {
    return cuda::SigmoidGateMul(o.get(), proj.get() + kHeadDim, kT, kQHeads, kHeadDim, kAttnRow,
                                2 * kHeadDim, nullptr);
  });
}
DF_GPU_BENCHMARK(BM_SigmoidGateMul);

void BM_CaptureResidual(benchmark::State& state) {
  DeviceArray<float> residual(kT * kD);
  DeviceArray<bf16> capture(kT * kCaptureSlots * kD);
  FillRandom(residual, 1);
  TimeKernel(state, {kT * kD * (kF32 + kBf16)}, [&] {
    return cuda::CaptureResidual(residual.get(), kT, kD, capture.get(), kCaptureSlots, 2, nullptr);
  });
}
DF_GPU_BENCHMARK(BM_CaptureResidual);

// The fp8_e4m3 wire encoding of a whole capture, [T, 5, D] bf16 in, codes and
// per-(token, layer) scales out. Each row is read twice (max, then divide);
// the second read is counted as free (it comes from L1/L2).
void BM_EncodeFp8Capture(benchmark::State& state) {
  DeviceArray<bf16> capture(kT * kCaptureSlots * kD);
  DeviceArray<uint8_t> out(kT * (kCaptureSlots * kD + 4 * kCaptureSlots));
  FillRandom(capture, 1);
  TimeKernel(state, {static_cast<double>(capture.bytes() + out.bytes())}, [&] {
    return cuda::EncodeFp8Capture(capture.get(), kT, kCaptureSlots, kD, out.get(), nullptr);
  });
}
DF_GPU_BENCHMARK(BM_EncodeFp8Capture);

// ---------------------------------------------------------------- embedding

// Rows of the real 248,320 x 5,120 table (2.5 GB) gathered for random ids.
void BM_EmbeddingLookup(benchmark::State& state) {
  std::vector<int32_t> ids(kT);
  std::mt19937 rng(3);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % kVocab);
  DeviceArray<int32_t> d_ids(ids);
  DeviceArray<bf16> table(kVocab * kD);
  DeviceArray<float> out(kT * kD);
  FillRandom(table, 1);
  TimeKernel(state, {kT * kD * (kBf16 + kF32)}, [&] {
    return cuda::EmbeddingLookup(d_ids.get(), kT, table.get(), kD, out.get(), nullptr);
  });
}
DF_GPU_BENCHMARK(BM_EmbeddingLookup);

// ----------------------------------------------------------------- checksum

// The lane sums of a whole capture, [T, 5, D] bf16 (800 MiB), read once.
void BM_PayloadLanes(benchmark::State& state) {
  DeviceArray<bf16> capture(kT * kCaptureSlots * kD);
  DeviceArray<unsigned long long> scratch(v1::kChecksumLanes);
  uint64_t* lanes = nullptr;  // pinned: the kernel's lane sums land here
  NoteSetup(cudaMallocHost(&lanes, v1::kChecksumLanes * sizeof(uint64_t)));
  FillRandom(capture, 1);
  TimeKernel(state, {static_cast<double>(capture.bytes())}, [&] {
    return cuda::EnqueuePayloadLanes(capture.get(), static_cast<size_t>(capture.bytes()),
                                     scratch.get(), lanes, nullptr);
  });
  cudaFreeHost(lanes);
}
DF_GPU_BENCHMARK(BM_PayloadLanes);

// -------------------------------------------------------------- random init

// One layer's fused [gate; up] weight, [2F, D] bf16, written once.
void BM_FillRandomBf16(benchmark::State& state) {
  DeviceArray<bf16> w(2 * kFfn * kD);
  TimeKernel(state, {static_cast<double>(w.bytes())},
             [&] { return cuda::FillRandomBf16(w.get(), w.size(), 7, 0.02f, 0.0f, nullptr); });
}
DF_GPU_BENCHMARK(BM_FillRandomBf16);

void BM_FillRandomF32(benchmark::State& state) {
  DeviceArray<float> p(kT * kD);
  TimeKernel(state, {static_cast<double>(p.bytes())},
             [&] { return cuda::FillRandomF32(p.get(), p.size(), 7, 1.0f, 0.0f, nullptr); });
}
DF_GPU_BENCHMARK(BM_FillRandomF32);

}  // namespace
}  // namespace draftfeed::bench
