#include "kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/swiglu.h"

namespace draftfeed::cpu {
namespace {

// Rows of one expert's tokens multiplied per work item: enough to fill the
// GEMM's register tiles, few enough that one hot expert still spreads over
// the threads.
constexpr int64_t kRowsPerItem = 64;

}  // namespace

void MoeRoute(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
              int32_t* expert_ids, float* weights) {
  std::vector<float> p(static_cast<size_t>(experts));
  std::vector<int32_t> order(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits + t * experts;
    const float max = *std::max_element(row, row + experts);
    float sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) {
      p[e] = std::exp(row[e] - max);
      sum += p[e];
    }
    for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float kept = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) kept += p[order[j]];
    for (int64_t j = 0; j < top_k; ++j) {
      expert_ids[t * top_k + j] = order[j];
      weights[t * top_k + j] = renormalize ? p[order[j]] / kept : p[order[j]];
    }
  }
}

void MoeExperts(const float* x, int64_t tokens, int64_t hidden, int64_t inter, const float* gate_up,
                const float* down, const int32_t* expert_ids, const float* weights, int64_t top_k,
                float* y, int num_threads) {
  const int64_t pairs = tokens * top_k;
  const int64_t num_experts =
      pairs <= 0 ? 0 : *std::max_element(expert_ids, expert_ids + pairs) + 1;
  MoeExpertRange(x, tokens, hidden, inter, gate_up, down, 0, num_experts, expert_ids, weights,
                 top_k, y, num_threads);
}

void MoeExpertRange(const float* x, int64_t tokens, int64_t hidden, int64_t inter,
                    const float* gate_up, const float* down, int64_t first_expert,
                    int64_t num_experts, const int32_t* expert_ids, const float* weights,
                    int64_t top_k, float* y, int num_threads) {
  const int64_t pairs = tokens * top_k;
  if (pairs <= 0) {
    std::fill(y, y + std::max<int64_t>(tokens, 0) * hidden, 0.0f);
    return;
  }
  auto in_range = [&](int64_t i) {
    return expert_ids[i] >= first_expert && expert_ids[i] < first_expert + num_experts;
  };

  // This range's pairs (token, slot) grouped by local expert, in pair order
  // inside a group (a counting sort): by_expert[start[e] .. start[e+1]) are
  // expert first_expert + e's.
  std::vector<int64_t> start(static_cast<size_t>(num_experts + 1), 0);
  for (int64_t i = 0; i < pairs; ++i) {
    if (in_range(i)) ++start[expert_ids[i] - first_expert + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> by_expert(static_cast<size_t>(start[num_experts]));
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < pairs; ++i) {
      if (in_range(i)) by_expert[fill[expert_ids[i] - first_expert]++] = i;
    }
  }

  // Work items: runs of up to kRowsPerItem pairs of one expert.
  struct Item {
    int64_t expert, begin, end;
  };
  std::vector<Item> items;
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t b = start[e]; b < start[e + 1]; b += kRowsPerItem) {
      items.push_back({e, b, std::min(b + kRowsPerItem, start[e + 1])});
    }
  }

  // expert_out[i]: the unweighted output of pair i, [pairs, hidden].
  std::vector<float> expert_out(static_cast<size_t>(pairs * hidden));
  ParallelFor(static_cast<int64_t>(items.size()), num_threads, [&](int64_t n) {
    const Item& item = items[n];
    const int64_t rows = item.end - item.begin;
    thread_local std::vector<float> xs, h, out;
    xs.resize(static_cast<size_t>(rows * hidden));
    h.resize(static_cast<size_t>(rows * 2 * inter));
    out.resize(static_cast<size_t>(rows * hidden));
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = by_expert[item.begin + r] / top_k;
      std::memcpy(xs.data() + r * hidden, x + token * hidden,
                  static_cast<size_t>(hidden) * sizeof(float));
    }
    Gemm(xs.data(), gate_up + item.expert * 2 * inter * hidden, h.data(), rows, 2 * inter, hidden,
         1);
    // The activations go to dense [rows, inter] rows at the front of h (Gemm
    // takes dense rows): row r's lands over rows already read (or, for row 0,
    // on its own gate, which SwiGlu allows).
    for (int64_t r = 0; r < rows; ++r) {
      float* row = h.data() + r * 2 * inter;
      SwiGlu(row, row + inter, inter, h.data() + r * inter);
    }
    Gemm(h.data(), down + item.expert * hidden * inter, out.data(), rows, hidden, inter, 1);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(expert_out.data() + by_expert[item.begin + r] * hidden, out.data() + r * hidden,
                  static_cast<size_t>(hidden) * sizeof(float));
    }
  });

  ParallelFor(tokens, num_threads, [&](int64_t t) {
    // This token's slots in ascending expert id (a stable sort keeps equal
    // ids in slot order).
    thread_local std::vector<int64_t> slots;
    slots.resize(static_cast<size_t>(top_k));
    std::iota(slots.begin(), slots.end(), t * top_k);
    std::stable_sort(slots.begin(), slots.end(),
                     [&](int64_t a, int64_t b) { return expert_ids[a] < expert_ids[b]; });
    float* yt = y + t * hidden;
    std::fill(yt, yt + hidden, 0.0f);
    for (int64_t i : slots) {
      if (!in_range(i)) continue;
      const float w = weights[i];
      const float* o = expert_out.data() + i * hidden;
      for (int64_t d = 0; d < hidden; ++d) yt[d] += o[d] * w;
    }
  });
}

}  // namespace draftfeed::cpu
