// Batch invariance of the token kernels (skips without a GPU): the MoE layer
// (top-k routing, permutation, the grouped expert GEMMs in bf16 and FP8 on
// both the Hopper wgmma and the mma.sync kernels, the combine) and the target
// outputs (argmax, top-k, draft softmax from fp32 logits). A token's outputs
// computed with its sequence alone must equal, bit for bit, the same tokens'
// outputs inside packed batches of 5,200 and 20,000 tokens
// (batch_invariance_util.h). Packed, an expert's row tiles hold other tokens'
// rows too, and a token's rows sit at other places in them (the permutation
// places rows by global atomics, in no fixed order); the target outputs'
// cluster width is chosen from the token count.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/fp8_gemm_operands.cuh"
#include "kernels/hopper_gemm.cuh"
#include "kernels/kernel_paths.cuh"
#include "kernels/moe.cuh"
#include "kernels/random_init.cuh"
#include "kernels/target_outputs.cuh"
#include "tests/kernels/cuda/batch_invariance_util.h"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda {
namespace {

using ::draftfeed::testing::DeviceBuffer;
namespace bi = ::draftfeed::testing::batch_invariance;

// ---------------------------------------------------------------- MoE

struct MoeShape {
  const char* name;
  int experts, k;
  int64_t hidden, inter;
  bool shared;  // a shared expert, gated by the router's extra column
};
const MoeShape kMoeShapes[] = {
    {"MoE 35B-A3B (256 experts top 8, hidden 2048, inter 512, shared expert)", 256, 8, 2048, 512,
     true},
    {"MoE 30B-A3B (128 experts top 8, hidden 2048, inter 768)", 128, 8, 2048, 768, false},
};

// Token t's k rows of an expert-sorted [T·k, width] bf16 result, in slot
// order (through pair_row): a token's row of k·width values.
bi::Output PairRows(std::string name, const MoeBuffers& b, int k, const bf16* rows, int64_t width) {
  const int32_t* pair_row = b.routing.pair_row;
  const int64_t rb = width * 2;
  return {std::move(name), k * rb, [=](int64_t first, int64_t n) {
            std::vector<int32_t> pr(static_cast<size_t>(n * k));
            EXPECT_EQ(
                cudaMemcpy(pr.data(), pair_row + first * k, pr.size() * 4, cudaMemcpyDeviceToHost),
                cudaSuccess);
            std::vector<uint8_t> h(static_cast<size_t>(n * k * rb), 0);
            for (size_t i = 0; i < pr.size(); ++i) {
              if (pr[i] < 0) continue;
              EXPECT_EQ(cudaMemcpy(h.data() + i * rb, rows + int64_t{pr[i]} * width, rb,
                                   cudaMemcpyDeviceToHost),
                        cudaSuccess);
            }
            return h;
          }};
}

// One MoE layer's weights (bf16, and quantized to FP8 blocks) and buffers for
// kMaxTokens tokens.
class MoeLayer {
 public:
  explicit MoeLayer(const MoeShape& s)
      : s_(s),
        e_(s.experts),
        d_(s.hidden),
        i_(s.inter),
        sd_(Fp8ScaleStride(d_)),
        si_(Fp8ScaleStride(i_)),
        wgu_(e_ * 2 * i_ * d_),
        wd_(e_ * d_ * i_),
        gq_(e_ * 2 * i_ * d_),
        dq_(e_ * d_ * i_),
        gs_(e_ * 2 * i_ / 128 * sd_),
        ds_(e_ * d_ / 128 * si_),
        ws_(MoeWorkspaceBytes(bi::kMaxTokens, s.experts, s.k, d_, i_)),
        b_(CarveMoeWorkspace(ws_.get(), bi::kMaxTokens, s.experts, s.k, d_, i_)),
        xq_(Fp8RowsPadded(bi::kMaxTokens) * d_),
        aq_(Fp8RowsPadded(bi::kMaxTokens * s.k) * i_),
        xs_(Fp8RowsPadded(bi::kMaxTokens) * d_ / 128),
        as_(Fp8RowsPadded(bi::kMaxTokens * s.k) * i_ / 128),
        residual_(bi::kMaxTokens * d_) {
    DF_EXPECT_OK(FillRandomBf16(wgu_.get(), e_ * 2 * i_ * d_, 21, 0.02f, 0.0f, nullptr));
    DF_EXPECT_OK(FillRandomBf16(wd_.get(), e_ * d_ * i_, 22, 0.02f, 0.0f, nullptr));
    DF_EXPECT_OK(
        QuantizeWeightBlocksFp8(wgu_.get(), e_ * 2 * i_, d_, gq_.get(), gs_.get(), sd_, nullptr));
    DF_EXPECT_OK(
        QuantizeWeightBlocksFp8(wd_.get(), e_ * d_, i_, dq_.get(), ds_.get(), si_, nullptr));
    DF_EXPECT_OK(cudaDeviceSynchronize());
  }

  // x [D]; router logits [E + 1] (the last column the shared expert's gate);
  // the residual stream [D] fp32; the shared expert's output [D].
  std::vector<bi::InputSpec> Inputs() const {
    std::vector<bi::InputSpec> in = {{d_}, {e_ + 1, false, 2.0f}, {d_, true}};
    if (s_.shared) in.push_back({d_});
    return in;
  }

  std::vector<bi::Output> Run(const bi::Batch& b, const std::vector<void*>& in, bool fp8) {
    const int64_t t = b.tokens, rows = t * s_.k;
    const auto* x = static_cast<const bf16*>(in[0]);
    const auto* logits = static_cast<const bf16*>(in[1]);
    DF_EXPECT_OK(MoeTopK(logits, e_ + 1, t, s_.experts, s_.k, /*renormalize=*/true, b_.expert_ids,
                         b_.weights, nullptr));
    DF_EXPECT_OK(MoePermute(b_.expert_ids, t, s_.experts, s_.k, b_.routing, nullptr));
    if (fp8) {
      DF_EXPECT_OK(QuantizeActivationsFp8(x, d_, t, d_, xq_.get(), xs_.get(), nullptr));
      DF_EXPECT_OK(MoeGateUpSwiGluFp8(xq_.get(), xs_.get(), Fp8RowsPadded(t), gq_.get(), gs_.get(),
                                      d_, i_, s_.experts, rows, b_.routing, b_.act, nullptr));
      DF_EXPECT_OK(QuantizeActivationsFp8(b_.act, i_, rows, i_, aq_.get(), as_.get(), nullptr));
      DF_EXPECT_OK(MoeDownFp8(aq_.get(), as_.get(), Fp8RowsPadded(rows), dq_.get(), ds_.get(), d_,
                              i_, s_.experts, rows, b_.routing, b_.y, nullptr));
    } else {
      DF_EXPECT_OK(MoeGateUpSwiGlu(x, d_, wgu_.get(), d_, i_, s_.experts, rows, b_.routing, b_.act,
                                   nullptr));
      DF_EXPECT_OK(MoeDown(b_.act, wd_.get(), d_, i_, s_.experts, rows, b_.routing, b_.y, nullptr));
    }
    DF_EXPECT_OK(cudaMemcpy(residual_.get(), in[2], t * d_ * 4, cudaMemcpyDeviceToDevice));
    const bf16* shared = s_.shared ? static_cast<const bf16*>(in[3]) : nullptr;
    DF_EXPECT_OK(MoeCombine(b_.y, b_.routing.pair_row, b_.weights, t, s_.k, d_, shared, d_,
                            s_.shared ? logits + e_ : nullptr, e_ + 1, residual_.get(), nullptr));
    return {bi::DenseOutput("expert ids", b_.expert_ids, s_.k * 4),
            bi::DenseOutput("routing weights", b_.weights, s_.k * 4),
            PairRows("gate_up+SwiGLU rows", b_, s_.k, b_.act, i_),
            PairRows("down rows", b_, s_.k, b_.y, d_),
            bi::DenseOutput("residual after combine", residual_.get(), d_ * 4)};
  }

 private:
  MoeShape s_;
  int64_t e_, d_, i_, sd_, si_;
  DeviceBuffer<bf16> wgu_, wd_;
  DeviceBuffer<uint8_t> gq_, dq_;
  DeviceBuffer<float> gs_, ds_;
  DeviceBuffer<char> ws_;
  MoeBuffers b_;
  DeviceBuffer<uint8_t> xq_, aq_;
  DeviceBuffer<float> xs_, as_;
  DeviceBuffer<float> residual_;
};

void ExpectMoeInvariant(bool fp8) {
  bool hopper_in_auto = false;
  {
    ScopedPortableKernels scoped(PortableKernels::kAuto);
    hopper_in_auto = HopperGemmsAvailable();
  }
  for (const MoeShape& s : kMoeShapes) {
    MoeLayer layer(s);
    ASSERT_FALSE(::testing::Test::HasFailure());
    for (PortableKernels mode : {PortableKernels::kAuto, PortableKernels::kSm100}) {
      if (mode == PortableKernels::kSm100 && !hopper_in_auto) continue;  // auto ran mma.sync
      ScopedPortableKernels scoped(mode);
      const std::string what =
          std::string(s.name) + (fp8 ? ", FP8" : ", bf16") + ", " +
          (HopperGemmsAvailable() ? "wgmma (hopper_gemm.cu)" : "mma.sync (moe_gemm.cu)");
      bi::ExpectRowsDoNotDependOnTheBatch(
          what, layer.Inputs(),
          [&](const bi::Batch& b, const std::vector<void*>& in) { return layer.Run(b, in, fp8); });
    }
  }
}

TEST(KernelBatchInvarianceCudaTest, MoeBf16TokensDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  ExpectMoeInvariant(/*fp8=*/false);
}

TEST(KernelBatchInvarianceCudaTest, MoeFp8TokensDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  if (major < 9) GTEST_SKIP() << "e4m3 mma.sync needs sm_89+ (built for sm_90)";
  ExpectMoeInvariant(/*fp8=*/true);
}

// ---------------------------------------------------------------- target outputs

struct TargetCase {
  const char* name;
  int64_t vocab, draft;
  int32_t top_k;
  bool fp8;
};

TEST(KernelBatchInvarianceCudaTest, TargetOutputsRowsDoNotDependOnTheBatch) {
  DF_REQUIRE_GPU();
  // Qwen3.6's vocabulary and Qwen3's; draft vocabularies of 32,000 ids (a
  // cluster of 4 CTAs holds their slots, so fewer tokens than 2 per SM pair
  // widen it) and 65,536 (8 already, the widest).
  const TargetCase cases[] = {
      {"target outputs (vocab 248320, 32000 draft ids bf16, top 20)", 248320, 32000, 20, false},
      {"target outputs (vocab 248320, 65536 draft ids fp8, top 256)", 248320, 65536, 256, true},
      {"target outputs (vocab 151936, 32000 draft ids fp8, top 8)", 151936, 32000, 8, true},
  };
  for (const TargetCase& c : cases) {
    std::vector<int32_t> ids(static_cast<size_t>(c.vocab));
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937_64 rng(31);
    std::shuffle(ids.begin(), ids.end(), rng);
    ids.resize(static_cast<size_t>(c.draft));
    DeviceBuffer<int32_t> draft(ids);
    DeviceBuffer<uint8_t> index(DraftIndexBytes(c.vocab, c.draft));
    ASSERT_EQ(BuildDraftIndex(draft.get(), c.draft, c.vocab, index.get(), nullptr), cudaSuccess);
    // A token's row: argmax | top-k ids | top-k logprobs | scale | probs.
    const int64_t k = c.top_k;
    TargetOutputOffsets off;
    off.argmax = 0;
    off.top_k_ids = 4;
    off.top_k_logprobs = 4 + 4 * k;
    off.probs_scale = 4 + 8 * k;
    off.probs = 8 + 8 * k;
    off.probs_fp8 = c.fp8;
    const int64_t probs_bytes = c.draft * (c.fp8 ? 1 : 2);
    const int64_t pitch = (off.probs + probs_bytes + 15) / 16 * 16;
    DeviceBuffer<uint8_t> out(bi::kMaxTokens * pitch);
    bi::ExpectRowsDoNotDependOnTheBatch(
        c.name, {{c.vocab, true, 4.0f}}, [&](const bi::Batch& b, const std::vector<void*>& in) {
          DF_EXPECT_OK(TargetOutputsFromLogits(static_cast<const float*>(in[0]), b.tokens, c.vocab,
                                               c.vocab, index.get(), c.draft, c.top_k, off,
                                               out.get(), pitch, nullptr));
          const uint8_t* o = out.get();
          return std::vector<bi::Output>{
              bi::PitchedOutput("argmax", o, pitch, off.argmax, 4),
              bi::PitchedOutput("top-k ids", o, pitch, off.top_k_ids, 4 * k),
              bi::PitchedOutput("top-k logprobs", o, pitch, off.top_k_logprobs, 4 * k),
              c.fp8 ? bi::PitchedOutput("draft probs (scale, e4m3)", o, pitch, off.probs_scale,
                                        4 + probs_bytes)
                    : bi::PitchedOutput("draft probs (bf16)", o, pitch, off.probs, probs_bytes)};
        });
  }
}

}  // namespace
}  // namespace draftfeed::cuda
