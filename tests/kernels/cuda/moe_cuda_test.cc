// The MoE kernels (kernels/moe.cuh) against the CPU reference
// (kernels/cpu/moe.h): routing, the permutation by expert, the grouped
// gate_up/SwiGLU and down GEMMs, and the weighted combine into the residual,
// on odd sizes, idle experts, one expert taking every token, and exact ties.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/moe.h"
#include "kernels/kernel_paths.cuh"
#include "kernels/moe.cuh"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda {
namespace {

using ::draftfeed::testing::DeviceBuffer;
using ::draftfeed::testing::RandomBf16Values;
using ::draftfeed::testing::ToBf16;
using ::draftfeed::testing::ToF32;

#define DF_SYNC_OK() DF_CUDA_OK(cudaDeviceSynchronize())

// Router logits with bf16 values (as the engine's router GEMM writes them):
// distinct values then differ by at least a bf16 ulp, which moves p by far
// more than the GPU's few-fp32-ulp softmax differences, so the chosen
// experts must match the reference exactly. `levels` > 0 quantizes them to
// that many values, making exact ties common.
std::vector<float> Logits(int64_t tokens, int64_t experts, uint64_t seed, int levels = 0) {
  std::vector<float> v = RandomBf16Values(static_cast<size_t>(tokens * experts), 2.0f, seed);
  if (levels > 0) {
    for (float& x : v) x = std::round(std::clamp(x, -2.0f, 2.0f) * (levels - 1) / 4.0f);
  }
  return v;
}

struct Route {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Route CpuRoute(const std::vector<float>& logits, int64_t tokens, int experts, int k, bool renorm) {
  Route r{std::vector<int32_t>(static_cast<size_t>(tokens * k)),
          std::vector<float>(static_cast<size_t>(tokens * k))};
  cpu::MoeRoute(logits.data(), tokens, experts, k, renorm, r.ids.data(), r.weights.data());
  return r;
}

// The GPU routing of `logits` ([tokens, experts] packed in rows of `stride`),
// read as bf16 or fp32.
Route GpuRoute(const std::vector<float>& logits, int64_t tokens, int experts, int64_t stride, int k,
               bool renorm, bool bf16_logits) {
  std::vector<float> padded(static_cast<size_t>(tokens * stride), 1e4f);  // must not be read
  for (int64_t t = 0; t < tokens; ++t) {
    std::copy_n(&logits[t * experts], experts, &padded[t * stride]);
  }
  DeviceBuffer<int32_t> ids(std::vector<int32_t>(static_cast<size_t>(tokens * k), -7));
  DeviceBuffer<float> w(std::vector<float>(static_cast<size_t>(tokens * k), NAN));
  if (bf16_logits) {
    DeviceBuffer<bf16> d(ToBf16(padded));
    EXPECT_EQ(MoeTopK(d.get(), stride, tokens, experts, k, renorm, ids.get(), w.get(), nullptr),
              cudaSuccess);
  } else {
    DeviceBuffer<float> d(padded);
    EXPECT_EQ(MoeTopK(d.get(), stride, tokens, experts, k, renorm, ids.get(), w.get(), nullptr),
              cudaSuccess);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {ids.Download(), w.Download()};
}

// The weights: p = e / Σ over up to 512 terms summed in another order (and
// device expf within 2 ulps) differ from the reference by at most ~E fp32
// ulps relative, 512·2^-24 = 3e-5; the renormalised ones divide two such
// sums. 4e-5 relative covers both; a wrong expert or a missed renormalisation
// is off by > 1e-2.
void ExpectSameRoute(const Route& got, const Route& want, const std::string& what) {
  ASSERT_EQ(got.ids.size(), want.ids.size());
  size_t bad_ids = 0, bad_w = 0;
  for (size_t i = 0; i < got.ids.size(); ++i) {
    if (got.ids[i] != want.ids[i] && ++bad_ids <= 5) {
      ADD_FAILURE() << what << ": pair " << i << " expert " << got.ids[i] << " want "
                    << want.ids[i];
    }
    if (!(std::fabs(got.weights[i] - want.weights[i]) <= 4e-5 * want.weights[i] + 1e-12) &&
        ++bad_w <= 5) {
      ADD_FAILURE() << what << ": pair " << i << " weight " << got.weights[i] << " want "
                    << want.weights[i];
    }
  }
  EXPECT_EQ(bad_ids, 0u) << what;
  EXPECT_EQ(bad_w, 0u) << what;
}

// ---------------------------------------------------------------- routing

TEST(MoeTopKCudaTest, MatchesReferenceOnOddSizes) {
  DF_REQUIRE_GPU();
  struct Case {
    int64_t tokens;
    int experts, k;
  };
  // E = 8, 60 (Qwen1.5-MoE), 128 (Qwen3-MoE), 256 (Qwen3.5-MoE), 512; each
  // kernel width (E per lane 1, 2, 4, 8, 16) and k from 1 to 16.
  const Case cases[] = {{37, 8, 1},    {37, 8, 2},    {301, 60, 4},   {301, 60, 8},
                        {1, 128, 8},   {129, 128, 1}, {1000, 256, 8}, {77, 512, 16},
                        {77, 512, 10}, {5, 33, 16},   {9, 16, 16}};
  for (const Case& c : cases) {
    const std::vector<float> logits = Logits(c.tokens, c.experts, c.tokens * 131 + c.experts);
    for (const bool renorm : {true, false}) {
      for (const bool as_bf16 : {true, false}) {
        const std::string what = "T " + std::to_string(c.tokens) + " E " +
                                 std::to_string(c.experts) + " k " + std::to_string(c.k) +
                                 (renorm ? " renorm" : "") + (as_bf16 ? " bf16" : " f32");
        // stride E + 3: the router GEMM's rows may carry extra columns.
        ExpectSameRoute(GpuRoute(logits, c.tokens, c.experts, c.experts + 3, c.k, renorm, as_bf16),
                        CpuRoute(logits, c.tokens, c.experts, c.k, renorm), what);
      }
    }
  }
}

TEST(MoeTopKCudaTest, ExactTiesGoToTheLowerId) {
  DF_REQUIRE_GPU();
  // Logits on 3 or 5 levels: most tokens have many experts with equal p.
  for (const int levels : {3, 5}) {
    for (const int experts : {8, 60, 256}) {
      const int64_t tokens = 200;
      const std::vector<float> logits = Logits(tokens, experts, experts + levels, levels);
      const Route want = CpuRoute(logits, tokens, experts, 8, true);
      ExpectSameRoute(GpuRoute(logits, tokens, experts, experts, 8, true, true), want,
                      "ties, levels " + std::to_string(levels) + " E " + std::to_string(experts));
    }
  }
  // All equal: experts 0..k-1, weight 1/k each.
  const std::vector<float> flat(64, 0.5f);
  const Route r = GpuRoute(flat, 1, 64, 64, 4, true, false);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 1, 2, 3}));
  for (float w : r.weights) EXPECT_FLOAT_EQ(w, 0.25f);
}

TEST(MoeTopKCudaTest, RejectsBadShapes) {
  DF_REQUIRE_GPU();
  DeviceBuffer<float> logits(64);
  DeviceBuffer<int32_t> ids(64);
  DeviceBuffer<float> w(64);
  EXPECT_EQ(MoeTopK(logits.get(), 8, 1, 8, 9, true, ids.get(), w.get(), nullptr),
            cudaErrorInvalidValue);  // k > E
  EXPECT_EQ(MoeTopK(logits.get(), 7, 1, 8, 2, true, ids.get(), w.get(), nullptr),
            cudaErrorInvalidValue);  // stride < E
  EXPECT_EQ(MoeTopK(logits.get(), 1024, 1, 1024, 2, true, ids.get(), w.get(), nullptr),
            cudaErrorInvalidValue);  // E > kMoeMaxExperts
  EXPECT_EQ(MoeTopK(logits.get(), 64, 1, 64, 17, true, ids.get(), w.get(), nullptr),
            cudaErrorInvalidValue);  // k > kMoeMaxTopK
  EXPECT_EQ(MoeTopK(logits.get(), 8, 0, 8, 2, true, ids.get(), w.get(), nullptr), cudaSuccess);
}

// ---------------------------------------------------------------- permutation

// A device workspace for up to max_tokens tokens.
struct Workspace {
  Workspace(int64_t max_tokens, int experts, int k, int64_t hidden, int64_t inter)
      : bytes(MoeWorkspaceBytes(max_tokens, experts, k, hidden, inter)),
        storage(bytes),
        b(CarveMoeWorkspace(storage.get(), max_tokens, experts, k, hidden, inter)) {}
  size_t bytes;
  DeviceBuffer<char> storage;
  MoeBuffers b;
};

template <typename T>
std::vector<T> Download(const T* p, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

// Checks every MoeRouting array against the ids: counts, offsets and tile
// offsets are the scans, each pair sits in its expert's rows and the rows
// hold every pair once, the tile map names each tile's expert and rows.
void CheckPermutation(const std::vector<int32_t>& ids, int64_t tokens, int experts, int k,
                      const MoeRouting& r) {
  const int64_t pairs = tokens * k;
  std::vector<int32_t> count(experts, 0);
  for (int32_t e : ids) ++count[e];
  const std::vector<int32_t> counts = Download(r.counts, experts);
  const std::vector<int32_t> offsets = Download(r.offsets, experts + 1);
  const std::vector<int32_t> tile_offsets = Download(r.tile_offsets, experts + 1);
  ASSERT_EQ(counts, count);
  ASSERT_EQ(offsets[0], 0);
  ASSERT_EQ(tile_offsets[0], 0);
  for (int e = 0; e < experts; ++e) {
    ASSERT_EQ(offsets[e + 1], offsets[e] + count[e]) << "expert " << e;
    ASSERT_EQ(tile_offsets[e + 1], tile_offsets[e] + (count[e] + kMoeTileRows - 1) / kMoeTileRows)
        << "expert " << e;
  }
  const std::vector<int32_t> pair_row = Download(r.pair_row, pairs);
  const std::vector<int32_t> row_token = Download(r.row_token, pairs);
  std::vector<int> seen(pairs, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int32_t row = pair_row[p];
    ASSERT_GE(row, offsets[ids[p]]) << "pair " << p;
    ASSERT_LT(row, offsets[ids[p] + 1]) << "pair " << p;
    ASSERT_EQ(row_token[row], p / k) << "pair " << p;
    ++seen[row];
  }
  for (int64_t row = 0; row < pairs; ++row) ASSERT_EQ(seen[row], 1) << "row " << row;
  const int64_t tiles = MoeMaxTiles(pairs, experts);
  ASSERT_GE(tiles, tile_offsets[experts]);
  const std::vector<int32_t> map = Download(r.tile_map, static_cast<size_t>(tiles) * 4);
  for (int e = 0; e < experts; ++e) {
    for (int32_t t = tile_offsets[e]; t < tile_offsets[e + 1]; ++t) {
      const int32_t first = offsets[e] + (t - tile_offsets[e]) * kMoeTileRows;
      ASSERT_EQ(map[4 * t], e) << "tile " << t;
      ASSERT_EQ(map[4 * t + 1], first) << "tile " << t;
      ASSERT_EQ(map[4 * t + 2], std::min(first + kMoeTileRows, offsets[e + 1])) << "tile " << t;
    }
  }
  for (int64_t t = tile_offsets[experts]; t < tiles; ++t) ASSERT_EQ(map[4 * t], -1) << "tile " << t;
}

// Routings: random (some experts idle), every token to the same k experts
// (the worst case the workspace is sized for), one expert for everything.
std::vector<int32_t> Ids(int64_t tokens, int experts, int k, int kind, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> all(experts);
    std::iota(all.begin(), all.end(), 0);
    if (kind == 0) std::shuffle(all.begin(), all.end(), rng);
    if (kind == 1) std::reverse(all.begin(), all.end());
    ids.insert(ids.end(), all.begin(), all.begin() + k);
  }
  return ids;
}

TEST(MoePermuteCudaTest, GroupsPairsByExpert) {
  DF_REQUIRE_GPU();
  struct Case {
    int64_t tokens;
    int experts, k, kind;
  };
  const Case cases[] = {{37, 8, 2, 0},    {1000, 60, 8, 0},  {5, 128, 8, 0},  {300, 8, 1, 1},
                        {300, 128, 8, 1}, {4099, 256, 8, 0}, {1, 512, 16, 0}, {129, 3, 1, 2}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "T " << c.tokens << " E " << c.experts << " k " << c.k << " kind " << c.kind);
    // A workspace for more tokens than this batch: launches use num_tokens.
    Workspace ws(c.tokens + 50, c.experts, c.k, 8, 8);
    const std::vector<int32_t> ids = Ids(c.tokens, c.experts, c.k, c.kind, c.tokens);
    DeviceBuffer<int32_t> d_ids(ids);
    for (int rep = 0; rep < 2; ++rep) {  // the counts restart from zero each call
      DF_CUDA_OK(MoePermute(d_ids.get(), c.tokens, c.experts, c.k, ws.b.routing, nullptr));
      DF_SYNC_OK();
      CheckPermutation(ids, c.tokens, c.experts, c.k, ws.b.routing);
    }
  }
}

TEST(MoePermuteCudaTest, ZeroTokensAndBadArguments) {
  DF_REQUIRE_GPU();
  Workspace ws(16, 8, 2, 8, 8);
  DeviceBuffer<int32_t> ids(32);
  DF_CUDA_OK(MoePermute(ids.get(), 0, 8, 2, ws.b.routing, nullptr));
  DF_SYNC_OK();
  EXPECT_EQ(Download(ws.b.routing.offsets, 9), std::vector<int32_t>(9, 0));
  EXPECT_EQ(Download(ws.b.routing.tile_offsets, 9), std::vector<int32_t>(9, 0));
  // More tokens than the workspace's tile map holds.
  EXPECT_EQ(MoePermute(ids.get(), 1000, 8, 2, ws.b.routing, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(MoePermute(ids.get(), 4, 1000, 2, ws.b.routing, nullptr), cudaErrorInvalidValue);
}

TEST(MoeWorkspaceTest, MaxTilesBoundsEveryRouting) {
  // Σ_e ⌈r_e / 128⌉ over random splits (skewed, so some experts are idle and
  // some hot) and the adversarial ones (every busy expert one row past a
  // tile edge) never exceeds MoeMaxTiles; one row per expert reaches it.
  std::mt19937_64 rng(1);
  for (const int64_t rows : {0, 1, 127, 128, 129, 1000, 393216}) {
    for (const int64_t experts : {1, 8, 256}) {
      const int64_t bound = MoeMaxTiles(rows, experts);
      for (int trial = 0; trial < 50; ++trial) {
        std::vector<double> share(experts);
        for (double& v : share) v = std::pow(std::uniform_real_distribution<>(0, 1)(rng), 4);
        std::discrete_distribution<int64_t> pick(share.begin(), share.end());
        std::vector<int64_t> r(experts, 0);
        for (int64_t i = 0; i < std::min<int64_t>(rows, 20000); ++i) ++r[pick(rng)];
        r[0] += rows - std::min<int64_t>(rows, 20000);
        int64_t tiles = 0;
        for (int64_t c : r) tiles += (c + kMoeTileRows - 1) / kMoeTileRows;
        ASSERT_LE(tiles, bound) << rows << " rows, " << experts << " experts";
      }
      // 129 rows each for as many experts as the rows allow, the rest on one.
      std::vector<int64_t> r(experts, 0);
      int64_t left = rows;
      for (int64_t e = 0; e < experts && left > 0; ++e) {
        r[e] = std::min<int64_t>(left, kMoeTileRows + 1);
        left -= r[e];
      }
      r[0] += left;
      int64_t tiles = 0;
      for (int64_t c : r) tiles += (c + kMoeTileRows - 1) / kMoeTileRows;
      EXPECT_LE(tiles, bound) << rows << " rows, " << experts << " experts";
    }
  }
  EXPECT_EQ(MoeMaxTiles(5, 8), 5);  // five experts with one row each
}

// ---------------------------------------------------------------- experts

struct MoeShape {
  int64_t tokens, hidden, inter;
  int experts, k;
  int routing;  // 0: softmax top-k of random logits; 1: every token to the same k experts
};

// The whole routed MoE on the GPU (top-k, permute, gate_up + SwiGLU, down,
// combine into a residual) against cpu::MoeRoute + cpu::MoeExperts.
void RunMoe(const MoeShape& s) {
  SCOPED_TRACE(::testing::Message()
               << "T " << s.tokens << " D " << s.hidden << " I " << s.inter << " E " << s.experts
               << " k " << s.k << " routing " << s.routing);
  const int64_t T = s.tokens, D = s.hidden, I = s.inter, E = s.experts;
  const std::vector<float> x = RandomBf16Values(T * D, 1.0f, T + D);
  const std::vector<float> gate_up =
      RandomBf16Values(E * 2 * I * D, 1.0f / std::sqrt(float(D)), E + I);
  const std::vector<float> down = RandomBf16Values(E * D * I, 1.0f / std::sqrt(float(I)), E + D);
  std::vector<float> logits = Logits(T, E, T + E + 7);
  if (s.routing == 1) {  // experts E-1, E-3, ... far above the rest, in that order
    for (int64_t t = 0; t < T; ++t) {
      for (int j = 0; j < s.k; ++j) logits[t * E + (E - 1 - 2 * j) % E] = 20.0f - j;
    }
  }
  const Route want_route = CpuRoute(logits, T, s.experts, s.k, true);
  std::vector<float> want(T * D);
  cpu::MoeExperts(x.data(), T, D, I, gate_up.data(), down.data(), want_route.ids.data(),
                  want_route.weights.data(), s.k, want.data());

  Workspace ws(T + 3, s.experts, s.k, D, I);
  DeviceBuffer<bf16> d_x(ToBf16(x)), d_gate_up(ToBf16(gate_up)), d_down(ToBf16(down));
  DeviceBuffer<bf16> d_logits(ToBf16(logits));
  const std::vector<float> residual0 = RandomBf16Values(T * D, 3.0f, 99);
  DeviceBuffer<float> d_residual(residual0);
  const MoeBuffers& b = ws.b;
  DF_CUDA_OK(MoeTopK(d_logits.get(), E, T, s.experts, s.k, true, b.expert_ids, b.weights, nullptr));
  DF_CUDA_OK(MoePermute(b.expert_ids, T, s.experts, s.k, b.routing, nullptr));
  DF_CUDA_OK(MoeGateUpSwiGlu(d_x.get(), D, d_gate_up.get(), D, I, s.experts, T * s.k, b.routing,
                             b.act, nullptr));
  DF_CUDA_OK(MoeDown(b.act, d_down.get(), D, I, s.experts, T * s.k, b.routing, b.y, nullptr));
  DF_CUDA_OK(MoeCombine(b.y, b.routing.pair_row, b.weights, T, s.k, D, nullptr, 0, nullptr, 0,
                        d_residual.get(), nullptr));
  DF_SYNC_OK();
  EXPECT_EQ(Download(b.expert_ids, T * s.k), want_route.ids);

  // The GPU rounds the SwiGLU activations and each expert's output to bf16
  // (2^-9 relative each); the reference keeps fp32. An activation's rounding
  // moves y by 2^-9 of one term, and the I terms add like random signs, so
  // the error is ~2^-9/√3·rms(y) per output (the expert outputs' rms, ~ the
  // token's MoE output rms), plus 2^-9·|y| from rounding y. The bound is
  // 2^-8·|ref| + 2^-6·rms(row): > 10 standard deviations of that noise, and
  // far below a wrong row, expert or column (O(rms)).
  const std::vector<float> got = d_residual.Download();
  size_t bad = 0;
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(want[t * D + i]) * want[t * D + i];
    const double rms = std::sqrt(ss / D);
    for (int64_t i = 0; i < D; ++i) {
      const double ref = want[t * D + i];
      const double delta = double(got[t * D + i]) - residual0[t * D + i];
      const double err = std::fabs(delta - ref);
      const double bound = std::ldexp(std::fabs(ref), -8) + std::ldexp(rms, -6);
      worst = std::max(worst, err / bound);
      if (!(err <= bound) && ++bad <= 5) {
        ADD_FAILURE() << "token " << t << " col " << i << " got " << delta << " want " << ref;
      }
    }
  }
  EXPECT_EQ(bad, 0u);
  std::printf("  T %5ld D %4ld I %4ld E %3d k %2d: worst err %.3f of the bound\n",
              static_cast<long>(T), static_cast<long>(D), static_cast<long>(I), s.experts, s.k,
              worst);
}

TEST(MoeExpertsCudaTest, MatchesReference) {
  DF_REQUIRE_GPU();
  const MoeShape shapes[] = {
      // Odd token counts around the 128-row tile; D 520 = 8 K-steps of 64 plus
      // a partial one (the pipeline's tail); I 40 and 96 leave column tiles
      // partial.
      {37, 72, 40, 8, 2, 0},
      {301, 520, 96, 60, 8, 0},
      {129, 256, 64, 128, 1, 0},
      {5, 128, 48, 128, 8, 0},      // most experts idle
      {300, 136, 200, 8, 1, 1},     // one expert takes all 300 rows (3 tiles)
      {257, 64, 72, 16, 2, 1},      // two experts take every token
      {1000, 256, 128, 256, 8, 0},  // Qwen3.5's E and k
      // D and I multiples of 128, which Hopper runs on hopper_gemm.cu's wgmma
      // kernels: several gate_up column tiles, a half-empty last down tile
      // (D 384), one expert of several row tiles, experts' tiles side by side.
      {300, 256, 256, 8, 1, 1},
      {77, 384, 128, 16, 4, 0},
      {600, 512, 384, 32, 4, 0},
  };
  for (const MoeShape& s : shapes) RunMoe(s);
}

// The mma.sync kernels every GPU but Hopper runs (DRAFTFEED_PORTABLE_KERNELS'
// sm100 mode makes a Hopper take them too) on the shapes Hopper would give
// its wgmma kernels.
TEST(MoeExpertsCudaTest, MmaSyncKernelsMatchReferenceWhereHopperRunsWgmma) {
  DF_REQUIRE_GPU();
  ScopedPortableKernels portable(PortableKernels::kSm100);
  for (const MoeShape& s :
       {MoeShape{1000, 256, 128, 256, 8, 0}, MoeShape{77, 384, 128, 16, 4, 0}}) {
    RunMoe(s);
  }
}

TEST(MoeExpertsCudaTest, RejectsMisalignedShapes) {
  DF_REQUIRE_GPU();
  Workspace ws(8, 8, 2, 64, 64);
  DeviceBuffer<bf16> x(8 * 72), w(8 * 2 * 64 * 72);
  // D not a multiple of 8; x_stride below D; a misaligned x.
  EXPECT_EQ(MoeGateUpSwiGlu(x.get(), 70, w.get(), 70, 64, 8, 16, ws.b.routing, ws.b.act, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(MoeGateUpSwiGlu(x.get(), 56, w.get(), 64, 64, 8, 16, ws.b.routing, ws.b.act, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      MoeGateUpSwiGlu(x.get() + 1, 64, w.get(), 64, 64, 8, 16, ws.b.routing, ws.b.act, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(MoeDown(ws.b.act, w.get(), 64, 60, 8, 16, ws.b.routing, ws.b.y, nullptr),
            cudaErrorInvalidValue);
  // More rows than the tile map was carved for.
  EXPECT_EQ(MoeDown(ws.b.act, w.get(), 64, 64, 8, 4096, ws.b.routing, ws.b.y, nullptr),
            cudaErrorInvalidValue);
  // Zero rows: nothing to launch.
  EXPECT_EQ(MoeDown(ws.b.act, w.get(), 64, 64, 8, 0, ws.b.routing, ws.b.y, nullptr), cudaSuccess);
}

// ---------------------------------------------------------------- combine

TEST(MoeCombineCudaTest, WeightedSumAndSharedExpertIntoResidual) {
  DF_REQUIRE_GPU();
  for (const int64_t D : {2048, 72, 13}) {  // 13: the scalar path
    for (const bool shared : {false, true}) {
      const int64_t T = 19;
      const int k = 3;
      const int64_t rows = T * k;
      const std::vector<float> y = RandomBf16Values(rows * D, 1.0f, D);
      const std::vector<float> sh = RandomBf16Values(T * (D + 8), 1.0f, D + 1);
      const std::vector<float> gate = RandomBf16Values(T * 5, 2.0f, D + 2);  // stride 5
      std::vector<float> w(rows);
      std::mt19937 rng(3);
      for (float& v : w) v = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
      std::vector<int32_t> pair_row(rows);
      std::iota(pair_row.begin(), pair_row.end(), 0);
      std::shuffle(pair_row.begin(), pair_row.end(), rng);
      pair_row[4] = -1;  // a dropped pair adds nothing
      const std::vector<float> residual = RandomBf16Values(T * D, 3.0f, D + 3);
      std::vector<float> want = residual;
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t i = 0; i < D; ++i) {
          float out = 0;
          for (int j = 0; j < k; ++j) {
            const int32_t r = pair_row[t * k + j];
            if (r >= 0) out += w[t * k + j] * y[r * D + i];
          }
          if (shared) out += 1.0f / (1.0f + std::exp(-gate[t * 5])) * sh[t * (D + 8) + i];
          want[t * D + i] += out;
        }
      }
      DeviceBuffer<bf16> d_y(ToBf16(y)), d_sh(ToBf16(sh)), d_gate(ToBf16(gate));
      DeviceBuffer<float> d_w(w), d_res(residual);
      DeviceBuffer<int32_t> d_rows(pair_row);
      DF_CUDA_OK(MoeCombine(d_y.get(), d_rows.get(), d_w.get(), T, k, D,
                            shared ? d_sh.get() : nullptr, D + 8, shared ? d_gate.get() : nullptr,
                            5, d_res.get(), nullptr));
      DF_SYNC_OK();
      const std::vector<float> got = d_res.Download();
      // Same fp32 operations in the same order; only device expf (2 ulps)
      // and FMA contraction differ: a few fp32 ulps of the largest term.
      for (int64_t i = 0; i < T * D; ++i) {
        ASSERT_NEAR(got[i], want[i], 1e-5 * (std::fabs(want[i]) + 4.0))
            << "D " << D << " shared " << shared << " element " << i;
      }
    }
  }
}

}  // namespace
}  // namespace draftfeed::cuda
