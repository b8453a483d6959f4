#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/parallel.h"

namespace draftfeed::cpu {
namespace {

// Rows per work item: enough to amortise scheduling, small enough to balance
// the triangular cost across threads.
constexpr int64_t kRowsPerItem = 16;

struct RowBlock {
  int64_t begin, end;  // query tokens [begin, end)
  int64_t seq_begin;   // first token of their sequence
};

}  // namespace

void VarlenCausalAttention(const float* q, const float* k, const float* v,
                           const int32_t* cu_seqlens, int64_t num_seqs, int64_t num_q_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale, float* out,
                           int num_threads) {
  std::vector<RowBlock> blocks;
  int64_t longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t b = cu_seqlens[s], e = cu_seqlens[s + 1];
    longest = std::max(longest, e - b);
    for (int64_t r = b; r < e; r += kRowsPerItem)
      blocks.push_back({r, std::min(e, r + kRowsPerItem), b});
  }
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());
  ParallelFor(num_blocks * num_q_heads, num_threads, [&](int64_t item) {
    const RowBlock& blk = blocks[item % num_blocks];
    const int64_t h = item / num_blocks;
    const int64_t kvh = h / group;
    thread_local std::vector<float> p;
    p.resize(static_cast<size_t>(longest));
    for (int64_t t = blk.begin; t < blk.end; ++t) {
      const float* qt = q + (t * num_q_heads + h) * head_dim;
      const int64_t n = t - blk.seq_begin + 1;
      float max_score = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        const float* ku = k + ((blk.seq_begin + j) * num_kv_heads + kvh) * head_dim;
        p[j] = Dot(qt, ku, head_dim) * scale;
        max_score = std::max(max_score, p[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        p[j] = std::exp(p[j] - max_score);
        sum += p[j];
      }
      const float inv_sum = 1.0f / sum;
      float* o = out + (t * num_q_heads + h) * head_dim;
      std::fill(o, o + head_dim, 0.0f);
      for (int64_t j = 0; j < n; ++j) {
        const float pj = p[j] * inv_sum;
        const float* vu = v + ((blk.seq_begin + j) * num_kv_heads + kvh) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] += pj * vu[d];
      }
    }
  });
}

}  // namespace draftfeed::cpu
