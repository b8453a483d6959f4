#include "tests/server/model/goldens.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "server/model/safetensors.h"
#include "tests/test_data_dir.h"

namespace draftfeed::testing {
namespace {

constexpr int kThreads = 2;

}  // namespace

absl::StatusOr<const SafetensorsTensor*> ExpectTensor(const SafetensorsFile& f,
                                                      const std::string& name,
                                                      const std::string& dtype,
                                                      const std::vector<int64_t>& shape) {
  const SafetensorsTensor* t = f.Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat(f.path(), ": no tensor ", name));
  if (t->dtype != dtype || t->shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": ", name, " is ", t->dtype, " [",
                                                   absl::StrJoin(t->shape, ", "), "], expected ",
                                                   dtype, " [", absl::StrJoin(shape, ", "), "]"));
  }
  return t;
}

std::filesystem::path DataDir() { return TestDataDir(); }

std::vector<float> Layer(const std::vector<float>& buf, int64_t tokens, int64_t k_total, int64_t k,
                         int64_t h) {
  std::vector<float> out(static_cast<size_t>(tokens * h));
  for (int64_t t = 0; t < tokens; ++t) {
    std::copy_n(buf.begin() + (t * k_total + k) * h, h, out.begin() + t * h);
  }
  return out;
}

absl::StatusOr<Goldens> LoadGoldens(const std::string& model) {
  absl::StatusOr<SafetensorsFile> f =
      SafetensorsFile::Open((DataDir() / absl::StrCat("goldens_", model, ".safetensors")).string());
  if (!f.ok()) return f.status();
  const std::map<std::string, std::string>& md = f->metadata();
  for (const char* key : {"num_layers", "hidden_size", "seq_lens", "layer_types"}) {
    if (!md.contains(key)) return absl::NotFoundError(absl::StrCat(f->path(), ": no ", key));
  }
  Goldens g;
  if (!absl::SimpleAtoi(md.at("num_layers"), &g.num_layers) ||
      !absl::SimpleAtoi(md.at("hidden_size"), &g.hidden)) {
    return absl::InvalidArgumentError(absl::StrCat(f->path(), ": bad num_layers/hidden_size"));
  }
  g.layer_types = absl::StrSplit(md.at("layer_types"), ',');
  const int64_t n = g.num_layers, h = g.hidden;
  std::vector<int64_t> seq_lens;
  int i = 0;
  for (absl::string_view len_text : absl::StrSplit(md.at("seq_lens"), ',')) {
    int64_t len = 0;
    if (!absl::SimpleAtoi(len_text, &len)) {
      return absl::InvalidArgumentError(absl::StrCat(f->path(), ": bad seq_lens"));
    }
    seq_lens.push_back(len);
    const std::string p = absl::StrCat("seq", i++, ".");
    GoldenSeq s;
    auto ids = ReadTensor<int32_t>(*f, p + "input_ids", "I32", {len});
    auto fl = ReadTensor<float>(*f, p + "fp32.layer_out", "F32", {len, n, h});
    auto ff = ReadTensor<float>(*f, p + "fp32.final", "F32", {len, h});
    auto bl = ReadTensor<float>(*f, p + "bf16.layer_out", "F32", {len, n, h});
    auto bf = ReadTensor<float>(*f, p + "bf16.final", "F32", {len, h});
    for (const absl::Status& st :
         {ids.status(), fl.status(), ff.status(), bl.status(), bf.status()}) {
      if (!st.ok()) return st;
    }
    s.ids = *std::move(ids);
    s.fp32_layers = *std::move(fl);
    s.fp32_final = *std::move(ff);
    s.bf16_layers = *std::move(bl);
    s.bf16_final = *std::move(bf);
    g.seqs.push_back(std::move(s));
  }
  absl::StatusOr<MoeGoldens> moe = LoadMoeGoldens(*f, n, seq_lens);
  if (!moe.ok()) return moe.status();
  g.moe = *std::move(moe);
  return g;
}

Err Compare(const std::vector<float>& ours, const std::vector<float>& ref, int64_t h,
            const std::vector<bool>& keep) {
  Err e;
  double sq_diff = 0, sq_ref = 0;
  for (size_t t = 0; t * h < ref.size(); ++t) {
    if (!keep.empty() && !keep[t]) continue;
    double dot = 0, nn_ours = 0, nn_ref = 0;
    for (int64_t i = 0; i < h; ++i) {
      const double a = ours[t * h + i], b = ref[t * h + i];
      e.finite = e.finite && std::isfinite(a);
      e.max_abs = std::max(e.max_abs, std::abs(a - b));
      e.max_ref = std::max(e.max_ref, std::abs(b));
      sq_diff += (a - b) * (a - b);
      sq_ref += b * b;
      dot += a * b;
      nn_ours += a * a;
      nn_ref += b * b;
    }
    e.min_cos = std::min(e.min_cos, dot / std::sqrt(nn_ours * nn_ref));
  }
  e.max_rel = e.max_abs / e.max_ref;
  e.rms_rel = std::sqrt(sq_diff / sq_ref);
  return e;
}

std::string Describe(const Err& e) {
  return absl::StrFormat("%smax|d| %.3e  max|ref| %.3e  max_rel %.3e  rms_rel %.3e  min_cos %.9f",
                         e.finite ? "" : "NON-FINITE VALUES  ", e.max_abs, e.max_ref, e.max_rel,
                         e.rms_rel, e.min_cos);
}

absl::StatusOr<Loaded> LoadWithEngine(const std::string& dir) {
  Loaded l;
  absl::StatusOr<std::unique_ptr<Model>> m = LoadModel(dir);
  if (!m.ok()) return m.status();
  l.model = *std::move(m);
  absl::StatusOr<std::unique_ptr<CpuEngine>> e = CpuEngine::Create(l.model.get(), kThreads);
  if (!e.ok()) return e.status();
  l.engine = *std::move(e);
  return l;
}

std::vector<int32_t> AllLayers(int64_t num_layers) {
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < num_layers; ++i) ids.push_back(i);
  ids.push_back(kFinalLayerId);
  return ids;
}

absl::StatusOr<std::vector<float>> RunFloat(CpuEngine& engine, const std::vector<int32_t>& tokens,
                                            const std::vector<int32_t>& lens,
                                            const std::vector<int32_t>& layers) {
  std::vector<float> out(tokens.size() * layers.size() *
                         static_cast<size_t>(engine.model().config.hidden_size));
  absl::Status st = engine.ForwardFloat({tokens, lens, layers}, out);
  if (!st.ok()) return st;
  return out;
}

absl::StatusOr<std::vector<AloneAndPacked>> RunAloneAndPacked(
    Engine& engine, const std::vector<std::vector<int32_t>>& seqs,
    const std::vector<int32_t>& layers) {
  const size_t per_token = layers.size() * static_cast<size_t>(engine.model().config.hidden_size);
  auto widen = [](const std::vector<uint16_t>& bits, size_t begin, size_t n) {
    std::vector<float> out(n);
    for (size_t e = 0; e < n; ++e) out[e] = Bf16ToFloat(bits[begin + e]);
    return out;
  };
  std::vector<int32_t> all_tokens, all_lens;
  for (const std::vector<int32_t>& ids : seqs) {
    all_tokens.insert(all_tokens.end(), ids.begin(), ids.end());
    all_lens.push_back(static_cast<int32_t>(ids.size()));
  }
  std::vector<uint16_t> packed(all_tokens.size() * per_token);
  DF_RETURN_IF_ERROR(
      engine.Forward({all_tokens, all_lens, layers}, std::as_writable_bytes(std::span(packed))));
  std::vector<AloneAndPacked> out;
  size_t offset = 0;
  for (const std::vector<int32_t>& ids : seqs) {
    const std::vector<int32_t> lens = {static_cast<int32_t>(ids.size())};
    std::vector<uint16_t> bits(ids.size() * per_token);
    DF_RETURN_IF_ERROR(
        engine.Forward({ids, lens, layers}, std::as_writable_bytes(std::span(bits))));
    out.push_back({widen(bits, 0, bits.size()), widen(packed, offset, bits.size())});
    offset += bits.size();
  }
  return out;
}

NearTies ReportNearTies(const MoeGoldens& g, const std::string& what) {
  NearTies ties = FindNearTies(g);
  std::cout << what << ": " << ties.near_tie << " of " << ties.total
            << " tokens near-tie (fp32 top-k logit gap < tau = " << ties.tau
            << " at some MoE layer), compared on the other " << ties.total - ties.near_tie << "\n";
  return ties;
}

std::string KindName(LayerKind k) {
  return k == LayerKind::kLinearAttention ? "linear_attention" : "full_attention";
}

}  // namespace draftfeed::testing
