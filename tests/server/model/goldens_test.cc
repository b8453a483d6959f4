// The CPU engine against transformers' own hidden states (goldens.h): the
// checked-in checkpoints, dense (qwen35_text, qwen35_mm, qwen3) and MoE
// (qwen35_moe, qwen3_moe), every decoder layer and the final norm, each
// sequence alone, fp32 and bf16 outputs. The same suite runs packed batches
// (goldens_packed_test.cc) and, with CUDA, the CUDA engine
// (goldens_cuda_test.cc); both instantiations below cover those too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu/rmsnorm.h"
#include "server/model/cpu_engine.h"
#include "server/model/model.h"
#include "tests/server/model/goldens.h"

namespace draftfeed::testing {
namespace {

// The checkpoint and the goldens describe the same model.
TEST_P(GoldensTest, ConfigMatchesGoldenMetadata) {
  EXPECT_EQ(config().num_layers, goldens_.num_layers);
  EXPECT_EQ(config().hidden_size, goldens_.hidden);
  ASSERT_EQ(goldens_.layer_types.size(), config().layer_types.size());
  for (size_t i = 0; i < goldens_.layer_types.size(); ++i) {
    EXPECT_EQ(goldens_.layer_types[i], KindName(config().layer_types[i])) << "layer " << i;
  }
  ASSERT_EQ(goldens_.seqs.size(), 6u);
  const std::vector<size_t> lens = {1, 17, 63, 64, 65, 130};
  for (size_t s = 0; s < lens.size(); ++s) EXPECT_EQ(goldens_.seqs[s].ids.size(), lens[s]);
}

// draftfeed id i ↔ hidden_states[i+1] (golden layer_out row i), id −1 ↔
// hidden_states[L] (final norm), and the last layer's raw output is not the
// final state: a mix-up of any two of these must fail the tolerance.
TEST_P(GoldensTest, LayerIdMapping) {
  const GoldenSeq& s = goldens_.seqs.back();
  const int64_t t = static_cast<int64_t>(s.ids.size());
  // Reversed, so the output order must follow the request, not the layer order.
  std::vector<int32_t> ids = AllLayers(n_);
  std::reverse(ids.begin(), ids.end());
  const std::vector<int32_t> lens = {static_cast<int32_t>(t)};
  absl::StatusOr<std::vector<float>> out = RunFloat(engine(), s.ids, lens, ids);
  ASSERT_TRUE(out.ok()) << out.status();
  const int64_t k_total = static_cast<int64_t>(ids.size());
  for (int64_t slot = 0; slot < k_total; ++slot) {
    const int32_t id = ids[slot];
    const std::vector<float> ours = Layer(*out, t, k_total, slot, h_);
    const int64_t want = id == kFinalLayerId ? n_ : id;  // golden index, n_ = final
    for (int64_t g = 0; g <= n_; ++g) {
      const Err e = Compare(ours, Golden(s, g), h_);
      if (g == want) {
        EXPECT_TRUE(e.Within(kRelTol, kAbsTol))
            << "id " << id << " vs " << SlotName(g) << ": " << Describe(e);
      } else {
        EXPECT_FALSE(e.Within(kRelTol, kAbsTol))
            << "id " << id << " also matches " << SlotName(g) << ": " << Describe(e);
      }
    }
  }
  // The goldens themselves: final = final norm of layer L-1's raw output, which
  // differs from it (so hidden_states[L] is not the raw output).
  const std::vector<float> raw = Golden(s, n_ - 1);
  std::vector<float> normed(raw.size());
  const std::vector<float> w = ToFloat(loaded_.model->weights.norm);
  cpu::RmsNorm(raw.data(), w.data(), t, h_, static_cast<float>(config().rms_norm_eps),
               config().features.norm == NormConvention::kOffsetOne
                   ? cpu::RmsNormKind::kZeroCentred
                   : cpu::RmsNormKind::kMultiplicative,
               normed.data());
  const Err final_vs_norm = Compare(normed, s.fp32_final, h_);
  EXPECT_TRUE(final_vs_norm.Within(kRelTol, kAbsTol)) << Describe(final_vs_norm);
  const Err final_vs_raw = Compare(raw, s.fp32_final, h_);
  EXPECT_GT(final_vs_raw.max_rel, 0.1) << Describe(final_vs_raw);
}

// Every sequence alone, every layer and the final state, against HF fp32.
TEST_P(GoldensTest, EachSequenceMatchesFp32Goldens) {
  const std::vector<int32_t> ids = AllLayers(n_);
  std::vector<Err> worst(static_cast<size_t>(n_ + 1));
  for (size_t si = 0; si < goldens_.seqs.size(); ++si) {
    const GoldenSeq& s = goldens_.seqs[si];
    const int64_t t = static_cast<int64_t>(s.ids.size());
    const std::vector<int32_t> lens = {static_cast<int32_t>(t)};
    absl::StatusOr<std::vector<float>> out = RunFloat(engine(), s.ids, lens, ids);
    ASSERT_TRUE(out.ok()) << out.status();
    for (int64_t k = 0; k <= n_; ++k) {
      const Err e = Compare(Layer(*out, t, n_ + 1, k, h_), Golden(s, k), h_);
      EXPECT_TRUE(e.Within(kRelTol, kAbsTol)) << GetParam() << " seq" << si << " (len " << t << ") "
                                              << SlotName(k) << ": " << Describe(e);
      worst[k].Merge(e);
    }
  }
  // Per layer, then per layer kind (worst over the 6 sequences).
  std::map<std::string, Err> by_kind;
  std::ostringstream table;
  table << absl::StrFormat("%-12s %-8s %-17s %10s %10s %10s %10s %12s\n", "model", "layer", "kind",
                           "max|ref|", "max_abs", "max_rel", "rms_rel", "min_cos");
  for (int64_t k = 0; k <= n_; ++k) {
    const std::string kind = k == n_ ? "final" : KindName(config().layer_types[k]);
    by_kind[kind].Merge(worst[k]);
    const Err& e = worst[k];
    table << absl::StrFormat("%-12s %-8s %-17s %10.3e %10.3e %10.3e %10.3e %12.9f\n", GetParam(),
                             k == n_ ? "final" : absl::StrCat("layer", k), kind, e.max_ref,
                             e.max_abs, e.max_rel, e.rms_rel, e.min_cos);
  }
  for (const auto& [kind, e] : by_kind) {
    table << absl::StrFormat("%-12s %-8s %-17s %10.3e %10.3e %10.3e %10.3e %12.9f\n", GetParam(),
                             "ALL", kind, e.max_ref, e.max_abs, e.max_rel, e.rms_rel, e.min_cos);
    RecordProperty(kind + "_max_abs", absl::StrFormat("%.3e", e.max_abs));
    RecordProperty(kind + "_max_rel", absl::StrFormat("%.3e", e.max_rel));
  }
  std::cout << "fp32 engine vs HF fp32, worst over the 6 sequences alone (tolerance max_abs <= "
            << kRelTol << " * max|ref| + " << kAbsTol << ")\n"
            << table.str() << std::flush;
}

// The bf16 output path is the fp32 maths rounded once, so against the fp32
// goldens it must be no worse than transformers run in bf16, per
// sequence and layer, up to the one rounding to bf16 (kBf16Unit).
TEST_P(GoldensTest, Bf16OutputNoWorseThanHfBf16) {
  const std::vector<int32_t> ids = AllLayers(n_);
  const int64_t k_total = n_ + 1;
  std::vector<Err> ours_worst(static_cast<size_t>(k_total)), hf_worst(ours_worst.size());
  for (size_t si = 0; si < goldens_.seqs.size(); ++si) {
    const GoldenSeq& s = goldens_.seqs[si];
    const int64_t t = static_cast<int64_t>(s.ids.size());
    const std::vector<int32_t> lens = {static_cast<int32_t>(t)};
    std::vector<uint16_t> bits(static_cast<size_t>(t * k_total * h_));
    const absl::Status st =
        engine().Forward({s.ids, lens, ids}, std::as_writable_bytes(std::span(bits)));
    ASSERT_TRUE(st.ok()) << st;
    absl::StatusOr<std::vector<float>> f32 = RunFloat(engine(), s.ids, lens, ids);
    ASSERT_TRUE(f32.ok()) << f32.status();
    std::vector<float> ours(bits.size());
    size_t not_rounded = 0;
    for (size_t e = 0; e < bits.size(); ++e) {
      ours[e] = Bf16ToFloat(bits[e]);
      if (bits[e] != FloatToBf16((*f32)[e])) ++not_rounded;
    }
    EXPECT_EQ(not_rounded, 0u) << "seq" << si << ": bf16 output is not the fp32 one rounded";
    for (int64_t k = 0; k < k_total; ++k) {
      const std::vector<float> ref = Golden(s, k);
      const Err mine = Compare(Layer(ours, t, k_total, k, h_), ref, h_);
      const Err hf = Compare(Golden(s, k, /*bf16=*/true), ref, h_);
      const std::string where = absl::StrCat(GetParam(), " seq", si, " ", SlotName(k), "\n ours ",
                                             Describe(mine), "\n HF   ", Describe(hf));
      EXPECT_TRUE(mine.finite) << where;
      EXPECT_LE(mine.rms_rel, hf.rms_rel + kBf16Unit) << where;
      EXPECT_GE(mine.min_cos, hf.min_cos - kBf16Unit * kBf16Unit / 2) << where;
      EXPECT_GT(mine.min_cos, kMinCosine) << where;
      ours_worst[k].Merge(mine);
      hf_worst[k].Merge(hf);
    }
  }
  std::cout << "bf16 outputs vs HF fp32, worst over the 6 sequences\n"
            << absl::StrFormat("%-12s %-8s %12s %12s %12s %12s %12s\n", "model", "layer",
                               "ours_maxrel", "ours_rmsrel", "hf_rmsrel", "ours_mincos",
                               "hf_mincos");
  for (int64_t k = 0; k < k_total; ++k) {
    std::cout << absl::StrFormat("%-12s %-8s %12.3e %12.3e %12.3e %12.9f %12.9f\n", GetParam(),
                                 k == n_ ? "final" : absl::StrCat("layer", k),
                                 ours_worst[k].max_rel, ours_worst[k].rms_rel, hf_worst[k].rms_rel,
                                 ours_worst[k].min_cos, hf_worst[k].min_cos);
  }
  std::cout << std::flush;
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, GoldensTest,
                         ::testing::Values("qwen35_text", "qwen35_mm", "qwen3"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// The MoE goldens: a Qwen3.5-MoE saved by Qwen3_5MoeForConditionalGeneration
// (8 experts top-2 plus the shared expert) and a Qwen3-MoE with one dense layer,
// both with per-expert tensors as save_pretrained writes them, through the same
// checks and bounds as the dense models.
INSTANTIATE_TEST_SUITE_P(MoeCheckpoints, GoldensTest, ::testing::Values("qwen35_moe", "qwen3_moe"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace draftfeed::testing
