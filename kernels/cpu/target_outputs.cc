#include "kernels/cpu/target_outputs.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace draftfeed::cpu {
namespace {

// Larger logit first, ties to the lower id: the order argmax and top-k share.
bool Before(const float* l, int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); }

}  // namespace

void TargetOutputsFromLogits(const float* logits, int64_t tokens, int64_t vocab,
                             const int32_t* draft, int64_t num_draft, int32_t top_k,
                             int32_t* argmax, int32_t* top_ids, float* top_logprobs, float* probs,
                             int threads) {
  ParallelFor(tokens, threads, [&](int64_t t) {
    const float* l = logits + t * vocab;
    if (argmax != nullptr) {
      int32_t best = 0;
      for (int32_t v = 1; v < vocab; ++v) {
        if (Before(l, v, best)) best = v;
      }
      argmax[t] = best;
    }
    if (top_k > 0) {
      float m = l[0];
      for (int64_t v = 1; v < vocab; ++v) m = std::max(m, l[v]);
      double sum = 0;  // double: the reference's own rounding stays far below fp32's
      for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(l[v]) - m);
      const double lse = m + std::log(sum);
      std::vector<int32_t> ids(static_cast<size_t>(vocab));
      std::iota(ids.begin(), ids.end(), 0);
      std::partial_sort(ids.begin(), ids.begin() + top_k, ids.end(),
                        [l](int32_t a, int32_t b) { return Before(l, a, b); });
      for (int32_t i = 0; i < top_k; ++i) {
        top_ids[t * top_k + i] = ids[static_cast<size_t>(i)];
        top_logprobs[t * top_k + i] = static_cast<float>(l[ids[static_cast<size_t>(i)]] - lse);
      }
    }
    if (probs != nullptr && num_draft > 0) {
      float md = l[draft[0]];
      for (int64_t j = 1; j < num_draft; ++j) md = std::max(md, l[draft[j]]);
      double sum = 0;
      for (int64_t j = 0; j < num_draft; ++j) sum += std::exp(static_cast<double>(l[draft[j]]) - md);
      float* p = probs + t * num_draft;
      for (int64_t j = 0; j < num_draft; ++j) {
        p[j] = static_cast<float>(std::exp(static_cast<double>(l[draft[j]]) - md) / sum);
      }
    }
  });
}

}  // namespace draftfeed::cpu
