#include "kernels/cpu/gemm.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace draftfeed::cpu {
namespace {

// Register tile kMr x kNr (12 AVX2 accumulators), panels of kKc along K, and
// work items of kMc x kNc so one packed W block (kKc*kNc floats = 256 KiB) sits
// in L2 while the X panels stream through L1.
constexpr int64_t kMr = 6;
constexpr int64_t kNr = 16;
constexpr int64_t kKc = 256;
constexpr int64_t kMc = 16 * kMr;
constexpr int64_t kNc = 16 * kNr;

// c[kMr][kNr] += a-panel · b-panel over kc steps. Padded lanes of the panels
// are zero, so every tile takes this same instruction sequence and the edge
// of the matrix rounds exactly like its interior. The accumulators are GNU
// vector types so they stay in registers (plain loops get vectorised across
// the wrong axis); the x86-64-v3 clone (AVX2 + FMA) is picked at load time
// when the CPU has it.
typedef float Vec8 __attribute__((vector_size(32), aligned(4)));
constexpr int64_t kVecs = kNr / 8;

// Not under TSan: it instruments the ifunc resolver that target_clones
// generates, which runs during relocation, before TSan's runtime is up (every
// TSan binary linking the kernels crashed at start-up).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
void MicroKernel(int64_t kc, const float* __restrict a, const float* __restrict b,
                 float* __restrict c) {
  Vec8 acc[kMr][kVecs];
  for (int64_t i = 0; i < kMr; ++i) {
    for (int64_t v = 0; v < kVecs; ++v)
      acc[i][v] = *reinterpret_cast<const Vec8*>(c + i * kNr + 8 * v);
  }
  for (int64_t p = 0; p < kc; ++p) {
    Vec8 bv[kVecs];
    for (int64_t v = 0; v < kVecs; ++v) bv[v] = *reinterpret_cast<const Vec8*>(b + p * kNr + 8 * v);
    const float* ap = a + p * kMr;
    for (int64_t i = 0; i < kMr; ++i) {
      const float av = ap[i];
      for (int64_t v = 0; v < kVecs; ++v) acc[i][v] += av * bv[v];
    }
  }
  for (int64_t i = 0; i < kMr; ++i) {
    for (int64_t v = 0; v < kVecs; ++v) *reinterpret_cast<Vec8*>(c + i * kNr + 8 * v) = acc[i][v];
  }
}

// Packs rows [r0, r0+rows) x cols [k0, k0+kc) of a row-major [*, ld] matrix
// into panels of `width` rows, each stored k-major ([kc][width]), zero-padded.
void PackPanels(const float* src, int64_t ld, int64_t r0, int64_t rows, int64_t k0, int64_t kc,
                int64_t width, float* dst) {
  for (int64_t pr = 0; pr < rows; pr += width) {
    const int64_t valid = std::min(width, rows - pr);
    float* panel = dst + pr * kc;
    for (int64_t i = 0; i < valid; ++i) {
      const float* row = src + (r0 + pr + i) * ld + k0;
      for (int64_t p = 0; p < kc; ++p) panel[p * width + i] = row[p];
    }
    for (int64_t i = valid; i < width; ++i) {
      for (int64_t p = 0; p < kc; ++p) panel[p * width + i] = 0.0f;
    }
  }
}

}  // namespace

void Gemm(const float* x, const float* w, float* y, int64_t m, int64_t n, int64_t k,
          int num_threads) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    std::fill(y, y + m * n, 0.0f);
    return;
  }
  const int64_t m_blocks = (m + kMc - 1) / kMc;
  const int64_t n_blocks = (n + kNc - 1) / kNc;
  ParallelFor(m_blocks * n_blocks, num_threads, [&](int64_t item) {
    // N-major item order: consecutive items share a W block across threads.
    const int64_t m0 = (item % m_blocks) * kMc;
    const int64_t n0 = (item / m_blocks) * kNc;
    const int64_t mc = std::min(kMc, m - m0);
    const int64_t nc = std::min(kNc, n - n0);
    const int64_t mc_pad = (mc + kMr - 1) / kMr * kMr;
    const int64_t nc_pad = (nc + kNr - 1) / kNr * kNr;
    thread_local std::vector<float> xpack, wpack;
    xpack.resize(static_cast<size_t>(kMc * kKc));
    wpack.resize(static_cast<size_t>(kNc * kKc));
    for (int64_t k0 = 0; k0 < k; k0 += kKc) {
      const int64_t kc = std::min(kKc, k - k0);
      PackPanels(w, k, n0, nc, k0, kc, kNr, wpack.data());
      PackPanels(x, k, m0, mc, k0, kc, kMr, xpack.data());
      for (int64_t jp = 0; jp < nc_pad; jp += kNr) {
        const int64_t nv = std::min(kNr, nc - jp);
        for (int64_t ip = 0; ip < mc_pad; ip += kMr) {
          const int64_t mv = std::min(kMr, mc - ip);
          float tile[kMr * kNr];
          if (k0 == 0) {
            std::fill(tile, tile + kMr * kNr, 0.0f);
          } else {
            for (int64_t i = 0; i < kMr; ++i) {
              for (int64_t j = 0; j < kNr; ++j) {
                tile[i * kNr + j] = (i < mv && j < nv) ? y[(m0 + ip + i) * n + n0 + jp + j] : 0.0f;
              }
            }
          }
          MicroKernel(kc, xpack.data() + ip * kc, wpack.data() + jp * kc, tile);
          for (int64_t i = 0; i < mv; ++i) {
            std::memcpy(y + (m0 + ip + i) * n + n0 + jp, tile + i * kNr,
                        static_cast<size_t>(nv) * sizeof(float));
          }
        }
      }
    }
  });
}

}  // namespace draftfeed::cpu
