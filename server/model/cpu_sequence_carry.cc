// The CPU forward's chunked-prefill pieces: attention over a carried prefix
// and the conv tail handed on (the GDN state goes through the delta rule's
// initial/final state, in cpu_engine.cc).
#include <algorithm>
#include <utility>

#include "kernels/cpu/attention.h"
#include "server/model/cpu_forward.h"
#include "server/model/weight_layout.h"

namespace draftfeed {

void CpuForward::CarriedAttention(int64_t layer, const Batch& b, const Buffer& q, Buffer k,
                                  Buffer v, float scale, Buffer& o) const {
  const ModelConfig& c = rank_.config;
  const int64_t hd = c.head_dim, hq = c.num_heads, hkv = c.num_kv_heads;
  const int64_t row = hkv * hd;  // one token's K (or V)
  CpuSequenceCarry::Layer& carried = b.carry->layers[static_cast<size_t>(layer)];
  const int64_t n = b.num_seqs();
  const int64_t prefix = b.resume;
  // Keys of the whole batch, sequence 0's carried ones first: rows
  // [0, prefix) are the carry's, then the batch's own in order.
  if (prefix > 0) {
    Buffer all_k(static_cast<size_t>((prefix + b.tokens) * row));
    Buffer all_v(all_k.size());
    std::copy(carried.k.begin(), carried.k.end(), all_k.begin());
    std::copy(carried.v.begin(), carried.v.end(), all_v.begin());
    std::copy(k.begin(), k.end(), all_k.begin() + prefix * row);
    std::copy(v.begin(), v.end(), all_v.begin() + prefix * row);
    k = std::move(all_k);
    v = std::move(all_v);
  }
  std::vector<int32_t> cu_k(b.cu.size());
  cu_k[0] = 0;
  for (size_t s = 1; s < b.cu.size(); ++s) cu_k[s] = b.cu[s] + static_cast<int32_t>(prefix);
  cpu::VarlenCausalAttention(q.data(), k.data(), v.data(), b.cu.data(), cu_k.data(), n, hq, hkv,
                             hd, scale, o.data(), threads_);
  if (!b.carry_last) {
    carried.k.clear();
    carried.v.clear();
    return;
  }
  // The last sequence's keys: all of them when it is the resumed one.
  const int64_t first = cu_k[static_cast<size_t>(n - 1)];
  const int64_t last = cu_k[static_cast<size_t>(n)];
  if (first == 0) {
    k.resize(static_cast<size_t>(last * row));
    v.resize(static_cast<size_t>(last * row));
    carried.k = std::move(k);
    carried.v = std::move(v);
  } else {
    carried.k.assign(k.begin() + first * row, k.begin() + last * row);
    carried.v.assign(v.begin() + first * row, v.begin() + last * row);
  }
}

CpuForward::Buffer CpuForward::CarriedConvTail(const Batch& b, const Buffer& x, int64_t channels,
                                               int64_t kernel, const Buffer& old_tail) {
  const int64_t n = b.num_seqs();
  const int64_t begin = b.cu[static_cast<size_t>(n - 1)];
  const int64_t end = b.cu[static_cast<size_t>(n)];
  const bool resumed = n == 1 && b.resume > 0;
  Buffer tail(static_cast<size_t>((kernel - 1) * channels), 0.0f);
  for (int64_t r = 0; r < kernel - 1; ++r) {
    const int64_t src = end - (kernel - 1) + r;  // a token index, maybe before `begin`
    float* dst = tail.data() + r * channels;
    if (src >= begin) {
      std::copy_n(x.data() + src * channels, channels, dst);
    } else if (resumed) {
      // The old tail's row kernel − 1 + (src − begin) is that token.
      std::copy_n(old_tail.data() + (kernel - 1 + src - begin) * channels, channels, dst);
    }  // else before the sequence's start: zeros
  }
  return tail;
}

int64_t CpuSequenceCarryBytes(const ModelConfig& c, int64_t tokens) {
  int64_t floats = 0;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    switch (BlocksOfLayer(c, i).mixer) {
      case BlockKind::kAttention:
        floats += 2 * tokens * c.num_kv_heads * c.head_dim;
        break;
      case BlockKind::kGatedDeltaNet:
        floats += (c.linear_conv_kernel - 1) *
                      (2 * c.linear_num_key_heads * c.linear_key_head_dim +
                       c.linear_num_value_heads * c.linear_value_head_dim) +
                  c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
        break;
      default:
        break;
    }
  }
  return floats * static_cast<int64_t>(sizeof(float));
}

}  // namespace draftfeed
