// The kernel variants each GPU runs (kernels/kernel_paths.cuh), all of them on
// whatever GPU is present: the mode an sm_100 GPU runs (no wgmma) and an
// sm_120 GPU's (no wgmma, 99 KB of shared memory a block) are forced in
// process, so a Hopper proves the Blackwell paths. Checks which variant each
// mode picks, attention's result in each against the fp32 CPU reference, and
// that the GDN scan gives the same bits on every path (wgmma, two stages, one).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.cuh"
#include "kernels/cpu/attention.h"
#include "kernels/gdn.cuh"
#include "kernels/kernel_paths.cuh"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda {
namespace {

using ::draftfeed::testing::DeviceBuffer;
using ::draftfeed::testing::RandomBf16Values;
using ::draftfeed::testing::ToBf16;
using ::draftfeed::testing::ToF32;

constexpr PortableKernels kModes[] = {PortableKernels::kAuto, PortableKernels::kSm100,
                                      PortableKernels::kSm120};

std::vector<int32_t> Offsets(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

int ComputeMajor() {
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  return major;
}

TEST(KernelPathsTest, ParsesTheEnvironmentValues) {
  PortableKernels mode = PortableKernels::kSm100;
  EXPECT_TRUE(ParsePortableKernels(nullptr, &mode));
  EXPECT_EQ(mode, PortableKernels::kAuto);
  for (const char* v : {"", "0"}) {
    mode = PortableKernels::kSm100;
    EXPECT_TRUE(ParsePortableKernels(v, &mode)) << v;
    EXPECT_EQ(mode, PortableKernels::kAuto) << v;
  }
  EXPECT_TRUE(ParsePortableKernels("sm100", &mode));
  EXPECT_EQ(mode, PortableKernels::kSm100);
  for (const char* v : {"1", "sm120"}) {
    mode = PortableKernels::kAuto;
    EXPECT_TRUE(ParsePortableKernels(v, &mode)) << v;
    EXPECT_EQ(mode, PortableKernels::kSm120) << v;
  }
  for (const char* v : {"2", "yes", "sm90", "SM120", " 1"}) {
    mode = PortableKernels::kSm100;
    EXPECT_FALSE(ParsePortableKernels(v, &mode)) << v;
    EXPECT_EQ(mode, PortableKernels::kSm100) << v;
  }
}

TEST(KernelPathsTest, ScopedModeOverridesAndRestores) {
  const PortableKernels before = PortableKernelsMode();
  {
    ScopedPortableKernels outer(PortableKernels::kSm120);
    EXPECT_EQ(PortableKernelsMode(), PortableKernels::kSm120);
    EXPECT_FALSE(HopperKernelsAllowed());
    {
      ScopedPortableKernels inner(PortableKernels::kAuto);
      EXPECT_TRUE(HopperKernelsAllowed());
    }
    EXPECT_EQ(PortableKernelsMode(), PortableKernels::kSm120);
  }
  EXPECT_EQ(PortableKernelsMode(), before);
}

// Which variant each mode takes on this GPU.
TEST(KernelPathsTest, EachModeTakesItsGpusVariants) {
  DF_REQUIRE_GPU();
  int device_smem = 0;
  {
    ScopedPortableKernels mode(PortableKernels::kAuto);
    DF_CUDA_OK(SmemPerBlockLimit(&device_smem));
  }
  for (PortableKernels m : kModes) {
    ScopedPortableKernels mode(m);
    SCOPED_TRACE(PortableKernelsName(m));
    int smem = 0;
    DF_CUDA_OK(SmemPerBlockLimit(&smem));
    EXPECT_EQ(smem, m == PortableKernels::kSm120 ? std::min(device_smem, kSm120SmemPerBlock)
                                                 : device_smem);
    for (int64_t hd : {128, 256}) {
      AttentionPath path;
      DF_CUDA_OK(ChooseAttentionPath(hd, &path));
      // The default build holds sm_90a SASS, whose attention is wgmma.
      EXPECT_EQ(path.wgmma, m == PortableKernels::kAuto && ComputeMajor() == 9) << "hd " << hd;
      EXPECT_LE(path.smem_bytes, smem) << "hd " << hd;
      // 64-key tiles need 81 KB at hd 128 and 161 KB at hd 256; 32-key ones 97 KB.
      if (!path.wgmma && smem >= 200 * 1024) {
        EXPECT_EQ(path.kv_tile, 64) << "hd " << hd;
      }
      if (!path.wgmma && smem <= kSm120SmemPerBlock) {
        EXPECT_EQ(path.kv_tile, hd == 256 ? 32 : 64) << "hd " << hd;
      }
    }
    // The GDN scan at dk = dv = 128: wgmma (three stages) where attention
    // takes wgmma too; else mma.sync, whose two stages need 151 KB.
    GdnScanPath scan;
    DF_CUDA_OK(ChooseGdnScanPath(128, 128, &scan));
    const bool wgmma = m == PortableKernels::kAuto && ComputeMajor() == 9;
    EXPECT_EQ(scan.wgmma, wgmma);
    if (wgmma) {
      EXPECT_EQ(scan.stages, 3);
    }
    if (!wgmma && smem >= 200 * 1024) {
      EXPECT_EQ(scan.stages, 2);
    }
    if (smem <= kSm120SmemPerBlock) {
      EXPECT_EQ(scan.stages, 1);
    }
    DF_CUDA_OK(ChooseGdnScanPath(32, 32, &scan));  // mma.sync, two stages on every GPU
    EXPECT_FALSE(scan.wgmma);
    EXPECT_EQ(scan.stages, 2);
  }
  AttentionPath path;
  EXPECT_EQ(ChooseAttentionPath(64, &path), cudaErrorInvalidValue);
  GdnScanPath scan;
  EXPECT_EQ(ChooseGdnScanPath(128, 96, &scan), cudaErrorInvalidValue);
}

// Attention at head dims 128 and 256 (the Qwen3.5-27B head shape) in every
// mode against the fp32 reference. The tolerance is attention_cuda_test's
// error budget, 2^-8·(|ref| + max|v|): P rounded to bf16 (2^-9 of max|v|),
// one bf16 rounding of O (2^-9 relative), doubled; the KV tile changes only
// where the online softmax rescales, which that budget already covers.
TEST(KernelPathsTest, AttentionMatchesTheReferenceInEveryMode) {
  DF_REQUIRE_GPU();
  const std::vector<int32_t> lens = {1, 77, 128, 300};
  const std::vector<int32_t> cu = Offsets(lens);
  const int64_t T = cu.back();
  for (const int64_t hd : {128, 256}) {
    const int64_t hq = hd == 256 ? 24 : 16, hkv = 4;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    const std::vector<float> q = RandomBf16Values(T * hq * hd, 1.5f, 11 + hd);
    const std::vector<float> k = RandomBf16Values(T * hkv * hd, 1.5f, 12 + hd);
    const std::vector<float> v = RandomBf16Values(T * hkv * hd, 1.0f, 13 + hd);
    std::vector<float> ref(T * hq * hd);
    cpu::VarlenCausalAttention(q.data(), k.data(), v.data(), cu.data(),
                               static_cast<int64_t>(lens.size()), hq, hkv, hd, scale, ref.data(),
                               0);
    float max_v = 0;
    for (float x : v) max_v = std::max(max_v, std::fabs(x));
    DeviceBuffer<bf16> d_q(ToBf16(q)), d_k(ToBf16(k)), d_v(ToBf16(v)), d_out(T * hq * hd);
    DeviceBuffer<int32_t> d_cu(cu);
    for (PortableKernels m : kModes) {
      ScopedPortableKernels mode(m);
      SCOPED_TRACE(::testing::Message() << PortableKernelsName(m) << " hd " << hd);
      AttentionArgs a;
      a.q = d_q.get();
      a.q_stride = hq * hd;
      a.q_head_stride = hd;
      a.k = d_k.get();
      a.k_stride = hkv * hd;
      a.v = d_v.get();
      a.v_stride = hkv * hd;
      a.num_tokens = T;
      a.num_q_heads = hq;
      a.num_kv_heads = hkv;
      a.head_dim = hd;
      a.cu_seqlens = d_cu.get();
      a.num_seqs = static_cast<int32_t>(lens.size());
      a.max_seqlen = *std::max_element(lens.begin(), lens.end());
      a.scale = scale;
      a.out = d_out.get();
      DF_CUDA_OK(cudaMemset(d_out.get(), 0xff, T * hq * hd * sizeof(bf16)));  // NaN poison
      DF_CUDA_OK(VarlenCausalAttention(a, nullptr));
      DF_CUDA_OK(cudaDeviceSynchronize());
      const std::vector<float> out = ToF32(d_out.Download());
      double worst = 0;
      for (int64_t i = 0; i < T * hq * hd; ++i) {
        const double tol = std::ldexp(1.0, -8) * (std::fabs(ref[i]) + max_v);
        ASSERT_TRUE(std::isfinite(out[i])) << "unwritten at " << i;
        ASSERT_LE(std::fabs(out[i] - ref[i]), tol)
            << "token " << i / (hq * hd) << " head " << i / hd % hq << " gpu " << out[i] << " ref "
            << ref[i];
        worst = std::max(worst, std::fabs(out[i] - ref[i]) / tol);
      }
      AttentionPath path;
      DF_CUDA_OK(ChooseAttentionPath(hd, &path));
      std::printf("attention hd %lld, %s: %s %d-key tiles, worst error %.2f of the tolerance\n",
                  static_cast<long long>(hd), PortableKernelsName(m),
                  path.wgmma ? "wgmma" : "mma.sync", path.kv_tile, worst);
    }
  }
}

// The GDN rule at the Qwen3.5 head dims (dk = dv = 128) with sequences that
// end inside, on and past chunk boundaries: every scan this GPU can run
// (wgmma on Hopper, the two-stage mma.sync scan (sm100) and the one-stage one
// (sm120)) must give the same bits: the same products in the same order; only
// the instructions and when the next chunk is loaded differ.
TEST(KernelPathsTest, GdnScanPathsGiveTheSameBits) {
  DF_REQUIRE_GPU();
  const std::vector<int32_t> lens = {1, 63, 64, 65, 200, 517};
  const std::vector<int32_t> cu = Offsets(lens);
  const int64_t T = cu.back(), nk = 2, nv = 4, dk = 128, dv = 128;
  const int64_t stride = 2 * nk * dk + nv * dv;
  const std::vector<float> qkv = RandomBf16Values(T * stride, 1.0f, 21);
  const std::vector<float> a = RandomBf16Values(T * nv, 1.0f, 22);
  const std::vector<float> b = RandomBf16Values(T * nv, 1.5f, 23);
  const std::vector<float> dt_bias = RandomBf16Values(nv, 1.0f, 24);
  std::vector<float> a_log(nv);  // A = exp(A_log) over [0.01, 16]: fast and slow decays
  for (int64_t h = 0; h < nv; ++h) {
    a_log[h] = static_cast<float>(std::log(0.01) + h * std::log(1600.0) / (nv - 1));
  }
  DeviceBuffer<bf16> d_qkv(ToBf16(qkv)), d_a(ToBf16(a)), d_b(ToBf16(b)), d_out(T * nv * dv);
  DeviceBuffer<float> d_a_log(a_log), d_dt_bias(dt_bias);
  DeviceBuffer<int32_t> d_cu(cu);
  GdnArgs args;
  args.qkv = d_qkv.get();
  args.qkv_stride = stride;
  args.a = d_a.get();
  args.b = d_b.get();
  args.ab_stride = nv;
  args.a_log = d_a_log.get();
  args.dt_bias = d_dt_bias.get();
  args.num_tokens = T;
  args.num_k_heads = nk;
  args.num_v_heads = nv;
  args.key_dim = dk;
  args.value_dim = dv;
  args.cu_seqlens = d_cu.get();
  args.num_seqs = static_cast<int32_t>(lens.size());
  args.out = d_out.get();
  DeviceBuffer<unsigned char> ws(GdnWorkspaceBytes(args));

  std::vector<std::vector<bf16>> outs;
  std::vector<std::string> names;
  for (PortableKernels m : kModes) {
    ScopedPortableKernels mode(m);
    GdnScanPath path;
    DF_CUDA_OK(ChooseGdnScanPath(dk, dv, &path));
    names.push_back(std::string(path.wgmma ? "wgmma " : "mma.sync ") + std::to_string(path.stages) +
                    "-stage");
    DF_CUDA_OK(cudaMemset(d_out.get(), 0xff, T * nv * dv * sizeof(bf16)));  // NaN poison
    DF_CUDA_OK(GatedDeltaRule(args, ws.get(), nullptr));
    DF_CUDA_OK(cudaDeviceSynchronize());
    outs.push_back(d_out.Download());
  }
  EXPECT_EQ(names.back(), "mma.sync 1-stage");
  const std::vector<float> first = ToF32(outs[0]);
  for (int64_t i = 0; i < T * nv * dv; ++i) {
    ASSERT_TRUE(std::isfinite(first[i])) << "unwritten at " << i;
  }
  for (size_t m = 1; m < outs.size(); ++m) {
    ASSERT_EQ(std::memcmp(outs[0].data(), outs[m].data(), outs[0].size() * sizeof(bf16)), 0)
        << names[0] << " and " << names[m] << " scans differ";
    std::printf("GDN scan: %s and %s, identical bits over %lld tokens\n", names[0].c_str(),
                names[m].c_str(), static_cast<long long>(T));
  }
}

}  // namespace
}  // namespace draftfeed::cuda
