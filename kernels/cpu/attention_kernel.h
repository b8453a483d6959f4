// The blocked online-softmax kernel behind cpu::VarlenCausalAttention, for one
// SIMD width (internal to kernels/cpu: attention.cc instantiates it per
// instruction set and builds its work items).
//
// A lane block is kBq (query row, query head) lanes, the query heads of one
// KV head times a few rows, and SIMD lanes run across it, so each K/V block
// read serves every head of its GQA group. Every lane repeats the same scalar
// recipe for its own row and head (a sum over head dims in ascending order, a
// max, an exp, a sum over keys in ascending order) and no sum ever mixes two
// lanes: a row's bits cannot depend on which rows share its block or lane, nor
// on the SIMD width.
//
// Keys come in blocks of kBk from the SEQUENCE START, and a lane block holds
// rows whose positions share one key block, their diagonal one. So every row
// runs the online softmax over exactly the blocks 0..(its position / kBk), the
// last one masked at its position, whatever the batch or the split into calls:
// no block a row has no key in is ever applied to it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace draftfeed::cpu::attention_internal {

constexpr int64_t kBq = 32;  // lanes per lane block
constexpr int64_t kBk = 64;  // keys per key block

// A lane block: lane l holds row l / heads and query head head0 + l % heads
// (the item's); lanes from rows * heads on are padding. Its rows' positions
// share one key block.
struct LaneBlock {
  int64_t q_row;  // first query row in q/out
  int64_t pos;    // its position in the sequence
  int64_t rows;   // rows * heads <= kBq
};

// A work item: consecutive lane blocks of one sequence and query-head chunk,
// run key block by key block so that each K/V block, once read, serves all of
// them from cache (long sequences stream K/V from L3 or DRAM otherwise).
struct Item {
  int64_t k_row;           // the sequence's first key row in k/v
  int64_t kv_len;          // the sequence's keys
  int64_t block0, blocks;  // its lane blocks
  int64_t head0, heads;
  int64_t cost;  // Σ key blocks over its lane blocks
};

// What every item of one call shares.
struct Job {
  const float* q;
  const float* k;
  const float* v;
  float* out;
  const LaneBlock* lane_blocks;
  int64_t hq, hkv, hd, group;
  float scale2;  // scale · log2(e): scores in log2 units, so the exponentials are exp2's
};

// Scratch of one thread: per lane block qt, ot [hd][kBq], m, l [kBq]; then p
// [kBk][kBq] and a zero row [hd]; positions [blocks][kBq] apart.
inline int64_t StateFloats(int64_t hd) { return 2 * hd * kBq + 2 * kBq; }
inline int64_t WorkspaceFloats(int64_t hd, int64_t blocks) {
  return blocks * StateFloats(hd) + kBk * kBq + hd;
}

typedef float F4 __attribute__((vector_size(16), aligned(4)));
typedef int32_t I4 __attribute__((vector_size(16), aligned(4)));
typedef uint32_t U4 __attribute__((vector_size(16), aligned(4)));
typedef float F8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t I8 __attribute__((vector_size(32), aligned(4)));
typedef uint32_t U8 __attribute__((vector_size(32), aligned(4)));
typedef float F16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t I16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t U16 __attribute__((vector_size(64), aligned(4)));
template <int64_t W>
struct Lanes;
template <>
struct Lanes<4> {
  using F = F4;
  using I = I4;
  using U = U4;
};
template <>
struct Lanes<8> {
  using F = F8;
  using I = I8;
  using U = U8;
};
template <>
struct Lanes<16> {
  using F = F16;
  using I = I16;
  using U = U16;
};

// W floats per vector (one register of the instruction set it is built for),
// KT keys per score register tile and DT head dims per output register tile
// (KT·kBq/W and DT·kBq/W accumulators). GNU vector types rather than plain
// loops: the tiles stay in registers and the lanes run across rows, which
// auto-vectorisation does not reliably give. aligned(4): loads from any float.
template <int64_t W, int64_t KT, int64_t DT>
struct Kernel {
  using F = typename Lanes<W>::F;
  using I = typename Lanes<W>::I;
  using U = typename Lanes<W>::U;
  static constexpr int64_t kQv = kBq / W;  // vectors per lane block
  static_assert(kBq % W == 0 && kBk % KT == 0);

  [[gnu::always_inline]] static F& At(float* p) { return *reinterpret_cast<F*>(p); }
  [[gnu::always_inline]] static const F& At(const float* p) {
    return *reinterpret_cast<const F*>(p);
  }

  // 2^x in place for x <= 0 (or -inf, NaN), within ~2 ulp: x = n + f with n the
  // nearest integer and |f| <= 1/2, 2^f by its degree-7 Taylor polynomial (next
  // term (ln 2 / 2)^8 / 8! = 5e-9, below fp32's 6e-8 rounding), 2^n by building
  // the exponent field. Results below 2^-125 are 0, which keeps subnormals
  // (slow on x86) out of the sums; next to a row's largest weight, 1, they are
  // negligible. NaN stays NaN.
  [[gnu::always_inline]] static void Exp2InPlace(F& x) {
    constexpr double kLn2 = 0.69314718055994530942;
    constexpr double d2 = kLn2 * kLn2 / 2, d3 = d2 * kLn2 / 3, d4 = d3 * kLn2 / 4,
                     d5 = d4 * kLn2 / 5, d6 = d5 * kLn2 / 6, d7 = d6 * kLn2 / 7;
    // Adding 1.5·2^23 rounds to an integer (ulp 1 there) and leaves it in the
    // low mantissa bits: t's bit pattern is 0x4B400000 + n.
    const F magic = F{} + 12582912.0f;
    const F t = x + magic;
    const F f = x - (t - magic);
    F p = F{} + static_cast<float>(d7);
    p = p * f + static_cast<float>(d6);
    p = p * f + static_cast<float>(d5);
    p = p * f + static_cast<float>(d4);
    p = p * f + static_cast<float>(d3);
    p = p * f + static_cast<float>(d2);
    p = p * f + static_cast<float>(kLn2);
    p = p * f + 1.0f;
    const U two_n = ((__builtin_bit_cast(U, t) - 0x4B400000u) + 127u) << 23;
    const F r = p * __builtin_bit_cast(F, two_n);
    x = x < (F{} - 125.0f) ? F{} : r;
  }

  // s[j][lane] = (q_lane · k_j) · scale2 for the kBk keys krow[j].
  [[gnu::always_inline]] static void Scores(const float* __restrict qt, const float* const* krow,
                                            int64_t hd, float scale2, float* __restrict s) {
    for (int64_t j0 = 0; j0 < kBk; j0 += KT) {
      F acc[KT][kQv];
      for (int64_t u = 0; u < KT; ++u) {
        for (int64_t w = 0; w < kQv; ++w) acc[u][w] = F{};
      }
      const float* kr[KT];
      for (int64_t u = 0; u < KT; ++u) kr[u] = krow[j0 + u];
      for (int64_t d = 0; d < hd; ++d) {
        F qa[kQv];
        for (int64_t w = 0; w < kQv; ++w) qa[w] = At(qt + d * kBq + W * w);
        for (int64_t u = 0; u < KT; ++u) {
          const float kd = kr[u][d];
          for (int64_t w = 0; w < kQv; ++w) acc[u][w] += qa[w] * kd;
        }
      }
      for (int64_t u = 0; u < KT; ++u) {
        for (int64_t w = 0; w < kQv; ++w) At(s + (j0 + u) * kBq + W * w) = acc[u][w] * scale2;
      }
    }
  }

  // ot[d][lane] = ot[d][lane]·alpha[lane] + Σ_j p[j][lane]·v_j[d] over the
  // block's keys in ascending order, for the ND head dims from d0. Masked (the
  // diagonal block): key j is applied to a lane only where j <= its position,
  // so a key after it, whatever its value (inf, NaN), never reaches the row.
  template <int64_t ND, bool kMasked>
  [[gnu::always_inline]] static void OutputTile(float* __restrict ot, const float* __restrict p,
                                                const float* const* vrow, int64_t d0,
                                                const F* alpha, const I* pos, int64_t k0) {
    F acc[ND][kQv];
    for (int64_t u = 0; u < ND; ++u) {
      for (int64_t w = 0; w < kQv; ++w) acc[u][w] = At(ot + (d0 + u) * kBq + W * w) * alpha[w];
    }
    for (int64_t j = 0; j < kBk; ++j) {
      F pj[kQv];
      for (int64_t w = 0; w < kQv; ++w) pj[w] = At(p + j * kBq + W * w);
      const float* vr = vrow[j] + d0;
      if constexpr (kMasked) {
        I ok[kQv];
        for (int64_t w = 0; w < kQv; ++w) ok[w] = pos[w] >= (I{} + static_cast<int32_t>(k0 + j));
        for (int64_t u = 0; u < ND; ++u) {
          const float vd = vr[u];
          for (int64_t w = 0; w < kQv; ++w) acc[u][w] = ok[w] ? acc[u][w] + pj[w] * vd : acc[u][w];
        }
      } else {
        for (int64_t u = 0; u < ND; ++u) {
          const float vd = vr[u];
          for (int64_t w = 0; w < kQv; ++w) acc[u][w] += pj[w] * vd;
        }
      }
    }
    for (int64_t u = 0; u < ND; ++u) {
      for (int64_t w = 0; w < kQv; ++w) At(ot + (d0 + u) * kBq + W * w) = acc[u][w];
    }
  }

  template <bool kMasked>
  [[gnu::always_inline]] static void Output(float* ot, const float* p, const float* const* vrow,
                                            int64_t hd, const F* alpha, const I* pos, int64_t k0) {
    int64_t d0 = 0;
    for (; d0 + DT <= hd; d0 += DT) OutputTile<DT, kMasked>(ot, p, vrow, d0, alpha, pos, k0);
    for (; d0 < hd; ++d0) OutputTile<1, kMasked>(ot, p, vrow, d0, alpha, pos, k0);
  }

  // One key block (keys k0.. at krow/vrow, scores into p) applied to one lane block.
  [[gnu::always_inline]] static void Step(float* __restrict st, const int32_t* pos32,
                                          const float* const* krow, const float* const* vrow,
                                          int64_t k0, bool masked, int64_t hd, float scale2,
                                          float* __restrict p) {
    float* qt = st;
    float* ot = qt + hd * kBq;
    float* m = ot + hd * kBq;
    float* l = m + kBq;
    const I* pos = reinterpret_cast<const I*>(pos32);
    Scores(qt, krow, hd, scale2, p);
    F alpha[kQv];
    for (int64_t w = 0; w < kQv; ++w) {
      F m_new = At(m + W * w);
      for (int64_t j = 0; j < kBk; ++j) {
        F& s = At(p + j * kBq + W * w);
        if (masked) {
          const I ok = pos[w] >= (I{} + static_cast<int32_t>(k0 + j));
          s = ok ? s : F{} - std::numeric_limits<float>::infinity();
        }
        m_new = s > m_new ? s : m_new;
      }
      // Every row has a key in every block it runs (its own position in the
      // diagonal one), so m_new is finite and the first block's alpha is 0.
      alpha[w] = At(m + W * w) - m_new;
      Exp2InPlace(alpha[w]);
      F sum = At(l + W * w) * alpha[w];
      for (int64_t j = 0; j < kBk; ++j) {
        F& s = At(p + j * kBq + W * w);
        s -= m_new;
        Exp2InPlace(s);  // a masked key's -inf gives exactly 0, which leaves the sum as it is
        sum += s;
      }
      At(m + W * w) = m_new;
      At(l + W * w) = sum;
    }
    if (masked) {
      Output<true>(ot, p, vrow, hd, alpha, pos, k0);
    } else {
      Output<false>(ot, p, vrow, hd, alpha, pos, k0);
    }
  }

  [[gnu::always_inline]] static void Attend(const Job& job, const Item& it, float* __restrict ws,
                                            int32_t* __restrict ws_pos) {
    const int64_t hd = job.hd;
    const int64_t q_stride = job.hq * hd, kv_stride = job.hkv * hd;
    const int64_t kv_col = (it.head0 / job.group) * hd;
    const LaneBlock* lb = job.lane_blocks + it.block0;
    float* p = ws + it.blocks * StateFloats(hd);
    float* zero = p + kBk * kBq;
    std::fill(zero, zero + hd, 0.0f);
    for (int64_t x = 0; x < it.blocks; ++x) {
      float* qt = ws + x * StateFloats(hd);
      float* ot = qt + hd * kBq;
      float* m = ot + hd * kBq;
      float* l = m + kBq;
      int32_t* pos = ws_pos + x * kBq;
      const int64_t lanes = lb[x].rows * it.heads;
      // Padding lanes are zero queries: computed like the others, never written.
      for (int64_t i = 0; i < kBq; ++i) {
        const float* row = i < lanes ? job.q + (lb[x].q_row + i / it.heads) * q_stride +
                                           (it.head0 + i % it.heads) * hd
                                     : zero;
        for (int64_t d = 0; d < hd; ++d) qt[d * kBq + i] = row[d];
        pos[i] = static_cast<int32_t>(lb[x].pos + i / it.heads);
      }
      std::fill(ot, ot + hd * kBq, 0.0f);
      std::fill(m, m + kBq, -std::numeric_limits<float>::infinity());
      std::fill(l, l + kBq, 0.0f);
    }
    const float* krow[kBk];
    const float* vrow[kBk];
    const int64_t last = lb[it.blocks - 1].pos / kBk;  // positions ascend with the blocks
    for (int64_t b = 0, first = 0; b <= last; ++b) {
      const int64_t k0 = b * kBk;
      // Keys past the sequence's end (diagonal blocks only) are never read:
      // they point at the zero row, and the mask keeps them from every row.
      const int64_t nk = std::min(kBk, it.kv_len - k0);
      for (int64_t j = 0; j < kBk; ++j) {
        krow[j] = j < nk ? job.k + (it.k_row + k0 + j) * kv_stride + kv_col : zero;
        vrow[j] = j < nk ? job.v + (it.k_row + k0 + j) * kv_stride + kv_col : zero;
      }
      while (lb[first].pos / kBk < b) ++first;  // lane blocks done: b is past their diagonal
      for (int64_t x = first; x < it.blocks; ++x) {
        Step(ws + x * StateFloats(hd), ws_pos + x * kBq, krow, vrow, k0, b == lb[x].pos / kBk, hd,
             job.scale2, p);
      }
    }
    for (int64_t x = 0; x < it.blocks; ++x) {
      const float* ot = ws + x * StateFloats(hd) + hd * kBq;
      const float* l = ot + hd * kBq + kBq;
      float inv_l[kBq];
      for (int64_t w = 0; w < kQv; ++w) At(inv_l + W * w) = 1.0f / At(l + W * w);
      for (int64_t i = 0; i < lb[x].rows * it.heads; ++i) {
        float* o =
            job.out + (lb[x].q_row + i / it.heads) * q_stride + (it.head0 + i % it.heads) * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] = ot[d * kBq + i] * inv_l[i];
      }
    }
  }
};

}  // namespace draftfeed::cpu::attention_internal
