#include "kernels/cpu/gdn.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/dot.h"
#include "kernels/cpu/parallel.h"

namespace draftfeed::cpu {
namespace {

// y += a·x over n elements.
void Axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// Where one (sequence, value head) pair's operands live.
struct HeadView {
  const DeltaRuleArgs& a;
  int64_t vh, kh;
  const float* q(int64_t t) const { return a.q + t * a.q_stride + kh * a.key_dim; }
  const float* k(int64_t t) const { return a.k + t * a.k_stride + kh * a.key_dim; }
  const float* v(int64_t t) const { return a.v + t * a.v_stride + vh * a.value_dim; }
  float g(int64_t t) const { return a.g[t * a.num_v_heads + vh]; }
  float beta(int64_t t) const { return a.beta[t * a.num_v_heads + vh]; }
  float* o(int64_t t) const { return a.o + (t * a.num_v_heads + vh) * a.value_dim; }
};

HeadView MakeView(const DeltaRuleArgs& a, int64_t vh) {
  return HeadView{a, vh, vh / (a.num_v_heads / a.num_k_heads)};
}

// The state one (sequence, value head) starts from, and where its last one
// goes (null: dropped): only sequence 0 starts from initial_state, only the
// last sequence writes final_state.
std::vector<float> InitialState(const HeadView& h, int64_t seq) {
  const size_t n = static_cast<size_t>(h.a.key_dim * h.a.value_dim);
  if (seq != 0 || h.a.initial_state == nullptr) return std::vector<float>(n, 0.0f);
  const float* src = h.a.initial_state + h.vh * static_cast<int64_t>(n);
  return std::vector<float>(src, src + n);
}
void StoreFinalState(const HeadView& h, int64_t seq, const std::vector<float>& state) {
  if (seq != h.a.num_seqs - 1 || h.a.final_state == nullptr) return;
  std::copy(state.begin(), state.end(), h.a.final_state + h.vh * static_cast<int64_t>(state.size()));
}

void RecurrentOne(const HeadView& h, int64_t seq, int64_t begin, int64_t end) {
  const int64_t dk = h.a.key_dim, dv = h.a.value_dim;
  std::vector<float> state = InitialState(h, seq);
  std::vector<float> delta(static_cast<size_t>(dv));
  for (int64_t t = begin; t < end; ++t) {
    const float alpha = std::exp(h.g(t));
    const float beta = h.beta(t);
    const float* kt = h.k(t);
    const float* qt = h.q(t);
    const float* vt = h.v(t);
    for (float& s : state) s *= alpha;
    // delta = β(v − Sᵀk): Sᵀk accumulated row by row of S.
    std::fill(delta.begin(), delta.end(), 0.0f);
    for (int64_t i = 0; i < dk; ++i) Axpy(kt[i], &state[i * dv], delta.data(), dv);
    for (int64_t d = 0; d < dv; ++d) delta[d] = (vt[d] - delta[d]) * beta;
    for (int64_t i = 0; i < dk; ++i) Axpy(kt[i], delta.data(), &state[i * dv], dv);
    float* ot = h.o(t);
    std::fill(ot, ot + dv, 0.0f);
    for (int64_t i = 0; i < dk; ++i) Axpy(qt[i], &state[i * dv], ot, dv);
  }
  StoreFinalState(h, seq, state);
}

// One (sequence, value head) in chunks, as transformers' torch_chunk_gated_delta_rule
// computes it (steps 1–7 below, per chunk of at most `chunk` tokens).
void ChunkedOne(const HeadView& h, int64_t seq, int64_t begin, int64_t end, int64_t chunk) {
  const int64_t dk = h.a.key_dim, dv = h.a.value_dim;
  std::vector<float> state = InitialState(h, seq);
  std::vector<float> gam(static_cast<size_t>(chunk));
  std::vector<float> decay(static_cast<size_t>(chunk * chunk));  // Γ, lower triangle
  std::vector<float> u(static_cast<size_t>(chunk * dv));         // U, then V_new
  std::vector<float> w(static_cast<size_t>(chunk * dk));         // W
  std::vector<float> kk(static_cast<size_t>(chunk * chunk));     // k_r·k_s, lower triangle
  for (int64_t c0 = begin; c0 < end; c0 += chunk) {
    const int64_t n = std::min(chunk, end - c0);
    // 1. inclusive cumulative log-decay, restarting every chunk.
    float acc = 0.0f;
    for (int64_t r = 0; r < n; ++r) gam[r] = acc += h.g(c0 + r);
    // 2. Γ_rs = exp(γ_r − γ_s), only for s ≤ r (the difference is ≤ 0).
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t s = 0; s <= r; ++s) decay[r * chunk + s] = std::exp(gam[r] - gam[s]);
      for (int64_t s = 0; s <= r; ++s) kk[r * chunk + s] = Dot(h.k(c0 + r), h.k(c0 + s), dk);
    }
    // 3–5. (I + A)·U = diag(β)V and (I + A)·W = diag(β)K̂ ⊙ exp(γ), with
    // A_rs = β_r (k_r·k_s) Γ_rs strictly lower: forward substitution.
    for (int64_t r = 0; r < n; ++r) {
      const float beta = h.beta(c0 + r);
      float* ur = &u[r * dv];
      float* wr = &w[r * dk];
      const float* vr = h.v(c0 + r);
      const float* kr = h.k(c0 + r);
      const float wscale = beta * std::exp(gam[r]);
      for (int64_t d = 0; d < dv; ++d) ur[d] = beta * vr[d];
      for (int64_t i = 0; i < dk; ++i) wr[i] = wscale * kr[i];
      for (int64_t s = 0; s < r; ++s) {
        const float a_rs = beta * kk[r * chunk + s] * decay[r * chunk + s];
        Axpy(-a_rs, &u[s * dv], ur, dv);
        Axpy(-a_rs, &w[s * dk], wr, dk);
      }
    }
    // 6. V_new = U − W·S (in place in u), then
    //    O = (Q̂ ⊙ exp(γ))·S + ((Q̂K̂ᵀ) ⊙ Γ)·V_new, Γ with its diagonal.
    for (int64_t r = 0; r < n; ++r) {
      float* ur = &u[r * dv];
      const float* wr = &w[r * dk];
      for (int64_t i = 0; i < dk; ++i) Axpy(-wr[i], &state[i * dv], ur, dv);
    }
    for (int64_t r = 0; r < n; ++r) {
      const float* qr = h.q(c0 + r);
      float* orow = h.o(c0 + r);
      std::fill(orow, orow + dv, 0.0f);
      for (int64_t i = 0; i < dk; ++i) Axpy(qr[i], &state[i * dv], orow, dv);
      const float inter = std::exp(gam[r]);
      for (int64_t d = 0; d < dv; ++d) orow[d] *= inter;
      for (int64_t s = 0; s <= r; ++s) {
        const float coef = Dot(qr, h.k(c0 + s), dk) * decay[r * chunk + s];
        Axpy(coef, &u[s * dv], orow, dv);
      }
    }
    // 7. S ← exp(γ_last)·S + Σ_r exp(γ_last − γ_r)·k_r ⊗ V_new_r.
    const float last = gam[n - 1];
    const float carry = std::exp(last);
    for (float& s : state) s *= carry;
    for (int64_t r = 0; r < n; ++r) {
      const float f = std::exp(last - gam[r]);
      const float* kr = h.k(c0 + r);
      const float* ur = &u[r * dv];
      for (int64_t i = 0; i < dk; ++i) Axpy(f * kr[i], ur, &state[i * dv], dv);
    }
  }
  StoreFinalState(h, seq, state);
}

template <typename Fn>
void ForEachSeqHead(const DeltaRuleArgs& a, int num_threads, Fn fn) {
  ParallelFor(a.num_seqs * a.num_v_heads, num_threads, [&](int64_t item) {
    const int64_t s = item / a.num_v_heads;
    fn(MakeView(a, item % a.num_v_heads), s, a.cu_seqlens[s], a.cu_seqlens[s + 1]);
  });
}

}  // namespace

void CausalConv1dSilu(const float* x, const float* w, const int32_t* cu_seqlens, int64_t num_seqs,
                      int64_t channels, int64_t kernel, float* y, const float* x_prefix) {
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
    const float* prefix = s == 0 ? x_prefix : nullptr;
    for (int64_t t = begin; t < end; ++t) {
      float* yt = y + t * channels;
      std::fill(yt, yt + channels, 0.0f);
      for (int64_t i = 0; i < kernel; ++i) {
        const int64_t src = t - (kernel - 1) + i;
        if (src < begin && prefix == nullptr) continue;
        // Prefix row kernel − 1 + (src − begin) is the token src − begin
        // places before the sequence's first here.
        const float* xs =
            src < begin ? prefix + (kernel - 1 + src - begin) * channels : x + src * channels;
        for (int64_t c = 0; c < channels; ++c) yt[c] += w[c * kernel + i] * xs[c];
      }
      for (int64_t c = 0; c < channels; ++c) yt[c] = Silu(yt[c]);
    }
  }
}

void L2NormHeads(float* x, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                 int64_t token_stride, float eps, float scale) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < num_heads; ++h) {
      float* row = x + t * token_stride + h * head_dim;
      double sum = 0.0;
      for (int64_t d = 0; d < head_dim; ++d) sum += static_cast<double>(row[d]) * row[d];
      const float inv = 1.0f / std::sqrt(static_cast<float>(sum) + eps);
      for (int64_t d = 0; d < head_dim; ++d) row[d] = (row[d] * inv) * scale;
    }
  }
}

void GdnGates(const float* a, const float* b, const float* a_log, const float* dt_bias,
              int64_t num_tokens, int64_t num_heads, float* g, float* beta) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t j = 0; j < num_heads; ++j) {
      const int64_t i = t * num_heads + j;
      const float x = a[i] + dt_bias[j];
      const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));
      g[i] = -std::exp(a_log[j]) * softplus;
      beta[i] = 1.0f / (1.0f + std::exp(-b[i]));
    }
  }
}

void GatedDeltaRuleRecurrent(const DeltaRuleArgs& args, int num_threads) {
  ForEachSeqHead(args, num_threads, [](const HeadView& h, int64_t seq, int64_t begin,
                                               int64_t end) {
    RecurrentOne(h, seq, begin, end);
  });
}

void GatedDeltaRuleChunked(const DeltaRuleArgs& args, int64_t chunk_size, int num_threads) {
  ForEachSeqHead(args, num_threads, [chunk_size](const HeadView& h, int64_t seq,
                                                       int64_t begin, int64_t end) {
    ChunkedOne(h, seq, begin, end, chunk_size);
  });
}

}  // namespace draftfeed::cpu
