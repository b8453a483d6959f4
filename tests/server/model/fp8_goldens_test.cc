// Fine-grained FP8 checkpoints (tests/data/models/*_fp8, made by
// tests/data/make_fp8_goldens.py: e4m3 weights, one scale per 128x128 block,
// BF16 scales for the two Qwen3.5 models and F32 for the two Qwen3 ones, MoE
// experts per expert) against transformers: the CPU engine against the fp32
// model on the dequantized weights ("ref", what the checkpoint means), the CUDA
// engine against the bar set by a torch emulation of an FP8 engine ("emu":
// per-token, 128-group activation quantization and block-scaled GEMMs with
// fp32 accumulation). Until the goldens are committed every test skips,
// naming the command that makes them; once goldens_report.json lists a
// model's goldens file, a missing file fails instead.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "server/model/cpu_engine.h"
#include "server/model/model.h"
#include "server/model/safetensors.h"
#include "server/model/tensor.h"
#include "server/model/weight_layout.h"
#include "tests/server/model/golden_moe_routing.h"
#include "tests/server/model/goldens.h"
#include "tests/test_data_dir.h"
#if DRAFTFEED_HAVE_CUDA
#include "server/model/cuda_engine.h"
#endif

namespace draftfeed {
namespace {

namespace fs = std::filesystem;

// CPU engine vs ref. Both evaluate the same function in fp32: the CPU engine
// widens each FP8 weight to float(e4m3) * float(scale), rounded once, which is
// how the script built ref's weights (exact for BF16 scales: a 4-bit times an
// 8-bit significand fits fp32), so they differ only in summation order, FMA
// contraction and algorithm form, as the bf16 goldens' CPU runs do against HF
// fp32. goldens_test.cc measured that at <= 3.9e-6 of max|ref| over 4-6
// layers and set its bound at 2e-5, 30x below the smallest convention error
// it tried; the same bound holds here. The FP8 quantization itself is ~1e-2
// (make_fp8_goldens.py reports ref vs the unquantized model per layer), 500x
// the bound, so an engine that ignored or misplaced a block scale fails.
constexpr double kRelTol = 2e-5;
constexpr double kAbsTol = 1e-6;
// bf16 unit roundoff: rounding to nearest bf16 (8-bit significand) moves a
// value by at most 2^-8 of itself.
constexpr double kBf16Unit = 1.0 / 256.0;
// The CUDA bar (issue 17): per layer, rms(cuda - ref) <= 1.25 rms(emu - ref)
// + one bf16 rounding of the layer, rms(bf16(ref) - ref). The 1.25 leaves room
// for the engine's other kernels (fp32 residual, fused attention and GDN),
// whose error goldens_test.cc measured at 0.65-1.10x HF-bf16's; the rounding
// term is the engine's bf16 output.
constexpr double kEmuFactor = 1.25;
// MoE only: the rms bar with routing flips in it (see CudaEngineWithinEmulationBar).
constexpr double kMoeFlipFactor = 1.5;
constexpr int kThreads = 2;

// The bf16 goldens' helpers: their layer slices, capture ids and data dir.
using testing::AllLayers;
using testing::DataDir;
using testing::Layer;

std::string GoldensFile(const std::string& model) {
  return absl::StrCat("goldens_", model, "_fp8.safetensors");
}

// make_fp8_goldens.py records each model's goldens file in goldens_report.json
// ("fp8" -> "models" -> <model> -> "goldens_file"), and the report is copied
// with the goldens: a report naming the file is the marker that it must exist.
bool ReportListsGoldens(const std::string& file) {
  std::ifstream in(DataDir() / "goldens_report.json");
  std::stringstream text;
  text << in.rdbuf();
  return text.str().find(absl::StrCat("\"", file, "\"")) != std::string::npos;
}

// F32 or BF16 `name` of `shape` as floats (copied: the mapping may be unaligned).
absl::StatusOr<std::vector<float>> ReadFloats(const SafetensorsFile& f, const std::string& name,
                                              const std::string& dtype,
                                              const std::vector<int64_t>& shape) {
  DF_ASSIGN_OR_RETURN(const SafetensorsTensor* t, testing::ExpectTensor(f, name, dtype, shape));
  const size_t n = t->nbytes / (dtype == "F32" ? 4 : 2);
  std::vector<float> out(n);
  if (dtype == "F32") {
    std::memcpy(out.data(), t->data, t->nbytes);
  } else {
    std::vector<uint16_t> bits(n);
    std::memcpy(bits.data(), t->data, t->nbytes);
    for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(bits[i]);
  }
  return out;
}

struct Fp8Seq {
  std::vector<int32_t> ids;
  // Slot k < N: raw output of layer k; slot N: the final-normed state. [T, N+1, H].
  std::vector<float> ref, emu, orig;
};

struct Fp8Goldens {
  int64_t num_layers = 0, hidden = 0, fp8_weights = 0;
  std::string scale_dtype;
  std::vector<Fp8Seq> seqs;
  MoeGoldens moe;  // fp32_router = ref's, bf16_router = emu's; experts == 0 when dense
};

// Joins [T, N, H] layers and the [T, H] final state into [T, N+1, H].
std::vector<float> WithFinal(const std::vector<float>& layers,
                             const std::vector<float>& final_state, int64_t t, int64_t n,
                             int64_t h) {
  std::vector<float> out(static_cast<size_t>(t * (n + 1) * h));
  for (int64_t i = 0; i < t; ++i) {
    std::copy_n(layers.begin() + i * n * h, n * h, out.begin() + i * (n + 1) * h);
    std::copy_n(final_state.begin() + i * h, h, out.begin() + (i * (n + 1) + n) * h);
  }
  return out;
}

absl::StatusOr<Fp8Goldens> LoadFp8Goldens(const std::string& model) {
  absl::StatusOr<SafetensorsFile> f =
      SafetensorsFile::Open((DataDir() / GoldensFile(model)).string());
  if (!f.ok()) return f.status();
  const std::map<std::string, std::string>& md = f->metadata();
  for (const char* key : {"num_layers", "hidden_size", "seq_lens", "scale_dtype", "fp8_weights"}) {
    if (!md.contains(key)) return absl::NotFoundError(absl::StrCat(f->path(), ": no ", key));
  }
  Fp8Goldens g;
  if (!absl::SimpleAtoi(md.at("num_layers"), &g.num_layers) ||
      !absl::SimpleAtoi(md.at("hidden_size"), &g.hidden) ||
      !absl::SimpleAtoi(md.at("fp8_weights"), &g.fp8_weights)) {
    return absl::InvalidArgumentError(
        absl::StrCat(f->path(), ": bad num_layers/hidden_size/fp8_weights"));
  }
  g.scale_dtype = md.at("scale_dtype");
  const int64_t n = g.num_layers, h = g.hidden;
  std::vector<int64_t> lens;
  for (absl::string_view text : absl::StrSplit(md.at("seq_lens"), ',')) {
    int64_t len = 0;
    if (!absl::SimpleAtoi(text, &len)) {
      return absl::InvalidArgumentError(absl::StrCat(f->path(), ": bad seq_lens"));
    }
    lens.push_back(len);
  }
  for (size_t i = 0; i < lens.size(); ++i) {
    const std::string p = absl::StrCat("seq", i, ".");
    const int64_t t = lens[i];
    Fp8Seq s;
    const SafetensorsTensor* ids = f->Find(p + "input_ids");
    if (ids == nullptr || ids->dtype != "I32" || ids->shape != std::vector<int64_t>{t}) {
      return absl::InvalidArgumentError(
          absl::StrCat(f->path(), ": ", p, "input_ids missing or not I32 [", t, "]"));
    }
    s.ids.resize(static_cast<size_t>(t));
    std::memcpy(s.ids.data(), ids->data, ids->nbytes);
    struct Run {
      const char* name;
      const char* dtype;  // emu's are bf16 values; orig's are stored rounded to bf16
      std::vector<float>* out;
    };
    for (const Run& run :
         {Run{"ref", "F32", &s.ref}, Run{"emu", "BF16", &s.emu}, Run{"orig", "BF16", &s.orig}}) {
      absl::StatusOr<std::vector<float>> layers =
          ReadFloats(*f, absl::StrCat(p, run.name, ".layer_out"), run.dtype, {t, n, h});
      if (!layers.ok()) return layers.status();
      absl::StatusOr<std::vector<float>> final_state =
          ReadFloats(*f, absl::StrCat(p, run.name, ".final"), run.dtype, {t, h});
      if (!final_state.ok()) return final_state.status();
      *run.out = WithFinal(*layers, *final_state, t, n, h);
    }
    g.seqs.push_back(std::move(s));
  }
  if (md.contains("num_experts")) {
    MoeGoldens& moe = g.moe;
    if (!md.contains("num_experts_per_tok") || !md.contains("mlp_types") ||
        !absl::SimpleAtoi(md.at("num_experts"), &moe.experts) ||
        !absl::SimpleAtoi(md.at("num_experts_per_tok"), &moe.top_k) || moe.top_k >= moe.experts) {
      return absl::InvalidArgumentError(
          absl::StrCat(f->path(), ": bad num_experts/num_experts_per_tok/mlp_types"));
    }
    moe.mlp_types = absl::StrSplit(md.at("mlp_types"), ',');
    if (static_cast<int64_t>(moe.mlp_types.size()) != n) {
      return absl::InvalidArgumentError(absl::StrCat(
          f->path(), ": mlp_types has ", moe.mlp_types.size(), " entries for ", n, " layers"));
    }
    for (size_t i = 0; i < lens.size(); ++i) {
      const std::string p = absl::StrCat("seq", i, ".");
      const std::vector<int64_t> shape = {lens[i], n, moe.experts};
      absl::StatusOr<std::vector<float>> ref =
          ReadFloats(*f, p + "ref.router_logits", "F32", shape);
      absl::StatusOr<std::vector<float>> emu =
          ReadFloats(*f, p + "emu.router_logits", "F32", shape);
      if (!ref.ok()) return ref.status();
      if (!emu.ok()) return emu.status();
      moe.fp32_router.push_back(*std::move(ref));
      moe.bf16_router.push_back(*std::move(emu));
    }
  }
  return g;
}

// One [T, H] layer (restricted to the tokens `keep` marks, when given) against
// its reference: max|d| and max|ref| for the fp32 bound, the absolute rms of d
// for the CUDA bar.
struct Err {
  double max_abs = 0, max_ref = 0, rms = 0, rms_ref = 0;
  bool finite = true;
  bool Within(double rel, double abs) const { return finite && max_abs <= rel * max_ref + abs; }
};

Err Compare(const std::vector<float>& ours, const std::vector<float>& ref, int64_t h,
            const std::vector<bool>& keep = {}) {
  Err e;
  double sq = 0, sq_ref = 0;
  int64_t count = 0;
  for (size_t t = 0; t * h < ref.size(); ++t) {
    if (!keep.empty() && !keep[t]) continue;
    for (int64_t i = 0; i < h; ++i) {
      const double a = ours[t * h + i], b = ref[t * h + i];
      e.finite = e.finite && std::isfinite(a);
      e.max_abs = std::max(e.max_abs, std::abs(a - b));
      e.max_ref = std::max(e.max_ref, std::abs(b));
      sq += (a - b) * (a - b);
      sq_ref += b * b;
      ++count;
    }
  }
  if (count > 0) {
    e.rms = std::sqrt(sq / count);
    e.rms_ref = std::sqrt(sq_ref / count);
  }
  return e;
}

// One bf16 rounding of a layer: rms(bf16(ref) - ref) over the kept tokens.
double Bf16RoundingRms(const std::vector<float>& ref, int64_t h, const std::vector<bool>& keep) {
  std::vector<float> rounded(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) rounded[i] = Bf16ToFloat(FloatToBf16(ref[i]));
  return Compare(rounded, ref, h, keep).rms;
}

// The median over tokens of each token's rms error against ref: a statistic
// that routing flips (O(1) errors on a minority of tokens) cannot move.
double MedianTokenRms(const std::vector<float>& ours, const std::vector<float>& ref, int64_t h) {
  std::vector<double> per;
  for (size_t t = 0; t * h < ref.size(); ++t) {
    double sq = 0;
    for (int64_t i = 0; i < h; ++i) {
      const double d = double(ours[t * h + i]) - ref[t * h + i];
      sq += d * d;
    }
    per.push_back(std::sqrt(sq / h));
  }
  std::nth_element(per.begin(), per.begin() + per.size() / 2, per.end());
  return per[per.size() / 2];
}

std::string Describe(const Err& e) {
  return absl::StrFormat("%smax|d| %.3e  max|ref| %.3e  rms %.3e  rms_ref %.3e",
                         e.finite ? "" : "NON-FINITE VALUES  ", e.max_abs, e.max_ref, e.rms,
                         e.rms_ref);
}

class Fp8GoldensTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string file = GoldensFile(GetParam());
    const bool listed = ReportListsGoldens(file);
    if (!fs::exists(DataDir() / file)) {
      ASSERT_FALSE(listed) << "tests/data/goldens_report.json lists " << file
                           << " but the file is missing: restore it or rerun "
                              "tests/data/make_fp8_goldens.py";
      GTEST_SKIP() << "tests/data/" << file
                   << " is not made yet: run `python3 tests/data/make_fp8_goldens.py --out DIR` "
                      "where torch >= 2.1 and transformers >= 5 are installed (a GPU for the "
                      "emulation) and copy DIR/goldens_*_fp8.safetensors, DIR/models/*_fp8 and "
                      "DIR/goldens_report.json into tests/data";
    }
    ASSERT_TRUE(listed) << "tests/data/" << file
                        << " exists but goldens_report.json has no fp8 entry naming it: copy the "
                           "report make_fp8_goldens.py wrote with it";
    absl::StatusOr<Fp8Goldens> g = LoadFp8Goldens(GetParam());
    ASSERT_TRUE(g.ok()) << g.status();
    goldens_ = *std::move(g);
    absl::StatusOr<std::unique_ptr<Model>> m =
        LoadModel((DataDir() / "models" / absl::StrCat(GetParam(), "_fp8")).string());
    ASSERT_TRUE(m.ok()) << GetParam() << "_fp8: " << m.status();
    model_ = *std::move(m);
    absl::StatusOr<std::unique_ptr<CpuEngine>> e = CpuEngine::Create(model_.get(), kThreads);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = *std::move(e);
    n_ = goldens_.num_layers;
    h_ = goldens_.hidden;
  }

  std::string SlotName(int64_t k) const { return k == n_ ? "final" : absl::StrCat("layer", k); }
  std::vector<float> Slot(const std::vector<float>& buf, int64_t tokens, int64_t k) const {
    return Layer(buf, tokens, n_ + 1, k, h_);
  }

  Fp8Goldens goldens_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<CpuEngine> engine_;
  int64_t n_ = 0, h_ = 0;
};

// The loader sees the checkpoint as it ships: FP8 exactly where the format
// quantizes (every fp8_eligible tensor, and nothing else: embeddings, norms,
// lm_head, routers, GDN a/b stay bf16), the scales in the dtype the script
// stored and on the 128x128 grid, and as many FP8 tensors as it wrote.
TEST_P(Fp8GoldensTest, CheckpointLoadsAsFp8) {
  const ModelConfig& c = model_->config;
  EXPECT_TRUE(c.quantization.enabled);
  EXPECT_EQ(c.quantization.block_rows, kFp8BlockSize);
  EXPECT_EQ(c.quantization.block_cols, kFp8BlockSize);
  EXPECT_FALSE(c.quantization.modules_to_not_convert.empty());
  EXPECT_EQ(c.num_layers, n_);
  EXPECT_EQ(c.hidden_size, h_);
  std::vector<WeightSpec> specs = DecoderWeightSpecs(c);
  specs.push_back(LmHeadSpec(c));
  int64_t fp8_tensors = 0;
  for (const WeightSpec& spec : specs) {
    const Tensor& t = WeightSlot(model_->weights, spec);
    ASSERT_TRUE(t.valid()) << spec.name;
    EXPECT_EQ(t.fp8(), spec.fp8_eligible) << spec.name << " is " << DTypeName(t.dtype);
    if (!t.fp8()) continue;
    EXPECT_EQ(DTypeName(t.scale_inv.dtype), goldens_.scale_dtype) << spec.name;
    EXPECT_EQ(t.scale_inv.shape, Fp8ScaleShape(t.shape)) << spec.name;
    // The checkpoint stores experts one tensor per expert and part.
    fp8_tensors +=
        t.shape.size() == 3 ? t.shape[0] * std::max<int64_t>(1, spec.expert_parts.size()) : 1;
    for (float v : ToFloat(t)) {
      ASSERT_TRUE(std::isfinite(v)) << spec.name << " dequantizes to a non-finite value";
    }
  }
  EXPECT_EQ(fp8_tensors, goldens_.fp8_weights);
}

// The goldens measure FP8: the quantization moved the model (ref vs the
// unquantized model, by more than one bf16 rounding) and the emulated
// engine's error is above one bf16 rounding and under a fifth of the layer,
// so the CUDA bar below is neither vacuous nor loose.
// MoE: on the tokens the CUDA test compares (a routing flip is not GEMM error).
TEST_P(Fp8GoldensTest, GoldensMeasureFp8) {
  const NearTies ties = goldens_.moe.experts > 0 ? FindNearTies(goldens_.moe) : NearTies();
  for (size_t si = 0; si < goldens_.seqs.size(); ++si) {
    const Fp8Seq& s = goldens_.seqs[si];
    const int64_t t = static_cast<int64_t>(s.ids.size());
    const std::vector<bool> keep = ties.stable.empty() ? std::vector<bool>() : ties.stable[si];
    if (!keep.empty() && std::find(keep.begin(), keep.end(), true) == keep.end()) continue;
    for (int64_t k = 0; k <= n_; ++k) {
      const std::vector<float> ref = Slot(s.ref, t, k);
      const Err emu = Compare(Slot(s.emu, t, k), ref, h_, keep);
      const Err orig = Compare(Slot(s.orig, t, k), ref, h_, keep);
      const double rounding = Bf16RoundingRms(ref, h_, keep);
      const std::string where = absl::StrCat(GetParam(), " seq", si, " ", SlotName(k), "\n emu  ",
                                             Describe(emu), "\n orig ", Describe(orig));
      EXPECT_TRUE(emu.finite && orig.finite) << where;
      EXPECT_GT(emu.rms, rounding) << where;
      EXPECT_LT(emu.rms, 0.2 * emu.rms_ref) << where;
      EXPECT_GT(orig.rms, rounding) << where;
    }
  }
}

// The CPU engine computes the FP8 checkpoint's meaning: fp32 maths on the
// dequantized weights. Its fp32 output matches ref at the fp32 bound, alone
// and packed; its bf16 output is that rounded once, so each value is within
// one bf16 rounding (2^-8 of itself) of ref plus twice the fp32 bound.
TEST_P(Fp8GoldensTest, CpuEngineMatchesDequantizedReference) {
  const std::vector<int32_t> ids = AllLayers(n_);
  const int64_t k_total = n_ + 1;
  std::vector<int32_t> all_tokens, all_lens;
  for (const Fp8Seq& s : goldens_.seqs) {
    all_tokens.insert(all_tokens.end(), s.ids.begin(), s.ids.end());
    all_lens.push_back(static_cast<int32_t>(s.ids.size()));
  }
  std::vector<float> packed(all_tokens.size() * static_cast<size_t>(k_total * h_));
  const absl::Status pst = engine_->ForwardFloat({all_tokens, all_lens, ids}, packed);
  ASSERT_TRUE(pst.ok()) << pst;
  int64_t offset = 0;
  for (size_t si = 0; si < goldens_.seqs.size(); ++si) {
    const Fp8Seq& s = goldens_.seqs[si];
    const int64_t t = static_cast<int64_t>(s.ids.size());
    const std::vector<int32_t> lens = {static_cast<int32_t>(t)};
    std::vector<float> f32(static_cast<size_t>(t * k_total * h_));
    absl::Status st = engine_->ForwardFloat({s.ids, lens, ids}, f32);
    ASSERT_TRUE(st.ok()) << st;
    std::vector<uint16_t> bits(f32.size());
    st = engine_->Forward({s.ids, lens, ids}, std::as_writable_bytes(std::span(bits)));
    ASSERT_TRUE(st.ok()) << st;
    const std::vector<float> packed_seq(packed.begin() + offset * k_total * h_,
                                        packed.begin() + (offset + t) * k_total * h_);
    for (int64_t k = 0; k < k_total; ++k) {
      const std::vector<float> ref = Slot(s.ref, t, k);
      const Err alone = Compare(Slot(f32, t, k), ref, h_);
      const Err in_pack = Compare(Slot(packed_seq, t, k), ref, h_);
      const std::string where = absl::StrCat(GetParam(), " seq", si, " ", SlotName(k));
      EXPECT_TRUE(alone.Within(kRelTol, kAbsTol)) << where << " alone: " << Describe(alone);
      EXPECT_TRUE(in_pack.Within(kRelTol, kAbsTol)) << where << " packed: " << Describe(in_pack);
      const double slack = 2 * (kRelTol * alone.max_ref + kAbsTol);
      int64_t outside = 0;
      double worst = 0;
      for (int64_t tok = 0; tok < t; ++tok) {
        for (int64_t i = 0; i < h_; ++i) {
          const double r = ref[tok * h_ + i];
          const double o = Bf16ToFloat(bits[(tok * k_total + k) * h_ + i]);
          const double excess = std::abs(o - r) - (kBf16Unit * std::abs(r) + slack);
          worst = std::max(worst, excess);
          if (!(excess <= 0)) ++outside;
        }
      }
      EXPECT_EQ(outside, 0) << where << " bf16 output: " << outside
                            << " values further than one bf16 rounding (+ fp32 bound) from ref, "
                               "worst by "
                            << worst;
    }
    offset += t;
  }
}

#if DRAFTFEED_HAVE_CUDA
// The CUDA engine (FP8 GEMMs) against the bar, per sequence and layer, alone
// and packed: rms(cuda - ref) <= 1.25 rms(emu - ref) + rms(bf16(ref) - ref).
// MoE models are compared on every token: FP8 activation noise moves the
// router's logits by far more than bf16's (on these goldens 73-96% of tokens
// have a top-k gap inside emu's logit noise, so excluding near ties would
// leave almost nothing), and the emulation's own error already holds the
// routing flips an FP8 engine makes: the bar compares like with like.
TEST_P(Fp8GoldensTest, CudaEngineWithinEmulationBar) {
  NearTies ties;
  if (goldens_.moe.experts > 0) {
    ties = FindNearTies(goldens_.moe);
    std::cout << GetParam() << "_fp8: " << ties.near_tie << " of " << ties.total
              << " tokens near-tie (ref top-k logit gap < tau = " << ties.tau
              << " at some MoE layer); all tokens compared\n";
    ties.stable.clear();
  }
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  CudaEngineOptions opt;
  opt.max_tokens = 1024;
  opt.max_seqs = 16;
  auto gpu = CudaEngine::Create(model_.get(), opt);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const std::vector<int32_t> ids = AllLayers(n_);
  const int64_t k_total = n_ + 1;
  std::vector<std::vector<int32_t>> seq_ids;
  for (const Fp8Seq& s : goldens_.seqs) seq_ids.push_back(s.ids);
  absl::StatusOr<std::vector<testing::AloneAndPacked>> runs =
      testing::RunAloneAndPacked(**gpu, seq_ids, ids);
  ASSERT_TRUE(runs.ok()) << runs.status();
  std::vector<double> worst_ratio(static_cast<size_t>(k_total), 0.0);
  std::vector<double> cuda_rel(worst_ratio.size(), 0.0), emu_rel(worst_ratio.size(), 0.0);
  for (size_t si = 0; si < goldens_.seqs.size(); ++si) {
    const Fp8Seq& s = goldens_.seqs[si];
    const int64_t t = static_cast<int64_t>(s.ids.size());
    const std::vector<bool> keep = ties.stable.empty() ? std::vector<bool>() : ties.stable[si];
    if (!keep.empty() && std::find(keep.begin(), keep.end(), true) == keep.end()) {
      continue;  // every token near-tie: nothing to compare
    }
    for (int pass = 0; pass < 2; ++pass) {
      const std::vector<float>& ours = pass == 0 ? (*runs)[si].alone : (*runs)[si].packed;
      for (int64_t k = 0; k < k_total; ++k) {
        const std::vector<float> ref = Slot(s.ref, t, k);
        const Err mine = Compare(Slot(ours, t, k), ref, h_, keep);
        const Err emu = Compare(Slot(s.emu, t, k), ref, h_, keep);
        const double bar = kEmuFactor * emu.rms + Bf16RoundingRms(ref, h_, keep);
        const std::string where =
            absl::StrCat(GetParam(), "_fp8", pass == 0 ? " alone" : " packed", " seq", si, " ",
                         SlotName(k), ": bar ", absl::StrFormat("%.3e", bar), "\n cuda ",
                         Describe(mine), "\n emu  ", Describe(emu));
        EXPECT_TRUE(mine.finite) << where;
        if (goldens_.moe.experts == 0) {
          EXPECT_LE(mine.rms, bar) << where;
        } else {
          // MoE: FP8 noise flips the routing of a different random subset of
          // tokens in the engine and in the emulation (O(1) errors each), so
          // over a few hundred tokens either rms moves by several % by chance.
          // The bar holds on the median token, which flips cannot move, and
          // the rms (flips included) within kMoeFlipFactor of the emulation's.
          const std::vector<float> mine_slot = Slot(ours, t, k);
          const std::vector<float> emu_slot = Slot(s.emu, t, k);
          std::vector<float> rounded(ref.size());
          for (size_t e = 0; e < ref.size(); ++e) rounded[e] = Bf16ToFloat(FloatToBf16(ref[e]));
          EXPECT_LE(
              MedianTokenRms(mine_slot, ref, h_),
              kEmuFactor * MedianTokenRms(emu_slot, ref, h_) + MedianTokenRms(rounded, ref, h_))
              << where;
          EXPECT_LE(mine.rms, kMoeFlipFactor * emu.rms + Bf16RoundingRms(ref, h_, keep)) << where;
        }
        worst_ratio[k] = std::max(worst_ratio[k], mine.rms / bar);
        cuda_rel[k] = std::max(cuda_rel[k], mine.rms / mine.rms_ref);
        emu_rel[k] = std::max(emu_rel[k], emu.rms / emu.rms_ref);
      }
    }
  }
  std::cout << "CUDA FP8 engine vs the fp32 dequantized reference, worst over the sequences "
               "alone and packed\n"
            << absl::StrFormat("%-16s %-8s %12s %12s %12s\n", "model", "layer", "cuda_rmsrel",
                               "emu_rmsrel", "cuda/bar");
  for (int64_t k = 0; k < k_total; ++k) {
    std::cout << absl::StrFormat("%-16s %-8s %12.3e %12.3e %12.3f\n", GetParam() + "_fp8",
                                 SlotName(k), cuda_rel[k], emu_rel[k], worst_ratio[k]);
  }
  std::cout << std::flush;
}
#endif  // DRAFTFEED_HAVE_CUDA

INSTANTIATE_TEST_SUITE_P(Fp8Checkpoints, Fp8GoldensTest,
                         ::testing::Values("qwen35_text", "qwen3", "qwen35_moe", "qwen3_moe"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace draftfeed
