#include "tests/server/model/golden_moe_routing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace draftfeed {
namespace {

// The mapping may be unaligned: copy instead of casting.
absl::StatusOr<std::vector<float>> ReadF32(const SafetensorsFile& f, const std::string& name,
                                           const std::vector<int64_t>& shape) {
  const SafetensorsTensor* t = f.Find(name);
  if (t == nullptr) return absl::NotFoundError(absl::StrCat(f.path(), ": no tensor ", name));
  if (t->dtype != "F32" || t->shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(), ": ", name, " is ", t->dtype, " [", absl::StrJoin(t->shape, ", "),
                     "], expected F32 [", absl::StrJoin(shape, ", "), "]"));
  }
  std::vector<float> out(t->nbytes / sizeof(float));
  std::memcpy(out.data(), t->data, t->nbytes);
  return out;
}

}  // namespace

absl::StatusOr<MoeGoldens> LoadMoeGoldens(const SafetensorsFile& f, int64_t num_layers,
                                          const std::vector<int64_t>& seq_lens) {
  const std::map<std::string, std::string>& md = f.metadata();
  MoeGoldens g;
  if (!md.contains("num_experts")) return g;
  if (!md.contains("num_experts_per_tok") || !md.contains("mlp_types") ||
      !absl::SimpleAtoi(md.at("num_experts"), &g.experts) ||
      !absl::SimpleAtoi(md.at("num_experts_per_tok"), &g.top_k) || g.top_k >= g.experts) {
    return absl::InvalidArgumentError(
        absl::StrCat(f.path(), ": bad num_experts/num_experts_per_tok/mlp_types"));
  }
  g.mlp_types = absl::StrSplit(md.at("mlp_types"), ',');
  if (static_cast<int64_t>(g.mlp_types.size()) != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(f.path(), ": mlp_types has ", g.mlp_types.size(),
                                                   " entries for ", num_layers, " layers"));
  }
  for (size_t i = 0; i < seq_lens.size(); ++i) {
    const std::string p = absl::StrCat("seq", i, ".");
    const std::vector<int64_t> shape = {seq_lens[i], num_layers, g.experts};
    absl::StatusOr<std::vector<float>> fr = ReadF32(f, p + "fp32.router_logits", shape);
    absl::StatusOr<std::vector<float>> br = ReadF32(f, p + "bf16.router_logits", shape);
    if (!fr.ok()) return fr.status();
    if (!br.ok()) return br.status();
    g.fp32_router.push_back(*std::move(fr));
    g.bf16_router.push_back(*std::move(br));
  }
  return g;
}

NearTies FindNearTies(const MoeGoldens& g) {
  NearTies r;
  const int64_t n = static_cast<int64_t>(g.mlp_types.size()), e = g.experts;
  int64_t first_moe = -1;
  for (int64_t l = 0; l < n && first_moe < 0; ++l) {
    if (g.mlp_types[static_cast<size_t>(l)] == "moe") first_moe = l;
  }
  for (size_t si = 0; si < g.fp32_router.size(); ++si) {
    const std::vector<float>& fp32 = g.fp32_router[si];
    const std::vector<float>& bf16 = g.bf16_router[si];
    for (size_t t = 0; t * n * e < fp32.size(); ++t) {
      for (int64_t x = 0; x < e; ++x) {
        const size_t at = (t * n + first_moe) * e + x;
        r.tau = std::max(r.tau, 2.0 * std::abs(fp32[at] - bf16[at]));
      }
    }
  }
  for (const std::vector<float>& fp32 : g.fp32_router) {
    const size_t tokens = fp32.size() / static_cast<size_t>(n * e);
    std::vector<bool>& stable = r.stable.emplace_back(tokens, true);
    for (size_t t = 0; t < tokens; ++t) {
      for (int64_t l = 0; l < n; ++l) {
        if (g.mlp_types[static_cast<size_t>(l)] != "moe") continue;
        std::vector<float> z(fp32.begin() + (t * n + l) * e, fp32.begin() + (t * n + l + 1) * e);
        std::sort(z.begin(), z.end(), std::greater<float>());
        if (z[g.top_k - 1] - z[g.top_k] < r.tau) stable[t] = false;
      }
      ++r.total;
      if (!stable[t]) ++r.near_tie;
    }
  }
  return r;
}

}  // namespace draftfeed
