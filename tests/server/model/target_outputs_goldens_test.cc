// The CPU engine's target outputs (argmax, top-k log-probs, draft-vocabulary
// probs; common/target_outputs.h) against transformers' own, from its fp32
// logits (target_outputs_goldens.h), for every checked-in checkpoint: dense,
// MoE and FP8, each sequence alone, the draft probs in bf16 and in fp8_e4m3.
// Each model skips, naming the file, until its goldens are made. This file
// also defines the helpers target_outputs_goldens.h declares (the CUDA
// variant, target_outputs_goldens_cuda_test.cc, is linked into this binary).
#include "tests/server/model/target_outputs_goldens.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/fp8_e4m3.h"
#include "common/status_macros.h"
#include "server/model/safetensors.h"
#include "server/model/tensor.h"

namespace draftfeed::testing {
namespace {

constexpr size_t kMaxExamples = 8;

// The mapping may be unaligned: copy instead of casting.
template <typename T>
absl::StatusOr<std::vector<T>> Read(const SafetensorsFile& f, const std::string& name,
                                    const std::string& dtype, const std::vector<int64_t>& shape) {
  DF_ASSIGN_OR_RETURN(const SafetensorsTensor* t, ExpectTensor(f, name, dtype, shape));
  std::vector<T> out(t->nbytes / sizeof(T));
  std::memcpy(out.data(), t->data, t->nbytes);
  return out;
}

uint32_t Le32(const std::byte* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}
int32_t LeI32(const std::byte* p) { return static_cast<int32_t>(Le32(p)); }
float LeF32(const std::byte* p) {
  const uint32_t u = Le32(p);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The spacing of e4m3 values at magnitude x (in code units): 2^-9 below the
// smallest normal 2^-6, else 2^(e-3) for x in [2^e, 2^(e+1)).
double E4m3Step(double x) {
  if (x < 1.0 / 64) return 1.0 / 512;
  return std::ldexp(1.0, static_cast<int>(std::floor(std::log2(x))) - 3);
}

void Note(OutputsStats& s, std::string what) {
  if (s.examples.size() < kMaxExamples) s.examples.push_back(std::move(what));
}

// The format's own rules (OutputsStats::malformed); "" if the token keeps them.
std::string Malformed(const TokenOutputs& o, const TargetOutputs& spec, int64_t vocab) {
  auto in_vocab = [vocab](int32_t id) { return id >= 0 && id < vocab; };
  if (spec.argmax && !in_vocab(o.argmax)) return absl::StrCat("argmax ", o.argmax);
  std::set<int32_t> seen;
  for (size_t i = 0; i < o.top_ids.size(); ++i) {
    if (!in_vocab(o.top_ids[i]) || !seen.insert(o.top_ids[i]).second) {
      return absl::StrCat("top_ids [", absl::StrJoin(o.top_ids, ", "), "]");
    }
    const float lp = o.top_logprobs[i];
    if (!std::isfinite(lp) || lp > 1e-6f || (i > 0 && lp > o.top_logprobs[i - 1])) {
      return absl::StrCat("top_logprobs [", absl::StrJoin(o.top_logprobs, ", "), "]");
    }
  }
  if (spec.argmax && !o.top_ids.empty() && o.argmax != o.top_ids[0]) {
    return absl::StrCat("argmax ", o.argmax, " but top_ids[0] ", o.top_ids[0]);
  }
  if (spec.probs_encoding == CaptureEncoding::kFp8E4m3 && !spec.draft_vocab.empty()) {
    if (!std::isfinite(o.probs_scale) || o.probs_scale <= 0) {
      return absl::StrCat("probs scale ", o.probs_scale);
    }
    for (uint8_t c : o.codes) {
      if ((c & 0x7f) == 0x7f) return absl::StrFormat("probs code 0x%02x (NaN)", c);
    }
  }
  for (float p : o.probs) {
    if (!std::isfinite(p) || p < 0) return absl::StrCat("prob ", p);
  }
  return "";
}

double Tv(std::span<const float> a, std::span<const float> b) {
  double s = 0;
  for (size_t j = 0; j < a.size(); ++j) s += std::abs(double{a[j]} - b[j]);
  return 0.5 * s;
}

}  // namespace

int64_t OutputGoldens::tokens() const {
  int64_t n = 0;
  for (const OutputGoldenSeq& s : seqs) n += static_cast<int64_t>(s.ids.size());
  return n;
}

std::string OutputGoldensFile(const std::string& model) {
  return absl::StrCat("goldens_outputs_", model, ".safetensors");
}

absl::StatusOr<OutputGoldens> LoadOutputGoldens(const std::string& model) {
  DF_ASSIGN_OR_RETURN(SafetensorsFile f,
                      SafetensorsFile::Open((DataDir() / OutputGoldensFile(model)).string()));
  const std::map<std::string, std::string>& md = f.metadata();
  OutputGoldens g;
  int64_t num_seqs = 0, top_k = 0;
  for (const char* key : {"vocab_size", "num_seqs", "top_k"}) {
    if (!md.contains(key)) return absl::NotFoundError(absl::StrCat(f.path(), ": no ", key));
  }
  if (!absl::SimpleAtoi(md.at("vocab_size"), &g.vocab) ||
      !absl::SimpleAtoi(md.at("num_seqs"), &num_seqs) ||
      !absl::SimpleAtoi(md.at("top_k"), &top_k)) {
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": bad vocab_size/num_seqs/top_k"));
  }
  g.top_k = static_cast<int32_t>(top_k);
  const SafetensorsTensor* dv = f.Find("draft_vocab");
  if (dv == nullptr || dv->shape.size() != 1) {
    return absl::NotFoundError(absl::StrCat(f.path(), ": no 1-D draft_vocab"));
  }
  DF_ASSIGN_OR_RETURN(g.draft_vocab, Read<int32_t>(f, "draft_vocab", "I32", dv->shape));
  const int64_t vd = dv->shape[0], k = top_k;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const std::string p = absl::StrCat("seq", i, ".");
    const SafetensorsTensor* ids = f.Find(p + "input_ids");
    if (ids == nullptr || ids->shape.size() != 1) {
      return absl::NotFoundError(absl::StrCat(f.path(), ": no 1-D ", p, "input_ids"));
    }
    const int64_t t = ids->shape[0];
    OutputGoldenSeq s;
    DF_ASSIGN_OR_RETURN(s.ids, Read<int32_t>(f, p + "input_ids", "I32", {t}));
    DF_ASSIGN_OR_RETURN(s.argmax, Read<int32_t>(f, p + "argmax", "I32", {t}));
    DF_ASSIGN_OR_RETURN(s.top2_margin, Read<float>(f, p + "top2_margin", "F32", {t}));
    DF_ASSIGN_OR_RETURN(s.top_k_ids, Read<int32_t>(f, p + "top_k_ids", "I32", {t, k}));
    DF_ASSIGN_OR_RETURN(s.top_k_logprobs, Read<float>(f, p + "top_k_logprobs", "F32", {t, k}));
    DF_ASSIGN_OR_RETURN(s.draft_probs, Read<float>(f, p + "draft_probs", "F32", {t, vd}));
    g.seqs.push_back(std::move(s));
  }
  return g;
}

TargetOutputs OutputsRequest(const OutputGoldens& g, CaptureEncoding probs) {
  TargetOutputs spec;
  spec.argmax = true;
  spec.top_k = g.top_k;
  spec.draft_vocab = g.draft_vocab;
  spec.probs_encoding = probs;
  return spec;
}

TokenOutputs DecodeTokenOutputs(std::span<const std::byte> bytes, const TargetOutputs& spec) {
  const TargetOutputsLayout l = LayoutOf(spec);
  const std::byte* b = bytes.data();
  TokenOutputs o;
  if (l.argmax >= 0) o.argmax = LeI32(b + l.argmax);
  for (int32_t i = 0; i < spec.top_k; ++i) {
    o.top_ids.push_back(LeI32(b + l.top_k_ids + 4 * i));
    o.top_logprobs.push_back(LeF32(b + l.top_k_logprobs + 4 * i));
  }
  const auto vd = static_cast<int64_t>(spec.draft_vocab.size());
  if (vd > 0 && spec.probs_encoding == CaptureEncoding::kFp8E4m3) {
    o.probs_scale = LeF32(b + l.probs_scale);
    for (int64_t j = 0; j < vd; ++j) {
      const auto c = static_cast<uint8_t>(b[l.probs + j]);
      o.codes.push_back(c);
      o.probs.push_back(E4m3ToFloat(c) * o.probs_scale);
    }
  } else if (vd > 0) {
    for (int64_t j = 0; j < vd; ++j) {
      const auto bits = static_cast<uint16_t>(static_cast<uint16_t>(b[l.probs + 2 * j]) |
                                              static_cast<uint16_t>(b[l.probs + 2 * j + 1]) << 8);
      o.probs.push_back(Bf16ToFloat(bits));
    }
  }
  return o;
}

absl::StatusOr<std::vector<SeqOutputs>> RunOutputsAlone(Engine& engine, const OutputGoldens& g,
                                                        const TargetOutputs& spec) {
  const ModelConfig& config = engine.model().config;
  const int64_t out_bytes = LayoutOf(spec).bytes;
  std::vector<SeqOutputs> all;
  for (const OutputGoldenSeq& s : g.seqs) {
    const std::vector<int32_t> lens = {static_cast<int32_t>(s.ids.size())};
    ForwardInput in;
    in.token_ids = s.ids;
    in.seq_lens = lens;
    in.layers = {};
    in.encoding = CaptureEncoding::kBf16;
    in.outputs = &spec;
    const int64_t row = RowBytesPerToken(config, in);
    if (row != out_bytes) {
      return absl::InternalError(absl::StrCat("RowBytesPerToken is ", row, " with no layers; ",
                                              "LayoutOf(outputs).bytes is ", out_bytes));
    }
    const size_t total = CaptureBytes(config, in);
    if (total != s.ids.size() * static_cast<size_t>(row)) {
      return absl::InternalError(absl::StrCat("CaptureBytes is ", total, " for ", s.ids.size(),
                                              " tokens of ", row, " bytes"));
    }
    std::vector<std::byte> buf(total);
    DF_RETURN_IF_ERROR(engine.Forward(in, buf));
    SeqOutputs seq;
    for (size_t t = 0; t < s.ids.size(); ++t) {
      seq.push_back(DecodeTokenOutputs(std::span<const std::byte>(buf).subspan(
                                           t * static_cast<size_t>(row), static_cast<size_t>(row)),
                                       spec));
    }
    all.push_back(std::move(seq));
  }
  return all;
}

absl::StatusOr<std::vector<SeqOutputs>> ReducedPrecisionBar(const std::string& model,
                                                            const Model& m,
                                                            const OutputGoldens& g) {
  const ModelConfig& c = m.config;
  const Tensor* head = &m.weights.lm_head;
  if (!head->valid() && c.tie_word_embeddings) head = &m.weights.embed_tokens;
  if (!head->valid()) return absl::FailedPreconditionError(absl::StrCat(model, ": no lm_head"));
  const std::vector<float> w = ToFloat(*head);  // [V, H]
  const int64_t v_size = c.vocab_size, h = c.hidden_size;
  if (static_cast<int64_t>(w.size()) != v_size * h || v_size != g.vocab) {
    return absl::InvalidArgumentError(absl::StrCat(model, ": lm_head ", head->ShapeString(),
                                                   ", vocab ", v_size, ", goldens ", g.vocab));
  }
  DF_ASSIGN_OR_RETURN(SafetensorsFile f,
                      SafetensorsFile::Open(
                          (DataDir() / absl::StrCat("goldens_", model, ".safetensors")).string()));
  std::vector<SeqOutputs> all;
  for (size_t si = 0; si < g.seqs.size(); ++si) {
    const OutputGoldenSeq& s = g.seqs[si];
    const auto t_len = static_cast<int64_t>(s.ids.size());
    const std::string p = absl::StrCat("seq", si, ".");
    DF_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                        Read<int32_t>(f, p + "input_ids", "I32", {t_len}));
    if (ids != s.ids) {
      return absl::InvalidArgumentError(absl::StrCat(f.path(), ": ", p, "input_ids differ from ",
                                                     OutputGoldensFile(model), "'s"));
    }
    std::vector<float> fin;
    if (f.Find(p + "bf16.final") != nullptr) {
      DF_ASSIGN_OR_RETURN(fin, Read<float>(f, p + "bf16.final", "F32", {t_len, h}));
    } else {
      DF_ASSIGN_OR_RETURN(std::vector<uint16_t> bits,
                          Read<uint16_t>(f, p + "emu.final", "BF16", {t_len, h}));
      for (uint16_t b : bits) fin.push_back(Bf16ToFloat(b));
    }
    SeqOutputs seq;
    std::vector<double> l(static_cast<size_t>(v_size));
    for (int64_t t = 0; t < t_len; ++t) {
      for (int64_t v = 0; v < v_size; ++v) {
        double acc = 0;
        for (int64_t i = 0; i < h; ++i) acc += double{fin[t * h + i]} * w[v * h + i];
        l[v] = acc;
      }
      std::vector<int32_t> order(static_cast<size_t>(v_size));
      for (int32_t v = 0; v < v_size; ++v) order[v] = v;
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t b) { return l[a] > l[b]; });
      const double mx = l[order[0]];
      double sum = 0;
      for (double x : l) sum += std::exp(x - mx);
      const double lse = mx + std::log(sum);
      TokenOutputs o;
      o.argmax = order[0];
      for (int32_t i = 0; i < g.top_k; ++i) {
        o.top_ids.push_back(order[i]);
        o.top_logprobs.push_back(static_cast<float>(l[order[i]] - lse));
      }
      double md = -std::numeric_limits<double>::infinity(), ds = 0;
      for (int32_t id : g.draft_vocab) md = std::max(md, l[id]);
      for (int32_t id : g.draft_vocab) ds += std::exp(l[id] - md);
      for (int32_t id : g.draft_vocab) {
        o.probs.push_back(Bf16ToFloat(FloatToBf16(static_cast<float>(std::exp(l[id] - md) / ds))));
      }
      seq.push_back(std::move(o));
    }
    all.push_back(std::move(seq));
  }
  return all;
}

std::string TopKIdsDiffer(std::span<const int32_t> golden_ids, std::span<const float> golden_lp,
                          std::span<const int32_t> ids, std::span<const float> lp, double tie) {
  const size_t k = golden_ids.size();
  auto describe = [&](size_t a, size_t b, const std::string& why) {
    return absl::StrCat(why, " at positions [", a, ", ", b, "): golden ids [",
                        absl::StrJoin(golden_ids, ", "), "] log-probs [",
                        absl::StrJoin(golden_lp, ", "), "], ours [", absl::StrJoin(ids, ", "),
                        "] [", absl::StrJoin(lp, ", "), "]");
  };
  if (ids.size() != k || lp.size() != k) return describe(0, k, "ours lists another k");
  for (size_t a = 0; a < k;) {
    size_t b = a + 1;
    while (b < k && double{golden_lp[b - 1]} - golden_lp[b] <= tie) ++b;
    std::vector<int32_t> want(golden_ids.begin() + a, golden_ids.begin() + b);
    std::vector<int32_t> got(ids.begin() + a, ids.begin() + b);
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    if (b < k) {
      if (want != got) return describe(a, b, b - a == 1 ? "another id" : "another set of tied ids");
    } else {
      for (size_t i = a; i < k; ++i) {
        if (std::binary_search(want.begin(), want.end(), ids[i])) continue;
        if (std::abs(double{lp[i]} - golden_lp[k - 1]) > tie) {
          return describe(a, b, "an id the goldens do not list, not tied with their k-th");
        }
      }
    }
    a = b;
  }
  return "";
}

std::vector<double> OutputsStats::TvExcess() const {
  std::vector<double> out(tv.size());
  for (size_t i = 0; i < tv.size(); ++i) out[i] = tv[i] - tv_floor[i];
  return out;
}

OutputsStats CompareOutputs(const OutputGoldens& g, const std::vector<SeqOutputs>& ours,
                            const TargetOutputs& spec) {
  OutputsStats st;
  const auto k = static_cast<size_t>(g.top_k);
  const size_t vd = g.draft_vocab.size();
  const bool fp8 = spec.probs_encoding == CaptureEncoding::kFp8E4m3;
  double overlap = 0;
  for (size_t si = 0; si < g.seqs.size() && si < ours.size(); ++si) {
    const OutputGoldenSeq& s = g.seqs[si];
    for (size_t t = 0; t < s.ids.size() && t < ours[si].size(); ++t) {
      const TokenOutputs& o = ours[si][t];
      const std::string where = absl::StrCat("seq", si, " token ", t, ": ");
      ++st.tokens;
      if (std::string bad = Malformed(o, spec, g.vocab); !bad.empty()) {
        ++st.malformed;
        Note(st, where + "malformed: " + bad);
      }
      if (s.top2_margin[t] > kTieGap) {
        ++st.argmax_checked;
        if (o.argmax != s.argmax[t]) {
          ++st.argmax_mismatch;
          Note(st, absl::StrCat(where, "argmax ", o.argmax, ", golden ", s.argmax[t],
                                " (top-2 margin ", s.top2_margin[t], ")"));
        }
      }
      const std::span<const int32_t> gi(s.top_k_ids.data() + t * k, k);
      const std::span<const float> gl(s.top_k_logprobs.data() + t * k, k);
      if (o.top_ids.size() != k || o.probs.size() != vd) {
        ++st.malformed;
        Note(st, absl::StrCat(where, o.top_ids.size(), " top ids and ", o.probs.size(), " probs"));
        continue;
      }
      if (std::string d = TopKIdsDiffer(gi, gl, o.top_ids, o.top_logprobs, kTieGap); !d.empty()) {
        ++st.topk_id_failures;
        Note(st, where + d);
      }
      const std::set<int32_t> want(gi.begin(), gi.end());
      int64_t common = 0;
      double lp_err = 0;
      for (size_t i = 0; i < k; ++i) {
        common += want.contains(o.top_ids[i]) ? 1 : 0;
        lp_err = std::max(lp_err, std::abs(double{o.top_logprobs[i]} - gl[i]));
      }
      if (!std::isfinite(lp_err)) lp_err = std::numeric_limits<double>::infinity();
      overlap += static_cast<double>(common) / static_cast<double>(k);
      st.logprob_err.push_back(lp_err);
      const std::span<const float> gp(s.draft_probs.data() + t * vd, vd);
      double tv = Tv(gp, o.probs);
      if (!std::isfinite(tv)) tv = std::numeric_limits<double>::infinity();
      st.tv.push_back(tv);
      double floor = 0;
      int64_t off_step = 0;
      const double sc = o.probs_scale;
      const bool scale_ok = std::isfinite(sc) && sc > 0;
      for (size_t j = 0; j < vd; ++j) {
        const double want_p = gp[j];
        double step = std::ldexp(want_p, -7);  // bf16: a step is at most 2^-7 of the value
        if (fp8 && scale_ok) {
          const float code_units = static_cast<float>(want_p / sc);
          floor += std::abs(E4m3ToFloat(FloatToE4m3(code_units)) * sc - want_p);
          step = sc * E4m3Step(want_p / sc * (1 + 1.0 / 1024));
        }
        if (!(std::abs(double{o.probs[j]} - want_p) <= step + std::ldexp(want_p, -10))) ++off_step;
      }
      st.tv_floor.push_back(fp8 ? 0.5 * floor : 0.0);
      if (off_step > 0) {
        ++st.encoding_failures;
        Note(st, absl::StrCat(where, off_step, " of ", vd, " probs further than one ",
                              fp8 ? "e4m3 step (scale " + absl::StrCat(sc) + ")" : "bf16 step",
                              " from the golden"));
      }
    }
  }
  st.topk_overlap = st.tokens > 0 ? overlap / static_cast<double>(st.tokens) : 0;
  return st;
}

double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const auto n = static_cast<double>(v.size());
  const auto idx = static_cast<size_t>(std::max(0.0, std::ceil(q * n) - 1));
  return v[std::min(idx, v.size() - 1)];
}

std::string Summary(const OutputsStats& s) {
  const std::vector<double> ex = s.TvExcess();
  return absl::StrFormat(
      "argmax %d/%d wrong, top-k %d failing, overlap %.3f, logprob err med %.2e p99 %.2e max "
      "%.2e, TV med %.2e p99 %.2e, e4m3 floor med %.2e, TV-floor med %.2e p99 %.2e",
      s.argmax_mismatch, s.argmax_checked, s.topk_id_failures, s.topk_overlap,
      Quantile(s.logprob_err, 0.5), Quantile(s.logprob_err, 0.99), Quantile(s.logprob_err, 1.0),
      Quantile(s.tv, 0.5), Quantile(s.tv, 0.99), Quantile(s.tv_floor, 0.5), Quantile(ex, 0.5),
      Quantile(ex, 0.99));
}

namespace {

// Log-probs: the brief's bar, 2^-6, far above the fp32 engine's ~1e-5 but
// below any convention error (a log-sum-exp over the draft vocabulary instead
// of the full one, or over a wrong row, is O(0.1-1) here: logits have std 0.4).
constexpr double kLogprobTol = 1.0 / 64;
// Draft probs, per token total variation 0.5 Σ|p - q|: median and 99th
// percentile. bf16 costs at most 2^-10 (half a step, 2^-9 of each value);
// e4m3 costs ~2^-6.5 by itself (three mantissa bits: measured 1.1e-2 median on
// these goldens at scale max/448), so for fp8 the bound is on the TV beyond
// what e4m3 costs at the row's own scale, TV(golden, s * e4m3(golden / s)).
// Wrong columns (the draft ids sorted, or another order) are ~0.2.
constexpr double kTvMedian = 1.0 / 256;
constexpr double kTvP99 = 1.0 / 64;

TEST_P(TargetOutputsGoldensTest, GoldensDescribeTheCheckpoint) {
  const ModelConfig& c = loaded_.model->config;
  EXPECT_EQ(goldens_.vocab, c.vocab_size);
  EXPECT_EQ(goldens_.top_k, 8);
  EXPECT_EQ(goldens_.draft_vocab.size(), 100u);
  EXPECT_FALSE(std::is_sorted(goldens_.draft_vocab.begin(), goldens_.draft_vocab.end()))
      << "the draft vocabulary is sorted: a column-order bug would not show";
  const TargetOutputs spec = OutputsRequest(goldens_, CaptureEncoding::kBf16);
  EXPECT_TRUE(ValidateTargetOutputs(spec, c.vocab_size).ok());
  EXPECT_TRUE(loaded_.engine->serves_target_outputs())
      << GetParam() << ": the CPU engine does not serve target outputs";
  for (size_t si = 0; si < goldens_.seqs.size(); ++si) {
    const OutputGoldenSeq& s = goldens_.seqs[si];
    for (size_t t = 0; t < s.ids.size(); ++t) {
      EXPECT_GE(s.top2_margin[t], 0.0f) << "seq" << si << " token " << t;
      // (Two logits an ulp apart may round to one log-prob, which the top-k
      // then orders by id: compared where the top two are apart.)
      if (s.top2_margin[t] > kTieGap) {
        EXPECT_EQ(s.argmax[t], s.top_k_ids[t * goldens_.top_k]) << "seq" << si << " token " << t;
      }
    }
  }
}

TEST_P(TargetOutputsGoldensTest, CpuEngineMatchesTransformers) {
  std::map<CaptureEncoding, std::vector<SeqOutputs>> runs;
  for (CaptureEncoding enc : {CaptureEncoding::kBf16, CaptureEncoding::kFp8E4m3}) {
    const std::string name = absl::StrCat(GetParam(), " probs ", std::string(EncodingName(enc)));
    const TargetOutputs spec = OutputsRequest(goldens_, enc);
    absl::StatusOr<std::vector<SeqOutputs>> ours = RunOutputsAlone(*loaded_.engine, goldens_, spec);
    ASSERT_TRUE(ours.ok()) << name << ": " << ours.status();
    const OutputsStats st = CompareOutputs(goldens_, *ours, spec);
    const std::string where =
        absl::StrCat(name, ": ", Summary(st), "\n  ", absl::StrJoin(st.examples, "\n  "));
    std::cout << "cpu  " << name << ": " << Summary(st) << "\n";
    EXPECT_EQ(st.tokens, goldens_.tokens()) << where;
    EXPECT_EQ(st.malformed, 0) << where;
    EXPECT_EQ(st.argmax_mismatch, 0) << where;
    EXPECT_EQ(st.topk_id_failures, 0) << where;
    EXPECT_LE(Quantile(st.logprob_err, 1.0), kLogprobTol) << where;
    EXPECT_EQ(st.encoding_failures, 0) << where;
    const std::vector<double> tv = enc == CaptureEncoding::kFp8E4m3 ? st.TvExcess() : st.tv;
    EXPECT_LE(Quantile(tv, 0.5), kTvMedian) << where;
    EXPECT_LE(Quantile(tv, 0.99), kTvP99) << where;
    runs[enc] = *std::move(ours);
  }
  // The probs' encoding changes nothing else.
  const std::vector<SeqOutputs>& a = runs[CaptureEncoding::kBf16];
  const std::vector<SeqOutputs>& b = runs[CaptureEncoding::kFp8E4m3];
  for (size_t si = 0; si < a.size(); ++si) {
    for (size_t t = 0; t < a[si].size(); ++t) {
      EXPECT_EQ(a[si][t].argmax, b[si][t].argmax) << "seq" << si << " token " << t;
      EXPECT_EQ(a[si][t].top_ids, b[si][t].top_ids) << "seq" << si << " token " << t;
      EXPECT_EQ(a[si][t].top_logprobs, b[si][t].top_logprobs) << "seq" << si << " token " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, TargetOutputsGoldensTest,
                         ::testing::Values("qwen35_text", "qwen35_mm", "qwen3", "qwen35_moe",
                                           "qwen3_moe", "qwen35_text_fp8", "qwen3_fp8",
                                           "qwen35_moe_fp8", "qwen3_moe_fp8"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace draftfeed::testing
