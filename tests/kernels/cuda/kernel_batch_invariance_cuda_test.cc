// Batch invariance of the sequence kernels (skips without a GPU): attention,
// the GDN conv and chunked delta rule, and the row-wise norms and elementwise
// ops, at the real models' head shapes. A sequence's output rows computed
// alone must equal, bit for bit, the same rows with the sequence first, in
// the middle and last of packed batches of 5,200 and 20,000 tokens
// (batch_invariance_util.h). Each kernel path a GPU may run is forced in turn
// (kernel_paths.cuh), so a Hopper proves the portable ones too. By
// construction these kernels tile each sequence from its own first token
// (attention's query and KV tiles, GDN's 64-token chunks) or one row at a
// time (norms, elementwise), so a difference names a kernel that lets its
// neighbours or its place in the batch into a row's sum.
#include <cmath>
#include <cstdio>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.cuh"
#include "kernels/elementwise.cuh"
#include "kernels/gdn.cuh"
#include "kernels/kernel_paths.cuh"
#include "kernels/random_init.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "tests/kernels/cuda/batch_invariance_util.h"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda {
namespace {

using ::draftfeed::testing::DeviceBuffer;
namespace bi = ::draftfeed::testing::batch_invariance;

constexpr PortableKernels kModes[] = {PortableKernels::kAuto, PortableKernels::kSm100,
                                      PortableKernels::kSm120};

// ---------------------------------------------------------------- attention

struct AttentionShape {
  const char* name;
  int64_t hq, hkv, hd;
  bool gated;  // q read in place from [T, Hq, 2·hd] query|gate rows, as the 27B does
};

void ExpectAttentionInvariant(const AttentionShape& s, const std::string& path) {
  const int64_t q_row = s.hq * (s.gated ? 2 : 1) * s.hd, kv_row = s.hkv * s.hd;
  DeviceBuffer<bf16> out(bi::kMaxTokens * s.hq * s.hd);
  bi::ExpectRowsDoNotDependOnTheBatch(
      std::string(s.name) + ", " + path, {{q_row}, {kv_row}, {kv_row}},
      [&](const bi::Batch& b, const std::vector<void*>& in) {
        AttentionArgs a;
        a.q = static_cast<const bf16*>(in[0]);
        a.q_stride = q_row;
        a.q_head_stride = s.gated ? 2 * s.hd : s.hd;
        a.k = static_cast<const bf16*>(in[1]);
        a.k_stride = kv_row;
        a.v = static_cast<const bf16*>(in[2]);
        a.v_stride = kv_row;
        a.num_tokens = b.tokens;
        a.num_q_heads = s.hq;
        a.num_kv_heads = s.hkv;
        a.head_dim = s.hd;
        a.cu_seqlens = b.cu_dev;
        a.num_seqs = b.num_seqs;
        a.max_seqlen = b.max_seqlen;
        a.scale = 1.0f / std::sqrt(static_cast<float>(s.hd));
        a.out = out.get();
        DF_EXPECT_OK(VarlenCausalAttention(a, nullptr));
        return std::vector<bi::Output>{bi::DenseOutput("output", out.get(), s.hq * s.hd * 2)};
      });
}

TEST(KernelBatchInvarianceCudaTest, AttentionRowsDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  const AttentionShape shapes[] = {
      {"attention 27B (24 q / 4 kv heads, dim 256)", 24, 4, 256, true},
      {"attention 30B-A3B (32 q / 4 kv heads, dim 128)", 32, 4, 128, false},
  };
  for (const AttentionShape& s : shapes) {
    std::set<std::pair<bool, int>> done;  // a mode that picks a path already run adds nothing
    for (PortableKernels mode : kModes) {
      ScopedPortableKernels scoped(mode);
      AttentionPath path;
      ASSERT_EQ(ChooseAttentionPath(s.hd, &path), cudaSuccess);
      if (!done.insert({path.wgmma, path.kv_tile}).second) continue;
      const std::string name = std::string(path.wgmma ? "wgmma" : "mma.sync") + " " +
                               std::to_string(path.q_tile) + "x" + std::to_string(path.kv_tile) +
                               " tiles (mode " + PortableKernelsName(mode) + ")";
      ExpectAttentionInvariant(s, name);
    }
  }
}

// The exact kernel of head dims 32/64/96 (attention_small_heads.cu), which the
// test-sized models run.
TEST(KernelBatchInvarianceCudaTest, SmallHeadAttentionRowsDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  ExpectAttentionInvariant({"attention, small heads (4 q / 2 kv heads, dim 64)", 4, 2, 64, false},
                           "small-head kernel");
}

// ---------------------------------------------------------------- GDN

struct GdnShape {
  const char* name;
  int64_t nk, nv, dk, dv;
  int64_t channels() const { return 2 * nk * dk + nv * dv; }
};
const GdnShape kGdnShapes[] = {
    {"GDN 27B (16 k / 48 v heads, dim 128)", 16, 48, 128, 128},
    {"GDN 35B-A3B (16 k / 32 v heads, dim 128)", 16, 32, 128, 128},
};

TEST(KernelBatchInvarianceCudaTest, GdnConvRowsDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  constexpr int64_t kTaps = 4;
  for (const GdnShape& s : kGdnShapes) {
    const int64_t c = s.channels();
    // x: the in_proj's rows, q|k|v then z (the conv reads the first C).
    const int64_t x_stride = c + s.nv * s.dv;
    DeviceBuffer<bf16> w(c * kTaps), y(bi::kMaxTokens * c);
    ASSERT_EQ(FillRandomBf16(w.get(), c * kTaps, 7, 0.5f, 0.0f, nullptr), cudaSuccess);
    bi::ExpectRowsDoNotDependOnTheBatch(
        std::string(s.name) + ", causal conv1d + SiLU", {{x_stride}},
        [&](const bi::Batch& b, const std::vector<void*>& in) {
          DF_EXPECT_OK(CausalConv1dSilu(static_cast<const bf16*>(in[0]), x_stride, w.get(),
                                        b.tokens, c, kTaps, b.cu_dev, b.num_seqs, y.get(),
                                        nullptr));
          return std::vector<bi::Output>{bi::DenseOutput("output", y.get(), c * 2)};
        });
  }
}

TEST(KernelBatchInvarianceCudaTest, GatedDeltaRuleRowsDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  for (const GdnShape& s : kGdnShapes) {
    const int64_t c = s.channels();
    DeviceBuffer<float> a_log(s.nv), dt_bias(s.nv);
    // A = exp(A_log) in [1, 16], as the released models' init draws it.
    ASSERT_EQ(FillLogUniformF32(a_log.get(), s.nv, 8, 1.0f, 16.0f, nullptr), cudaSuccess);
    ASSERT_EQ(FillRandomF32(dt_bias.get(), s.nv, 9, 1.0f, 0.0f, nullptr), cudaSuccess);
    DeviceBuffer<bf16> out(bi::kMaxTokens * s.nv * s.dv);
    GdnScanPath auto_path;
    for (PortableKernels mode : {PortableKernels::kAuto, PortableKernels::kSm120}) {
      ScopedPortableKernels scoped(mode);
      GdnScanPath path;
      ASSERT_EQ(ChooseGdnScanPath(s.dk, s.dv, &path), cudaSuccess);
      if (mode == PortableKernels::kAuto) {
        auto_path = path;
      } else if (path.wgmma == auto_path.wgmma && path.stages == auto_path.stages) {
        continue;  // the same scan as auto's
      }
      bi::ExpectRowsDoNotDependOnTheBatch(
          std::string(s.name) + ", gated delta rule, " + (path.wgmma ? "wgmma " : "mma.sync ") +
              std::to_string(path.stages) + "-stage scan",
          // qkv after the conv; a | b (the in_proj_ba rows).
          {{c}, {2 * s.nv}}, [&](const bi::Batch& b, const std::vector<void*>& in) {
            GdnArgs a;
            a.qkv = static_cast<const bf16*>(in[0]);
            a.qkv_stride = c;
            a.a = static_cast<const bf16*>(in[1]);
            a.b = a.a + s.nv;
            a.ab_stride = 2 * s.nv;
            a.a_log = a_log.get();
            a.dt_bias = dt_bias.get();
            a.num_tokens = b.tokens;
            a.num_k_heads = s.nk;
            a.num_v_heads = s.nv;
            a.key_dim = s.dk;
            a.value_dim = s.dv;
            a.cu_seqlens = b.cu_dev;
            a.num_seqs = b.num_seqs;
            a.out = out.get();
            DeviceBuffer<unsigned char> ws(GdnWorkspaceBytes(a));
            DF_EXPECT_OK(GatedDeltaRule(a, ws.get(), nullptr));
            DF_EXPECT_OK(cudaDeviceSynchronize());  // before ws is freed
            return std::vector<bi::Output>{bi::DenseOutput("output", out.get(), s.nv * s.dv * 2)};
          });
    }
  }
}

// ---------------------------------------------------------------- row-wise ops

// The norms (one block or a slice of a warp per row, grids sized by T), RoPE
// with positions from cu_seqlens, RowDot and SwiGLU. In-place ops run on a
// copy of their input.
TEST(KernelBatchInvarianceCudaTest, NormsAndElementwiseRowsDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  constexpr float kEps = 1e-6f;
  {
    constexpr int64_t kD = 5120;  // the 27B's hidden size
    DeviceBuffer<bf16> w(kD), out(bi::kMaxTokens * kD);
    ASSERT_EQ(FillRandomBf16(w.get(), kD, 11, 0.1f, 0.0f, nullptr), cudaSuccess);
    bi::ExpectRowsDoNotDependOnTheBatch(
        "RmsNormF32 (hidden 5120)", {{kD, true}},
        [&](const bi::Batch& b, const std::vector<void*>& in) {
          DF_EXPECT_OK(RmsNormF32(static_cast<const float*>(in[0]), kD, w.get(), b.tokens, kD, kEps,
                                  NormKind::kZeroCentred, out.get(), kD, nullptr));
          return std::vector<bi::Output>{bi::DenseOutput("output", out.get(), kD * 2)};
        });
  }
  {
    constexpr int64_t kD = 2048;  // the MoE models' hidden size
    DeviceBuffer<bf16> w(kD), out(bi::kMaxTokens * kD);
    DeviceBuffer<float> residual(bi::kMaxTokens * kD);
    ASSERT_EQ(FillRandomBf16(w.get(), kD, 12, 0.1f, 0.0f, nullptr), cudaSuccess);
    bi::ExpectRowsDoNotDependOnTheBatch(
        "AddRmsNormF32 (hidden 2048)", {{kD, true}, {kD}},
        [&](const bi::Batch& b, const std::vector<void*>& in) {
          DF_EXPECT_OK(
              cudaMemcpy(residual.get(), in[0], b.tokens * kD * 4, cudaMemcpyDeviceToDevice));
          DF_EXPECT_OK(AddRmsNormF32(residual.get(), static_cast<const bf16*>(in[1]), w.get(),
                                     b.tokens, kD, kEps, NormKind::kMultiplicative, out.get(),
                                     nullptr));
          return std::vector<bi::Output>{bi::DenseOutput("residual", residual.get(), kD * 4),
                                         bi::DenseOutput("output", out.get(), kD * 2)};
        });
  }
  {
    // The 27B's q_norm: 24 heads of 256 inside the [T, 24, 2·256] query|gate rows.
    constexpr int64_t kHeads = 24, kHd = 256, kRow = kHeads * 2 * kHd;
    DeviceBuffer<bf16> w(kHd), x(bi::kMaxTokens * kRow);
    ASSERT_EQ(FillRandomBf16(w.get(), kHd, 13, 0.1f, 0.0f, nullptr), cudaSuccess);
    bi::ExpectRowsDoNotDependOnTheBatch(
        "RmsNormBf16InPlace (q_norm, 24 heads of 256)", {{kRow}},
        [&](const bi::Batch& b, const std::vector<void*>& in) {
          DF_EXPECT_OK(cudaMemcpy(x.get(), in[0], b.tokens * kRow * 2, cudaMemcpyDeviceToDevice));
          DF_EXPECT_OK(RmsNormBf16InPlace(x.get(), 2 * kHd, w.get(), b.tokens * kHeads, kHd, kEps,
                                          NormKind::kZeroCentred, nullptr));
          return std::vector<bi::Output>{bi::DenseOutput("output", x.get(), kRow * 2)};
        });
  }
  {
    // GDN's output norm, 27B: 48 value heads of 128 a token.
    constexpr int64_t kHeads = 48, kDv = 128, kRow = kHeads * kDv;
    DeviceBuffer<bf16> w(kDv), out(bi::kMaxTokens * kRow);
    ASSERT_EQ(FillRandomBf16(w.get(), kDv, 14, 0.1f, 1.0f, nullptr), cudaSuccess);
    bi::ExpectRowsDoNotDependOnTheBatch(
        "GatedRmsNorm (48 heads of 128)", {{kRow}, {kRow}},
        [&](const bi::Batch& b, const std::vector<void*>& in) {
          DF_EXPECT_OK(GatedRmsNorm(static_cast<const bf16*>(in[0]),
                                    static_cast<const bf16*>(in[1]), kDv, w.get(),
                                    b.tokens * kHeads, kDv, kEps, out.get(), nullptr));
          return std::vector<bi::Output>{bi::DenseOutput("output", out.get(), kRow * 2)};
        });
  }
  {
    // The 35B's shared-expert gate: a [T, 2048] by [2048] product.
    constexpr int64_t kD = 2048;
    DeviceBuffer<bf16> w(kD), out(bi::kMaxTokens);
    ASSERT_EQ(FillRandomBf16(w.get(), kD, 15, 0.02f, 0.0f, nullptr), cudaSuccess);
    bi::ExpectRowsDoNotDependOnTheBatch(
        "RowDot (width 2048)", {{kD}}, [&](const bi::Batch& b, const std::vector<void*>& in) {
          DF_EXPECT_OK(RowDot(static_cast<const bf16*>(in[0]), kD, w.get(), b.tokens, kD, out.get(),
                              nullptr));
          return std::vector<bi::Output>{bi::DenseOutput("output", out.get(), 2)};
        });
  }
  {
    // The 27B's partial rotary: 64 of 256 dims, θ = 10^7, positions restarting
    // at every sequence.
    constexpr int64_t kHeads = 24, kHd = 256, kRow = kHeads * kHd;
    DeviceBuffer<bf16> x(bi::kMaxTokens * kRow);
    DeviceBuffer<int32_t> pos(bi::kMaxTokens);
    bi::ExpectRowsDoNotDependOnTheBatch(
        "ApplyRope (24 heads of 256, rotary 64)", {{kRow}},
        [&](const bi::Batch& b, const std::vector<void*>& in) {
          DF_EXPECT_OK(cudaMemcpy(x.get(), in[0], b.tokens * kRow * 2, cudaMemcpyDeviceToDevice));
          DF_EXPECT_OK(PositionsFromCuSeqlens(b.cu_dev, b.num_seqs, b.tokens, pos.get(), nullptr));
          DF_EXPECT_OK(
              ApplyRope(x.get(), b.tokens, kHeads, kHd, kRow, kHd, 64, pos.get(), 1e7f, nullptr));
          return std::vector<bi::Output>{bi::DenseOutput("positions", pos.get(), 4),
                                         bi::DenseOutput("output", x.get(), kRow * 2)};
        });
  }
  {
    constexpr int64_t kF = 17408;  // the 27B's MLP
    DeviceBuffer<bf16> out(bi::kMaxTokens * kF);
    bi::ExpectRowsDoNotDependOnTheBatch(
        "SwiGlu (ffn 17408)", {{2 * kF}}, [&](const bi::Batch& b, const std::vector<void*>& in) {
          DF_EXPECT_OK(SwiGlu(static_cast<const bf16*>(in[0]), b.tokens, kF, out.get(), nullptr));
          return std::vector<bi::Output>{bi::DenseOutput("output", out.get(), kF * 2)};
        });
  }
}

}  // namespace
}  // namespace draftfeed::cuda
