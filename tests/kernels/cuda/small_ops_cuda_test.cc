// The memory-bound op families (embedding, rmsnorm, rope, elementwise) against
// their CPU references on odd sizes, strided rows and in-place slices.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/elementwise.cuh"
#include "kernels/embedding.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda {
namespace {

using ::draftfeed::testing::DeviceBuffer;
using ::draftfeed::testing::RandomBf16Values;
using ::draftfeed::testing::ToBf16;
using ::draftfeed::testing::ToF32;

#define DF_SYNC_OK() DF_CUDA_OK(cudaDeviceSynchronize())

// bf16 NaN: outputs are poisoned with it, so an element the kernel should have
// written and did not shows up, and one it should not touch must keep it.
constexpr uint16_t kPoison = 0xFFFF;

uint16_t Bits(bf16 v) {
  uint16_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

std::vector<bf16> Poisoned(size_t n) {
  __nv_bfloat16_raw raw;
  raw.x = kPoison;
  return std::vector<bf16>(n, bf16(raw));
}

std::vector<float> RandomF32(size_t n, float scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// One bf16 ulp at |v| (8 significant bits), normal range.
double Bf16Ulp(double v) {
  int e;
  std::frexp(std::max(std::fabs(v), 0x1p-126), &e);  // |v| = m·2^e, m in [0.5, 1)
  return std::ldexp(1.0, e - 8);
}

// Every op here does its maths in fp32 and rounds once to bf16, against the
// CPU reference's fp32 result (not rounded). The GPU's fp32 value differs from
// the reference's by a few fp32 ulps (reduction order, device expf / sincosf
// within 2 ulps), and its one rounding adds at most half a bf16 ulp, so the
// expected worst case is ~0.5 ulp. The bound is one bf16 ulp, taken at the
// larger of the two magnitudes so that rounding up into the next binade is
// covered; that is 2^-8 to 2^-7 relative, while a wrong convention, index or
// stride is off by orders of magnitude more. `abs` only matters where the
// result cancels to near zero (the RoPE differences), where a relative bound
// means nothing.
void ExpectBf16Close(const std::vector<float>& got, const std::vector<float>& want, double abs,
                     const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  double worst = 0;  // in bf16 ulps
  for (size_t i = 0; i < got.size(); ++i) {
    const double ulp = Bf16Ulp(std::max(std::fabs(got[i]), std::fabs(want[i])));
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= ulp + abs)) {  // NaN (an unwritten, poisoned element) fails too
      if (++bad <= 5) {
        ADD_FAILURE() << what << ": element " << i << " got " << got[i] << " want " << want[i];
      }
    }
    if (std::isfinite(err)) worst = std::max(worst, err / ulp);
  }
  EXPECT_EQ(bad, 0u) << what << ": mismatches of " << got.size();
  std::printf("  %-52s max err %.3f bf16 ulp over %zu values\n", what.c_str(), worst, got.size());
}

// Weights in the two conventions: zero-centred stores w ≈ 0, multiplicative
// w ≈ 1; both bf16 as in the checkpoints.
std::vector<float> NormWeight(int64_t width, NormKind kind, uint64_t seed) {
  std::vector<float> w = RandomBf16Values(width, 0.1f, seed);
  if (kind == NormKind::kMultiplicative) {
    for (auto& x : w) x = ToF32(ToBf16({1.0f + x}))[0];
  }
  return w;
}

cpu::RmsNormKind CpuKind(NormKind k) {
  return k == NormKind::kZeroCentred ? cpu::RmsNormKind::kZeroCentred
                                     : cpu::RmsNormKind::kMultiplicative;
}

const char* KindName(NormKind k) { return k == NormKind::kZeroCentred ? "zc" : "mul"; }

// ---------------------------------------------------------------- embedding

TEST(EmbeddingCudaTest, GathersRowsExactly) {
  DF_REQUIRE_GPU();
  constexpr int64_t kVocab = 301, kTokens = 37;
  std::mt19937 rng(7);
  std::vector<int32_t> ids(kTokens);
  for (auto& id : ids) id = static_cast<int32_t>(rng() % kVocab);
  ids[0] = 0;
  ids[1] = kVocab - 1;
  ids[2] = ids[3];  // a repeated id
  // offset 1 misaligns the table: the scalar path on a width the vector path would take.
  for (const auto& [width, offset] :
       {std::pair<int64_t, int64_t>{5120, 0}, {64, 0}, {67, 0}, {64, 1}}) {
    const std::vector<float> table_f = RandomBf16Values(kVocab * width + offset, 1.0f, width);
    const std::vector<bf16> table = ToBf16(table_f);
    std::vector<uint16_t> table_bits(table.size());
    std::memcpy(table_bits.data(), table.data(), table.size() * sizeof(bf16));
    std::vector<float> want(kTokens * width);
    cpu::EmbeddingBf16(table_bits.data() + offset, kVocab, width, ids.data(), kTokens, want.data());

    DeviceBuffer<bf16> d_table(table);
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<float> d_out(std::vector<float>(kTokens * width, NAN));
    DF_CUDA_OK(
        EmbeddingLookup(d_ids.get(), kTokens, d_table.get() + offset, width, d_out.get(), nullptr));
    DF_SYNC_OK();
    const std::vector<float> got = d_out.Download();
    // Widening bf16 to fp32 is exact.
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)))
        << "width " << width << " offset " << offset;
  }
}

// ---------------------------------------------------------------- rmsnorm

struct NormShape {
  int64_t rows, width, x_stride;
};

// Odd widths and padded strides take the scalar path; 9000 takes the
// block-per-row path with a ragged last pass; 40000 is past the register path.
const NormShape kF32Shapes[] = {
    {37, 5120, 5128}, {37, 67, 70}, {37 * 24, 256, 256}, {37, 128, 136},
    {37, 64, 64},     {5, 8, 8},    {3, 9000, 9000},     {2, 40000, 40000},
};

// Rows of very different magnitude, as in a residual stream.
std::vector<float> ResidualRows(int64_t rows, int64_t stride, uint64_t seed) {
  std::vector<float> x = RandomF32(rows * stride, 1.0f, seed);
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = std::pow(10.0f, static_cast<float>(r % 7) - 3.0f);
    for (int64_t i = 0; i < stride; ++i) x[r * stride + i] *= scale;
  }
  return x;
}

TEST(RmsNormCudaTest, F32IntoCaptureSlotMatchesReference) {
  DF_REQUIRE_GPU();
  constexpr int64_t kSlots = 5, kSlot = 2;
  for (const NormKind kind : {NormKind::kZeroCentred, NormKind::kMultiplicative}) {
    for (const NormShape& s : kF32Shapes) {
      const std::vector<float> x = ResidualRows(s.rows, s.x_stride, s.width);
      const std::vector<float> w = NormWeight(s.width, kind, s.width + 1);
      std::vector<float> dense(s.rows * s.width), want(s.rows * s.width);
      for (int64_t r = 0; r < s.rows; ++r) {
        std::copy_n(&x[r * s.x_stride], s.width, &dense[r * s.width]);
      }
      const float eps = 1e-6f;
      cpu::RmsNorm(dense.data(), w.data(), s.rows, s.width, eps, CpuKind(kind), want.data());

      // out is slot 2 of a [rows, 5, width] capture.
      const int64_t out_stride = kSlots * s.width;
      DeviceBuffer<float> d_x(x);
      DeviceBuffer<bf16> d_w(ToBf16(w));
      DeviceBuffer<bf16> d_out(Poisoned(s.rows * out_stride));
      DF_CUDA_OK(RmsNormF32(d_x.get(), s.x_stride, d_w.get(), s.rows, s.width, eps, kind,
                            d_out.get() + kSlot * s.width, out_stride, nullptr));
      DF_SYNC_OK();
      const std::vector<bf16> out = d_out.Download();
      std::vector<float> got(s.rows * s.width);
      size_t touched = 0;
      for (int64_t r = 0; r < s.rows; ++r) {
        for (int64_t k = 0; k < kSlots; ++k) {
          for (int64_t i = 0; i < s.width; ++i) {
            const bf16 v = out[r * out_stride + k * s.width + i];
            if (k == kSlot) {
              got[r * s.width + i] = __bfloat162float(v);
            } else if (Bits(v) != kPoison) {
              ++touched;
            }
          }
        }
      }
      EXPECT_EQ(touched, 0u) << "wrote outside slot " << kSlot;
      ExpectBf16Close(got, want, 1e-6,
                      std::string("RmsNormF32 ") + KindName(kind) + " " + std::to_string(s.rows) +
                          "x" + std::to_string(s.width) + " stride " + std::to_string(s.x_stride));
    }
  }
}

TEST(RmsNormCudaTest, AddRmsNormUpdatesResidualThenNorms) {
  DF_REQUIRE_GPU();
  for (const NormKind kind : {NormKind::kZeroCentred, NormKind::kMultiplicative}) {
    for (const auto& [rows, width] :
         {std::pair<int64_t, int64_t>{37, 5120}, {37, 67}, {37, 256}, {4, 2560}}) {
      const std::vector<float> residual = ResidualRows(rows, width, width + 3);
      const std::vector<float> delta = RandomBf16Values(rows * width, 0.5f, width + 4);
      const std::vector<float> w = NormWeight(width, kind, width + 5);
      std::vector<float> sum(rows * width), want(rows * width);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] = residual[i] + delta[i];
      const float eps = 1e-6f;
      cpu::RmsNorm(sum.data(), w.data(), rows, width, eps, CpuKind(kind), want.data());

      DeviceBuffer<float> d_res(residual);
      DeviceBuffer<bf16> d_delta(ToBf16(delta));
      DeviceBuffer<bf16> d_w(ToBf16(w));
      DeviceBuffer<bf16> d_out(Poisoned(rows * width));
      DF_CUDA_OK(AddRmsNormF32(d_res.get(), d_delta.get(), d_w.get(), rows, width, eps, kind,
                               d_out.get(), nullptr));
      DF_SYNC_OK();
      const std::vector<float> got_res = d_res.Download();
      // The same single fp32 add on both sides: bit-identical.
      EXPECT_EQ(0, std::memcmp(got_res.data(), sum.data(), sum.size() * sizeof(float)))
          << "residual " << rows << "x" << width;
      ExpectBf16Close(ToF32(d_out.Download()), want, 1e-6,
                      std::string("AddRmsNormF32 ") + KindName(kind) + " " + std::to_string(rows) +
                          "x" + std::to_string(width));
    }
  }
}

// q/k norms run in place on each head's slice of a wider projection: only the
// slice may change.
TEST(RmsNormCudaTest, Bf16InPlacePerHeadInsideStridedBuffer) {
  DF_REQUIRE_GPU();
  struct Case {
    NormKind kind;
    int64_t tokens, heads, head_dim, head_stride;
    const char* what;
  };
  const Case cases[] = {
      // Qwen3.5 q: Q is the first 256 of each head's 512 (the gate follows).
      {NormKind::kZeroCentred, 37, 24, 256, 512, "q in q_proj [37,24,512]"},
      {NormKind::kZeroCentred, 37, 4, 256, 256, "k dense [37,4,256]"},
      {NormKind::kMultiplicative, 37, 8, 128, 128, "qwen3 k [37,8,128]"},
      {NormKind::kMultiplicative, 37, 3, 67, 70, "odd [37,3,67] stride 70"},
  };
  for (const Case& c : cases) {
    const int64_t rows = c.tokens * c.heads;
    const std::vector<float> x = RandomBf16Values(rows * c.head_stride, 2.0f, c.head_dim);
    const std::vector<float> w = NormWeight(c.head_dim, c.kind, c.head_dim + 1);
    std::vector<float> dense(rows * c.head_dim), want(rows * c.head_dim);
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(&x[r * c.head_stride], c.head_dim, &dense[r * c.head_dim]);
    }
    const float eps = 1e-6f;
    cpu::RmsNorm(dense.data(), w.data(), rows, c.head_dim, eps, CpuKind(c.kind), want.data());

    const std::vector<bf16> before = ToBf16(x);
    DeviceBuffer<bf16> d_x(before);
    DeviceBuffer<bf16> d_w(ToBf16(w));
    DF_CUDA_OK(RmsNormBf16InPlace(d_x.get(), c.head_stride, d_w.get(), rows, c.head_dim, eps,
                                  c.kind, nullptr));
    DF_SYNC_OK();
    const std::vector<bf16> after = d_x.Download();
    std::vector<float> got(rows * c.head_dim);
    size_t touched = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t i = 0; i < c.head_stride; ++i) {
        const size_t at = r * c.head_stride + i;
        if (i < c.head_dim) {
          got[r * c.head_dim + i] = __bfloat162float(after[at]);
        } else if (Bits(after[at]) != Bits(before[at])) {
          ++touched;
        }
      }
    }
    EXPECT_EQ(touched, 0u) << c.what << ": changed outside the heads' slices";
    ExpectBf16Close(got, want, 1e-6, std::string("RmsNormBf16InPlace ") + c.what);
  }
}

TEST(RmsNormCudaTest, GatedMatchesReference) {
  DF_REQUIRE_GPU();
  struct Case {
    int64_t rows, width, z_stride;
  };
  // GDN: 37 tokens × 48 value heads of 128, z rows padded; then an odd width
  // (scalar path) and a wide one (a full warp per row).
  for (const Case c : {Case{37 * 48, 128, 136}, Case{37, 67, 70}, Case{37, 1024, 1024}}) {
    const std::vector<float> x = RandomBf16Values(c.rows * c.width, 0.3f, c.width);
    const std::vector<float> z = RandomBf16Values(c.rows * c.z_stride, 2.0f, c.width + 1);
    const std::vector<float> w = NormWeight(c.width, NormKind::kMultiplicative, c.width + 2);
    std::vector<float> z_dense(c.rows * c.width), want(c.rows * c.width);
    for (int64_t r = 0; r < c.rows; ++r) {
      std::copy_n(&z[r * c.z_stride], c.width, &z_dense[r * c.width]);
    }
    const float eps = 1e-6f;
    cpu::GatedRmsNorm(x.data(), z_dense.data(), w.data(), c.rows, c.width, eps, want.data());

    DeviceBuffer<bf16> d_x(ToBf16(x));
    DeviceBuffer<bf16> d_z(ToBf16(z));
    DeviceBuffer<bf16> d_w(ToBf16(w));
    DeviceBuffer<bf16> d_out(Poisoned(c.rows * c.width));
    DF_CUDA_OK(GatedRmsNorm(d_x.get(), d_z.get(), c.z_stride, d_w.get(), c.rows, c.width, eps,
                            d_out.get(), nullptr));
    DF_SYNC_OK();
    ExpectBf16Close(ToF32(d_out.Download()), want, 1e-6,
                    "GatedRmsNorm " + std::to_string(c.rows) + "x" + std::to_string(c.width) +
                        " z_stride " + std::to_string(c.z_stride));
  }
}

TEST(RmsNormCudaTest, AddResidualIsOneFp32Add) {
  DF_REQUIRE_GPU();
  for (const auto& [rows, width] : {std::pair<int64_t, int64_t>{37, 5120}, {37, 67}}) {
    const std::vector<float> residual = RandomF32(rows * width, 3.0f, width);
    const std::vector<float> delta = RandomBf16Values(rows * width, 1.0f, width + 1);
    std::vector<float> want(residual.size());
    for (size_t i = 0; i < want.size(); ++i) want[i] = residual[i] + delta[i];
    DeviceBuffer<float> d_res(residual);
    DeviceBuffer<bf16> d_delta(ToBf16(delta));
    DF_CUDA_OK(AddResidual(d_res.get(), d_delta.get(), rows, width, nullptr));
    DF_SYNC_OK();
    const std::vector<float> got = d_res.Download();
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)))
        << rows << "x" << width;
  }
}

// ---------------------------------------------------------------- rope

// Packed sequences of lengths 1, 5, 0, 300, 1000, 37: an empty one, and
// positions up to 999 so angle errors would show.
const std::vector<int32_t> kCuSeqlens = {0, 1, 6, 6, 306, 1306, 1343};
constexpr int64_t kPackedTokens = 1343;

TEST(RopeCudaTest, PositionsRestartPerSequence) {
  DF_REQUIRE_GPU();
  const int32_t num_seqs = static_cast<int32_t>(kCuSeqlens.size()) - 1;
  std::vector<int32_t> want(kPackedTokens);
  cpu::SequencePositions(kCuSeqlens.data(), num_seqs, want.data());
  DeviceBuffer<int32_t> d_cu(kCuSeqlens);
  DeviceBuffer<int32_t> d_pos(std::vector<int32_t>(kPackedTokens, -1));
  DF_CUDA_OK(PositionsFromCuSeqlens(d_cu.get(), num_seqs, kPackedTokens, d_pos.get(), nullptr));
  DF_SYNC_OK();
  EXPECT_EQ(d_pos.Download(), want);
}

TEST(RopeCudaTest, MatchesReferenceWithPackedPositions) {
  DF_REQUIRE_GPU();
  struct Case {
    int64_t heads, head_dim, head_stride, rotary_dim;
    float theta;
    const char* what;
  };
  const Case cases[] = {
      // Qwen3.5 q inside q_proj (gate after each head), then k: R = 64 of 256.
      {24, 256, 512, 64, 1e7f, "qwen3.5 q [T,24,512] R=64/256"},
      {4, 256, 256, 64, 1e7f, "qwen3.5 k [T,4,256] R=64/256"},
      // Qwen3: the whole head.
      {8, 128, 128, 128, 1e6f, "qwen3 [T,8,128] R=128"},
      {3, 67, 70, 66, 1e4f, "odd [T,3,67] stride 70 R=66"},
  };
  const int32_t num_seqs = static_cast<int32_t>(kCuSeqlens.size()) - 1;
  std::vector<int32_t> pos(kPackedTokens);
  cpu::SequencePositions(kCuSeqlens.data(), num_seqs, pos.data());
  for (const Case& c : cases) {
    const int64_t token_stride = c.heads * c.head_stride;
    const std::vector<float> x = RandomBf16Values(kPackedTokens * token_stride, 1.0f, c.head_dim);
    std::vector<float> want(kPackedTokens * c.heads * c.head_dim);
    for (int64_t t = 0; t < kPackedTokens; ++t) {
      for (int64_t h = 0; h < c.heads; ++h) {
        std::copy_n(&x[t * token_stride + h * c.head_stride], c.head_dim,
                    &want[(t * c.heads + h) * c.head_dim]);
      }
    }
    cpu::ApplyRope(want.data(), kPackedTokens, c.heads, c.head_dim, c.rotary_dim, pos.data(),
                   c.theta);

    const std::vector<bf16> before = ToBf16(x);
    DeviceBuffer<bf16> d_x(before);
    DeviceBuffer<int32_t> d_pos(pos);
    DF_CUDA_OK(ApplyRope(d_x.get(), kPackedTokens, c.heads, c.head_dim, token_stride, c.head_stride,
                         c.rotary_dim, d_pos.get(), c.theta, nullptr));
    DF_SYNC_OK();
    const std::vector<bf16> after = d_x.Download();
    std::vector<float> got, ref;
    size_t touched = 0;
    for (int64_t t = 0; t < kPackedTokens; ++t) {
      for (int64_t h = 0; h < c.heads; ++h) {
        for (int64_t i = 0; i < c.head_stride; ++i) {
          const size_t at = t * token_stride + h * c.head_stride + i;
          if (i < c.rotary_dim) {
            got.push_back(__bfloat162float(after[at]));
            ref.push_back(want[(t * c.heads + h) * c.head_dim + i]);
          } else if (Bits(after[at]) != Bits(before[at])) {
            ++touched;
          }
        }
      }
    }
    EXPECT_EQ(touched, 0u) << c.what << ": changed past rotary_dim";
    // abs: x·cos − y·sin cancels; the two sides' sincos differ by ≤ 2 fp32
    // ulps, i.e. ~1e-7 on inputs of order 1.
    ExpectBf16Close(got, ref, 1e-5, std::string("ApplyRope ") + c.what);
  }
}

// ---------------------------------------------------------------- elementwise

TEST(ElementwiseCudaTest, SwiGluMatchesReference) {
  DF_REQUIRE_GPU();
  constexpr int64_t kTokens = 37;
  for (const int64_t ffn : {int64_t{17408}, int64_t{67}}) {
    const std::vector<float> gate_up = RandomBf16Values(kTokens * 2 * ffn, 3.0f, ffn);
    std::vector<float> gate(kTokens * ffn), up(kTokens * ffn), want(kTokens * ffn);
    for (int64_t t = 0; t < kTokens; ++t) {
      std::copy_n(&gate_up[t * 2 * ffn], ffn, &gate[t * ffn]);
      std::copy_n(&gate_up[t * 2 * ffn + ffn], ffn, &up[t * ffn]);
    }
    cpu::SwiGlu(gate.data(), up.data(), kTokens * ffn, want.data());
    DeviceBuffer<bf16> d_gu(ToBf16(gate_up));
    DeviceBuffer<bf16> d_out(Poisoned(kTokens * ffn));
    DF_CUDA_OK(SwiGlu(d_gu.get(), kTokens, ffn, d_out.get(), nullptr));
    DF_SYNC_OK();
    ExpectBf16Close(ToF32(d_out.Download()), want, 1e-6, "SwiGlu F=" + std::to_string(ffn));
  }
}

TEST(ElementwiseCudaTest, RowDotMatchesReferenceWhateverTheBatch) {
  DF_REQUIRE_GPU();
  for (const int64_t width : {int64_t{2048}, int64_t{5120}, int64_t{67}}) {
    constexpr int64_t kTokens = 777, kStride = 5184;  // rows inside a wider buffer
    const std::vector<float> x = RandomBf16Values(kTokens * kStride, 2.0f, width);
    const std::vector<float> w = RandomBf16Values(width, 0.05f, width + 1);
    DeviceBuffer<bf16> d_x(ToBf16(x)), d_w(ToBf16(w));
    DeviceBuffer<bf16> all(Poisoned(kTokens)), one(Poisoned(1));
    DF_CUDA_OK(RowDot(d_x.get(), kStride, d_w.get(), kTokens, width, all.get(), nullptr));
    // Row 500 alone: the same bits as within 777 rows.
    DF_CUDA_OK(RowDot(d_x.get() + 500 * kStride, kStride, d_w.get(), 1, width, one.get(), nullptr));
    DF_SYNC_OK();
    const std::vector<bf16> got = all.Download();
    EXPECT_EQ(Bits(one.Download()[0]), Bits(got[500])) << "width " << width;
    std::vector<float> want(kTokens);
    for (int64_t t = 0; t < kTokens; ++t) {
      double s = 0;
      for (int64_t i = 0; i < width; ++i) s += double(x[t * kStride + i]) * w[i];
      want[t] = static_cast<float>(s);
    }
    // fp32 sums of `width` products (relative error ~width·2^-24 of Σ|x·w|,
    // far under one bf16 rounding), then one bf16 rounding of the result.
    ExpectBf16Close(ToF32(got), want, 1e-3, "RowDot width " + std::to_string(width));
  }
}

TEST(ElementwiseCudaTest, SigmoidGateMulReadsStridedGate) {
  DF_REQUIRE_GPU();
  constexpr int64_t kTokens = 37;
  struct Case {
    int64_t heads, head_dim, gate_head_stride, gate_offset;
  };
  // The Qwen3.5 gate is the second half of each head's 512 in q_proj; the odd
  // case misaligns it.
  for (const Case c : {Case{24, 256, 512, 256}, Case{3, 67, 140, 70}}) {
    const int64_t gate_token_stride = c.heads * c.gate_head_stride;
    const std::vector<float> o = RandomBf16Values(kTokens * c.heads * c.head_dim, 1.0f, 11);
    const std::vector<float> proj = RandomBf16Values(kTokens * gate_token_stride, 3.0f, 12);
    // The sigmoid gate's reference is this one line; no CPU kernel of its own.
    std::vector<float> want(o.size());
    for (int64_t t = 0; t < kTokens; ++t) {
      for (int64_t h = 0; h < c.heads; ++h) {
        for (int64_t j = 0; j < c.head_dim; ++j) {
          const float g = proj[t * gate_token_stride + h * c.gate_head_stride + c.gate_offset + j];
          const size_t at = (t * c.heads + h) * c.head_dim + j;
          want[at] = o[at] / (1.0f + std::exp(-g));
        }
      }
    }
    DeviceBuffer<bf16> d_o(ToBf16(o));
    DeviceBuffer<bf16> d_proj(ToBf16(proj));
    DF_CUDA_OK(SigmoidGateMul(d_o.get(), d_proj.get() + c.gate_offset, kTokens, c.heads, c.head_dim,
                              gate_token_stride, c.gate_head_stride, nullptr));
    DF_SYNC_OK();
    ExpectBf16Close(
        ToF32(d_o.Download()), want, 1e-6,
        "SigmoidGateMul heads " + std::to_string(c.heads) + " x " + std::to_string(c.head_dim));
  }
}

TEST(ElementwiseCudaTest, CaptureResidualWritesOnlyItsSlot) {
  DF_REQUIRE_GPU();
  constexpr int64_t kTokens = 37, kSlots = 5, kSlot = 2;
  for (const int64_t width : {int64_t{5120}, int64_t{67}}) {
    const std::vector<float> residual = RandomF32(kTokens * width, 4.0f, width);
    DeviceBuffer<float> d_res(residual);
    DeviceBuffer<bf16> d_cap(Poisoned(kTokens * kSlots * width));
    DF_CUDA_OK(CaptureResidual(d_res.get(), kTokens, width, d_cap.get(), kSlots, kSlot, nullptr));
    DF_SYNC_OK();
    const std::vector<bf16> cap = d_cap.Download();
    size_t wrong = 0, touched = 0;
    for (int64_t t = 0; t < kTokens; ++t) {
      for (int64_t k = 0; k < kSlots; ++k) {
        for (int64_t i = 0; i < width; ++i) {
          const bf16 v = cap[(t * kSlots + k) * width + i];
          if (k != kSlot) {
            touched += Bits(v) != kPoison;
          } else {
            // Round-to-nearest-even on both sides: bit-identical.
            wrong += Bits(v) != Bits(__float2bfloat16(residual[t * width + i]));
          }
        }
      }
    }
    EXPECT_EQ(wrong, 0u) << "width " << width;
    EXPECT_EQ(touched, 0u) << "width " << width << ": wrote outside slot " << kSlot;
  }
}

}  // namespace
}  // namespace draftfeed::cuda
