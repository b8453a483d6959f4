// The CUDA varlen causal attention against the fp32 CPU reference: odd packed
// sizes, head dims 256 and 128, q read in place from the interleaved
// query|gate projection with K and V from one fused buffer, the Qwen3.5-27B
// head shape, and the first and last heads of 8k-token prefills. Chunked
// prefill: a sequence's queries after a prefix (q_offset) against the
// one-pass run and the reference, on every kernel path.
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
#include "kernels/kernel_paths.cuh"
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

// Compares query heads [h0, h0 + n) of the GPU output with `want`, over
// tokens [first_token, T) (got holds those rows only).
void ExpectClose(const AttentionData& d, const std::vector<float>& got, int64_t h0, int64_t n,
                 const std::vector<float>& want, const std::string& what, int64_t first_token = 0) {
  const AttentionArgs& a = d.args();
  const int64_t hd = a.head_dim;
  size_t bad = 0;
  double worst = 0, err2 = 0, ref2 = 0;
  std::string first_bad;
  for (int64_t t = first_token; t < d.tokens(); ++t) {
    for (int64_t h = 0; h < n; ++h) {
      for (int64_t c = 0; c < hd; ++c) {
        const double g = got[((t - first_token) * a.num_q_heads + h0 + h) * hd + c];
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

// ---------------------------------------------------------------------------
// Chunked prefill: the queries after a prefix of p tokens of one sequence
// (AttentionArgs::q_offset), q read in place at row p, K and V of the whole
// sequence.

constexpr PortableKernels kModes[] = {PortableKernels::kAuto, PortableKernels::kSm100,
                                      PortableKernels::kSm120};

// Rows [p, T) of d's one sequence as a piece after a prefix of p tokens.
void RunPiece(const AttentionData& d, int32_t p, std::vector<float>* out) {
  AttentionArgs a = d.args();
  const int64_t n = d.tokens() - p;
  DeviceBuffer<int32_t> cu(std::vector<int32_t>{0, static_cast<int32_t>(n)});
  DeviceBuffer<bf16> piece(n * a.num_q_heads * a.head_dim);
  DF_CUDA_OK(cudaMemset(piece.get(), 0xFF, piece.size() * sizeof(bf16)));  // NaN poison
  a.q += p * a.q_stride;
  a.num_tokens = n;
  a.num_kv_tokens = d.tokens();
  a.q_offset = p;
  a.cu_seqlens = cu.get();
  a.max_seqlen = static_cast<int32_t>(n);
  a.out = piece.get();
  DF_CUDA_OK(VarlenCausalAttention(a, nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  *out = ToF32(piece.Download());
}

// Elements of `piece` (rows [p, T)) whose bits differ from the one-pass output's.
int64_t BitsDiffer(const std::vector<float>& piece, const std::vector<float>& one_pass,
                   int64_t first) {
  int64_t differ = 0;
  for (size_t i = 0; i < piece.size(); ++i) {
    differ += std::memcmp(&piece[i], &one_pass[first + i], sizeof(float)) != 0;
  }
  return differ;
}

// The query tile of head dim hd's kernel in the mode in force; 1 for the
// small-head kernel, which computes every row alone.
int QueryTile(int64_t hd) {
  if (hd < 128) return 1;
  AttentionPath path;
  if (ChooseAttentionPath(hd, &path) != cudaSuccess) return 0;
  return path.q_tile;
}

// One sequence split at each of `splits`, in each of `modes`: the piece after
// the split within the reference's tolerance (`ref`: the fp32 reference, or
// null for the one-pass output, itself checked by the tests above), and with
// the one-pass bits where the split is a multiple of the query tile (the same
// tiles, so the same products in the same order). Elsewhere a row meets a
// different number of key tiles past its diagonal, which add p = 0 and
// rescale by exp2(0) = 1; the count of differing elements is printed.
void CheckSplits(const Problem& pb, const std::vector<int32_t>& splits,
                 const std::vector<PortableKernels>& modes, bool with_reference,
                 const std::string& what) {
  AttentionData d(pb, 31);
  const std::vector<float> ref = with_reference ? d.Reference(0, pb.hq) : std::vector<float>{};
  const int64_t row = pb.hq * pb.hd;
  for (PortableKernels m : modes) {
    ScopedPortableKernels mode(m);
    const int q_tile = QueryTile(pb.hd);
    ASSERT_GT(q_tile, 0);
    d.PoisonOutput();
    DF_CUDA_OK(VarlenCausalAttention(d.args(), nullptr));
    DF_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<float> one_pass = d.Output();
    for (int32_t p : splits) {
      const std::string label = what + ", " + PortableKernelsName(m) + ", after " +
                                std::to_string(p) + " of " + std::to_string(d.tokens());
      std::vector<float> piece;
      RunPiece(d, p, &piece);
      if (::testing::Test::HasFatalFailure()) return;
      ExpectClose(d, piece, 0, pb.hq, with_reference ? ref : one_pass, label, p);
      const int64_t differ = BitsDiffer(piece, one_pass, p * row);
      std::printf("%s: %lld of %zu elements differ from one pass (query tile %d)\n", label.c_str(),
                  static_cast<long long>(differ), piece.size(), q_tile);
      if (p % q_tile == 0) {
        EXPECT_EQ(differ, 0) << label << ": not the one-pass bits";
      }
    }
  }
}

// 1 token, a 64-row tile less one, on and one past it, a 128-row tile, deep
// in the sequence, and all but the last query.
const std::vector<int32_t> kSplits = {1, 63, 64, 65, 128, 1000, 1099};
const std::vector<PortableKernels> kAllModes(std::begin(kModes), std::end(kModes));

TEST(AttentionCudaTest, PrefixSplitsHeadDim256) {
  DF_REQUIRE_GPU();
  CheckSplits({{1100}, 8, 2, 256, true}, kSplits, kAllModes, true, "prefix, hd 256");
}

TEST(AttentionCudaTest, PrefixSplitsHeadDim128) {
  DF_REQUIRE_GPU();
  CheckSplits({{1100}, 8, 2, 128, false}, kSplits, kAllModes, true, "prefix, hd 128");
}

TEST(AttentionCudaTest, PrefixSplitsSmallHeadDims) {
  DF_REQUIRE_GPU();
  const std::vector<int32_t> splits = {1, 63, 64, 65, 299};
  CheckSplits({{300}, 4, 2, 32, false}, splits, {PortableKernels::kAuto}, true, "prefix, hd 32");
  CheckSplits({{300}, 4, 2, 64, true}, splits, {PortableKernels::kAuto}, true, "prefix, hd 64");
}

// The Qwen3.5-27B heads, the last queries of an 8k-token sequence: after
// 7,680 (a multiple of every query tile) and 8,000 (of none but 64).
TEST(AttentionCudaTest, Qwen35PrefixOf8192) {
  DF_REQUIRE_GPU();
  CheckSplits({{8192}, 24, 4, 256, true}, {7680, 8000}, kAllModes, false,
              "prefix, Hq 24 / Hkv 4 / hd 256");
}

TEST(AttentionCudaTest, PrefixRejectsBadArguments) {
  DF_REQUIRE_GPU();
  for (const int64_t hd : {64, 256}) {
    AttentionData two({{3, 4}, 4, 2, hd, false}, 17);
    AttentionArgs a = two.args();
    a.q_offset = 2;  // two sequences
    a.num_kv_tokens = two.tokens() + 2;
    EXPECT_EQ(VarlenCausalAttention(a, nullptr), cudaErrorInvalidValue) << hd;
    AttentionData one({{6}, 4, 2, hd, false}, 18);
    a = one.args();
    a.q_offset = 2;  // num_kv_tokens 0 means T, not 2 + T
    EXPECT_EQ(VarlenCausalAttention(a, nullptr), cudaErrorInvalidValue) << hd;
    a.num_kv_tokens = one.tokens() + 3;
    EXPECT_EQ(VarlenCausalAttention(a, nullptr), cudaErrorInvalidValue) << hd;
    a = one.args();
    a.q_offset = -1;
    a.num_kv_tokens = one.tokens() - 1;
    EXPECT_EQ(VarlenCausalAttention(a, nullptr), cudaErrorInvalidValue) << hd;
    a = one.args();
    a.num_kv_tokens = one.tokens() + 1;  // no prefix: k/v rows must be the queries'
    EXPECT_EQ(VarlenCausalAttention(a, nullptr), cudaErrorInvalidValue) << hd;
    a.num_kv_tokens = one.tokens();  // spelt out, the same as 0
    EXPECT_EQ(VarlenCausalAttention(a, nullptr), cudaSuccess) << hd;
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace draftfeed::cuda
