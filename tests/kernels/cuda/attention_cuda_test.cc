// The CUDA varlen causal attention against the fp32 CPU reference: odd packed
// sizes, head dims 256 and 128, q read in place from the interleaved
// query|gate projection with K and V from one fused buffer, the Qwen3.5-27B
// head shape, and the first and last heads of 8k-token prefills.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/attention.cuh"
#include "kernels/cpu/attention.h"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda {
namespace {

using ::draftfeed::testing::DeviceBuffer;
using ::draftfeed::testing::RandomBf16Values;
using ::draftfeed::testing::ToBf16;
using ::draftfeed::testing::ToF32;

// Error budget of one output element against the fp32 reference, with
// bf16-representable inputs:
// - P is rounded to bf16 before P·V (FA2 does the same), each weight by at
//   most 2^-9 relative, while the normaliser Σp stays fp32, so
//   |ΔO| ≤ 2^-9·Σ p|v| / Σ p ≤ 2^-9·max|v|;
// - O is rounded to bf16 once: ≤ 2^-9·|O|;
// - fp32 accumulation order, the per-tile rescaling and ex2.approx add
//   ~1e-6 relative.
// The tolerance is twice the sum: 2^-8·(|ref| + max|v|). A wrong mask, index,
// stride or layout is off by orders of magnitude more. Measured worst cases
// are printed as a fraction of it: 0.26-0.39 on an H200, relative L2 error
// 1.7-1.9e-3.
constexpr double kTolUnit = 1.0 / 256;

struct Problem {
  std::vector<int32_t> lens;
  int64_t hq = 0, hkv = 0, hd = 0;
  // q inside a [T, Hq, 2·hd] query|gate buffer (gate half poisoned with NaN)
  // and K, V interleaved in one [T, 2, Hkv, hd] buffer; else all dense.
  bool fused_layout = false;
};

std::vector<int32_t> Offsets(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu = {0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

// Host data in the CPU reference's dense layouts, and the device copies in the
// layout under test.
class AttentionData {
 public:
  AttentionData(const Problem& pb, uint64_t seed) : pb_(pb), cu_(Offsets(pb.lens)), t_(cu_.back()) {
    q_ = RandomBf16Values(t_ * pb.hq * pb.hd, 1.5f, seed);
    k_ = RandomBf16Values(t_ * pb.hkv * pb.hd, 1.5f, seed + 1);
    v_ = RandomBf16Values(t_ * pb.hkv * pb.hd, 1.0f, seed + 2);
    for (float x : v_) max_abs_v_ = std::max(max_abs_v_, double(std::fabs(x)));

    const int64_t qh = pb.fused_layout ? 2 * pb.hd : pb.hd;
    std::vector<float> q_dev(t_ * pb.hq * qh, NAN);
    for (int64_t r = 0; r < t_ * pb.hq; ++r) std::copy_n(&q_[r * pb.hd], pb.hd, &q_dev[r * qh]);
    q_dev_ = std::make_unique<DeviceBuffer<bf16>>(ToBf16(q_dev));
    args_.q_stride = pb.hq * qh;
    args_.q_head_stride = qh;

    const int64_t kv_row = pb.hkv * pb.hd;
    if (pb.fused_layout) {
      std::vector<float> kv(t_ * 2 * kv_row);
      for (int64_t t = 0; t < t_; ++t) {
        std::copy_n(&k_[t * kv_row], kv_row, &kv[(2 * t) * kv_row]);
        std::copy_n(&v_[t * kv_row], kv_row, &kv[(2 * t + 1) * kv_row]);
      }
      kv_dev_ = std::make_unique<DeviceBuffer<bf16>>(ToBf16(kv));
      args_.k = kv_dev_->get();
      args_.v = kv_dev_->get() + kv_row;
      args_.k_stride = args_.v_stride = 2 * kv_row;
    } else {
      k_dev_ = std::make_unique<DeviceBuffer<bf16>>(ToBf16(k_));
      v_dev_ = std::make_unique<DeviceBuffer<bf16>>(ToBf16(v_));
      args_.k = k_dev_->get();
      args_.v = v_dev_->get();
      args_.k_stride = args_.v_stride = kv_row;
    }
    cu_dev_ = std::make_unique<DeviceBuffer<int32_t>>(cu_);
    out_dev_ = std::make_unique<DeviceBuffer<bf16>>(t_ * pb.hq * pb.hd);

    args_.q = q_dev_->get();
    args_.num_tokens = t_;
    args_.num_q_heads = pb.hq;
    args_.num_kv_heads = pb.hkv;
    args_.head_dim = pb.hd;
    args_.cu_seqlens = cu_dev_->get();
    args_.num_seqs = static_cast<int32_t>(pb.lens.size());
    args_.max_seqlen = *std::max_element(pb.lens.begin(), pb.lens.end());
    args_.scale = 1.0f / std::sqrt(static_cast<float>(pb.hd));
    args_.out = out_dev_->get();
  }

  const AttentionArgs& args() const { return args_; }
  int64_t tokens() const { return t_; }
  double max_abs_v() const { return max_abs_v_; }

  // Output filled with bf16 NaN, so an element never written fails.
  void PoisonOutput() const {
    ASSERT_EQ(cudaMemset(out_dev_->get(), 0xFF, out_dev_->size() * sizeof(bf16)), cudaSuccess);
  }
  std::vector<float> Output() const { return ToF32(out_dev_->Download()); }

  // CPU reference for query heads [h0, h0 + n) (the KV heads they read), as
  // [T, n, hd].
  std::vector<float> Reference(int64_t h0, int64_t n) const {
    const int64_t hd = pb_.hd, group = pb_.hq / pb_.hkv;
    if (n == pb_.hq) {
      std::vector<float> out(t_ * pb_.hq * hd);
      cpu::VarlenCausalAttention(q_.data(), k_.data(), v_.data(), cu_.data(),
                                 static_cast<int64_t>(pb_.lens.size()), pb_.hq, pb_.hkv, hd,
                                 args_.scale, out.data(), 0);
      return out;
    }
    std::vector<float> out(t_ * n * hd);
    std::vector<float> q1(t_ * hd), k1(t_ * hd), v1(t_ * hd), o1(t_ * hd);
    for (int64_t h = h0; h < h0 + n; ++h) {
      const int64_t kvh = h / group;
      for (int64_t t = 0; t < t_; ++t) {
        std::copy_n(&q_[(t * pb_.hq + h) * hd], hd, &q1[t * hd]);
        std::copy_n(&k_[(t * pb_.hkv + kvh) * hd], hd, &k1[t * hd]);
        std::copy_n(&v_[(t * pb_.hkv + kvh) * hd], hd, &v1[t * hd]);
      }
      cpu::VarlenCausalAttention(q1.data(), k1.data(), v1.data(), cu_.data(),
                                 static_cast<int64_t>(pb_.lens.size()), 1, 1, hd, args_.scale,
                                 o1.data(), 0);
      for (int64_t t = 0; t < t_; ++t) std::copy_n(&o1[t * hd], hd, &out[(t * n + (h - h0)) * hd]);
    }
    return out;
  }

 private:
  Problem pb_;
  std::vector<int32_t> cu_;
  int64_t t_;
  std::vector<float> q_, k_, v_;
  double max_abs_v_ = 0;
  AttentionArgs args_;
  std::unique_ptr<DeviceBuffer<bf16>> q_dev_, k_dev_, v_dev_, kv_dev_, out_dev_;
  std::unique_ptr<DeviceBuffer<int32_t>> cu_dev_;
};

// Compares query heads [h0, h0 + n) of the GPU output with `want`.
void ExpectClose(const AttentionData& d, const std::vector<float>& got, int64_t h0, int64_t n,
                 const std::vector<float>& want, const std::string& what) {
  const AttentionArgs& a = d.args();
  const int64_t hd = a.head_dim;
  size_t bad = 0;
  double worst = 0, err2 = 0, ref2 = 0;
  std::string first_bad;
  for (int64_t t = 0; t < d.tokens(); ++t) {
    for (int64_t h = 0; h < n; ++h) {
      for (int64_t c = 0; c < hd; ++c) {
        const double g = got[(t * a.num_q_heads + h0 + h) * hd + c];
        const double w = want[(t * n + h) * hd + c];
        const double tol = kTolUnit * (std::fabs(w) + d.max_abs_v());
        const double err = std::fabs(g - w);
        err2 += (g - w) * (g - w);
        ref2 += w * w;
        if (!(err <= tol)) {  // NaN fails too
          if (bad++ == 0) {
            first_bad = "token " + std::to_string(t) + " head " + std::to_string(h0 + h) + " col " +
                        std::to_string(c) + ": " + std::to_string(g) + " vs " + std::to_string(w);
          }
        }
        worst = std::max(worst, err / tol);
      }
    }
  }
  std::printf("%s: max error %.3f of tolerance, relative L2 error %.2e\n", what.c_str(), worst,
              std::sqrt(err2 / ref2));
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " elements out of tolerance, first at " << first_bad;
}

void CheckAll(const Problem& pb, uint64_t seed, const std::string& what) {
  AttentionData d(pb, seed);
  d.PoisonOutput();
  DF_CUDA_OK(VarlenCausalAttention(d.args(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  ExpectClose(d, d.Output(), 0, pb.hq, d.Reference(0, pb.hq), what);
}

const std::vector<int32_t> kOddLens = {1, 7, 64, 65, 130, 3};

TEST(AttentionCudaTest, OddPackedSizesHeadDim256) {
  DF_REQUIRE_GPU();
  CheckAll({kOddLens, 4, 2, 256, false}, 11, "odd sizes, hd 256");
}

TEST(AttentionCudaTest, OddPackedSizesHeadDim128) {
  DF_REQUIRE_GPU();
  CheckAll({kOddLens, 4, 2, 128, false}, 12, "odd sizes, hd 128");
}

// The simple kernel for the small head dims of test-sized models.
TEST(AttentionCudaTest, OddPackedSizesSmallHeadDims) {
  DF_REQUIRE_GPU();
  CheckAll({kOddLens, 4, 2, 32, false}, 21, "odd sizes, hd 32");
  CheckAll({kOddLens, 4, 2, 64, true}, 22, "odd sizes, hd 64, q in query|gate");
}

TEST(AttentionCudaTest, QueryInsideGateProjectionAndFusedKv) {
  DF_REQUIRE_GPU();
  CheckAll({kOddLens, 4, 2, 256, true}, 13, "q in query|gate, fused kv, hd 256");
  CheckAll({kOddLens, 4, 2, 128, true}, 14, "q in query|gate, fused kv, hd 128");
}

TEST(AttentionCudaTest, Qwen35Shape) {
  DF_REQUIRE_GPU();
  // 24 query / 4 KV heads of 256, about 1,000 tokens in 3 sequences.
  CheckAll({{517, 389, 94}, 24, 4, 256, true}, 15, "Qwen3.5-27B heads, 1000 tokens");
}

TEST(AttentionCudaTest, RejectsBadArguments) {
  DF_REQUIRE_GPU();
  AttentionData d({{5}, 4, 2, 256, false}, 16);
  AttentionArgs a = d.args();
  a.head_dim = 48;
  EXPECT_EQ(VarlenCausalAttention(a, nullptr), cudaErrorInvalidValue);
  a = d.args();
  a.num_kv_heads = 3;
  EXPECT_EQ(VarlenCausalAttention(a, nullptr), cudaErrorInvalidValue);
  a = d.args();
  a.q_stride += 1;  // rows no longer 16-byte aligned
  EXPECT_EQ(VarlenCausalAttention(a, nullptr), cudaErrorInvalidValue);
}

// An 8k-token prefill (many KV tiles per query tile, the real head shapes),
// checked on the first and last query heads against the CPU reference (the
// whole output would take the CPU minutes). Its timing is in
// bench/micro/attention_benchmark.cc.
void SpotCheckLong(const Problem& pb, const std::string& what) {
  AttentionData d(pb, 21);
  d.PoisonOutput();
  ASSERT_EQ(VarlenCausalAttention(d.args(), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = d.Output();
  ExpectClose(d, got, 0, 1, d.Reference(0, 1), what + ", head 0");
  ExpectClose(d, got, pb.hq - 1, 1, d.Reference(pb.hq - 1, 1), what + ", last head");
}

TEST(AttentionCudaTest, Qwen35OneSequenceOf8192EdgeHeads) {
  DF_REQUIRE_GPU();
  SpotCheckLong({{8192}, 24, 4, 256, true}, "1x8192, Hq 24 / Hkv 4 / hd 256");
}

TEST(AttentionCudaTest, Qwen35TwoSequencesOf4096EdgeHeads) {
  DF_REQUIRE_GPU();
  SpotCheckLong({{4096, 4096}, 24, 4, 256, true}, "2x4096, Hq 24 / Hkv 4 / hd 256");
}

TEST(AttentionCudaTest, Qwen3HeadDim128OneSequenceOf8192EdgeHeads) {
  DF_REQUIRE_GPU();
  SpotCheckLong({{8192}, 32, 8, 128, false}, "1x8192, Hq 32 / Hkv 8 / hd 128");
}

}  // namespace
}  // namespace draftfeed::cuda
