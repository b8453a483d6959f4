// The harness of the kernel batch-invariance tests (kernel_batch_invariance_*
// _cuda_test.cc): one sequence's rows computed alone against the same rows
// inside packed batches, bit for bit. Two sequences are followed, a long one
// of 1,500 tokens (not a multiple of the 64/128-row tiles) and a short one of
// 37, each first, in the middle and last of batches of 5,200 and 20,000
// tokens packed with other sequences, at offsets that are no multiple of a
// tile either. Inputs are made on the device (random_init.cuh): each input
// tensor's long and short rows once, and per batch the other rows from
// another seed with the two sequences' rows copied in.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/random_init.cuh"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::testing::batch_invariance {

inline constexpr int32_t kLongLen = 1500;
inline constexpr int32_t kShortLen = 37;

// A batch's sequence lengths and where the two followed sequences sit in it
// (-1: absent).
struct Layout {
  std::string name;
  std::vector<int32_t> lens;
  int long_index = -1, short_index = -1;
};

// The two sequences alone, then six packed batches: the long one first (the
// short one last), in the middle (the short one also inside), last (the short
// one first), at 5,200 and 20,000 tokens.
inline std::vector<Layout> AloneLayouts() {
  return {{"long alone", {kLongLen}, 0, -1}, {"short alone", {kShortLen}, -1, 0}};
}
inline std::vector<Layout> PackedLayouts() {
  return {
      {"long first of 5200", {kLongLen, 3663, kShortLen}, 0, 2},
      {"long middle of 5200", {1804, kLongLen, 900, kShortLen, 959}, 1, 3},
      {"long last of 5200", {kShortLen, 3663, kLongLen}, 2, 0},
      {"long first of 20000", {kLongLen, 7000, 11463, kShortLen}, 0, 3},
      {"long middle of 20000", {6001, kLongLen, 5000, kShortLen, 7462}, 1, 3},
      {"long last of 20000", {kShortLen, 9000, 9463, kLongLen}, 3, 0},
  };
}
inline constexpr int64_t kMaxTokens = 20000;

// One batch as a kernel call sees it.
struct Batch {
  const Layout* layout = nullptr;
  std::vector<int32_t> cu;  // host cu_seqlens, [num_seqs + 1]
  const int32_t* cu_dev = nullptr;
  int64_t tokens = 0;
  int32_t num_seqs = 0;
  int32_t max_seqlen = 0;
  int64_t long_at = -1, short_at = -1;  // first row of each followed sequence
};

// A per-token input tensor: row_elems values a token, bf16 or fp32, uniform
// with this scale and offset (random_init.cuh).
struct InputSpec {
  int64_t row_elems;
  bool f32 = false;
  float scale = 1.0f;
  float offset = 0.0f;
};

// A per-token output: row_bytes a token; read(first, n) returns rows
// [first, first + n) as bytes, n·row_bytes.
struct Output {
  std::string name;
  int64_t row_bytes;
  std::function<std::vector<uint8_t>(int64_t, int64_t)> read;
};

// A dense [T, row_bytes] output at base.
inline Output DenseOutput(std::string name, const void* base, int64_t row_bytes) {
  return {std::move(name), row_bytes, [base, row_bytes](int64_t first, int64_t n) {
            std::vector<uint8_t> h(static_cast<size_t>(n * row_bytes));
            EXPECT_EQ(cudaMemcpy(h.data(), static_cast<const char*>(base) + first * row_bytes,
                                 h.size(), cudaMemcpyDeviceToHost),
                      cudaSuccess);
            return h;
          }};
}

// row_bytes at byte `offset` of each token's row_pitch-byte row.
inline Output PitchedOutput(std::string name, const void* base, int64_t row_pitch, int64_t offset,
                            int64_t row_bytes) {
  return {std::move(name), row_bytes, [=](int64_t first, int64_t n) {
            std::vector<uint8_t> h(static_cast<size_t>(n * row_bytes));
            EXPECT_EQ(cudaMemcpy2D(h.data(), row_bytes,
                                   static_cast<const char*>(base) + first * row_pitch + offset,
                                   row_pitch, row_bytes, n, cudaMemcpyDeviceToHost),
                      cudaSuccess);
            return h;
          }};
}

#define DF_EXPECT_OK(expr) EXPECT_EQ((expr), cudaSuccess) << #expr

// The inputs' device copies: each spec's long and short rows, and a packed
// buffer of kMaxTokens rows.
class Inputs {
 public:
  explicit Inputs(const std::vector<InputSpec>& specs) : specs_(specs) {
    for (size_t i = 0; i < specs.size(); ++i) {
      const size_t row = RowBytes(i);
      lng_.push_back(std::make_unique<DeviceBuffer<uint8_t>>(row * kLongLen));
      shrt_.push_back(std::make_unique<DeviceBuffer<uint8_t>>(row * kShortLen));
      packed_.push_back(std::make_unique<DeviceBuffer<uint8_t>>(row * kMaxTokens));
      DF_EXPECT_OK(Fill(i, lng_[i]->get(), kLongLen, 1000 + i));
      DF_EXPECT_OK(Fill(i, shrt_[i]->get(), kShortLen, 2000 + i));
    }
  }

  // Pointers to each input for `b`: the sequence's own buffer when it is
  // alone, else the packed buffer refilled for this layout.
  std::vector<void*> For(const Batch& b) {
    std::vector<void*> out;
    for (size_t i = 0; i < specs_.size(); ++i) {
      if (b.layout->lens.size() == 1) {
        out.push_back(b.long_at == 0 ? lng_[i]->get() : shrt_[i]->get());
        continue;
      }
      const size_t row = RowBytes(i);
      uint8_t* p = packed_[i]->get();
      DF_EXPECT_OK(Fill(i, p, b.tokens, 3000 + i));
      DF_EXPECT_OK(cudaMemcpy(p + b.long_at * row, lng_[i]->get(), row * kLongLen,
                              cudaMemcpyDeviceToDevice));
      DF_EXPECT_OK(cudaMemcpy(p + b.short_at * row, shrt_[i]->get(), row * kShortLen,
                              cudaMemcpyDeviceToDevice));
      out.push_back(p);
    }
    return out;
  }

 private:
  size_t RowBytes(size_t i) const { return specs_[i].row_elems * (specs_[i].f32 ? 4 : 2); }
  cudaError_t Fill(size_t i, void* p, int64_t rows, uint64_t seed) const {
    const InputSpec& s = specs_[i];
    const int64_t n = rows * s.row_elems;
    return s.f32 ? cuda::FillRandomF32(static_cast<float*>(p), n, seed, s.scale, s.offset, nullptr)
                 : cuda::FillRandomBf16(static_cast<cuda::bf16*>(p), n, seed, s.scale, s.offset,
                                        nullptr);
  }

  std::vector<InputSpec> specs_;
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> lng_, shrt_, packed_;
};

// Computes a batch's outputs from its inputs (one pointer per InputSpec).
using RunFn = std::function<std::vector<Output>(const Batch&, const std::vector<void*>&)>;

// Runs `run` on the two sequences alone, then on every packed layout, and
// expects each output's rows of both sequences to equal their alone bits.
// Prints, per case, output and sequence, how many rows differ.
inline void ExpectRowsDoNotDependOnTheBatch(const std::string& what,
                                            const std::vector<InputSpec>& specs, const RunFn& run) {
  Inputs inputs(specs);
  const std::vector<Layout> alone_layouts = AloneLayouts(), packed_layouts = PackedLayouts();
  DeviceBuffer<int32_t> cu_dev(16);
  auto make_batch = [&](const Layout& l) {
    Batch b;
    b.layout = &l;
    b.cu = {0};
    for (int32_t len : l.lens) b.cu.push_back(b.cu.back() + len);
    cu_dev.Upload(b.cu);
    b.cu_dev = cu_dev.get();
    b.tokens = b.cu.back();
    b.num_seqs = static_cast<int32_t>(l.lens.size());
    b.max_seqlen = *std::max_element(l.lens.begin(), l.lens.end());
    b.long_at = l.long_index >= 0 ? b.cu[l.long_index] : -1;
    b.short_at = l.short_index >= 0 ? b.cu[l.short_index] : -1;
    return b;
  };
  auto compute = [&](const Batch& b) {
    std::vector<Output> outs = run(b, inputs.For(b));
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what << ", " << b.layout->name;
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << what << ", " << b.layout->name;
    return outs;
  };
  // alone[o][0]: output o's rows of the long sequence alone; [1]: the short.
  std::vector<std::vector<std::vector<uint8_t>>> alone;
  for (const Layout& l : alone_layouts) {
    const Batch b = make_batch(l);
    std::vector<Output> outs = compute(b);
    if (::testing::Test::HasFailure()) return;
    if (alone.empty()) alone.resize(outs.size());
    for (size_t o = 0; o < outs.size(); ++o) alone[o].push_back(outs[o].read(0, b.tokens));
  }
  for (const Layout& l : packed_layouts) {
    const Batch b = make_batch(l);
    std::vector<Output> outs = compute(b);
    if (::testing::Test::HasFailure()) return;
    ASSERT_EQ(outs.size(), alone.size());
    for (size_t o = 0; o < outs.size(); ++o) {
      const int64_t rb = outs[o].row_bytes;
      for (int s = 0; s < 2; ++s) {
        const int64_t at = s == 0 ? b.long_at : b.short_at;
        const int64_t n = s == 0 ? kLongLen : kShortLen;
        const std::vector<uint8_t> got = outs[o].read(at, n);
        int64_t differing = 0, first = -1;
        for (int64_t r = 0; r < n; ++r) {
          if (std::memcmp(got.data() + r * rb, alone[o][s].data() + r * rb,
                          static_cast<size_t>(rb)) != 0) {
            if (first < 0) first = r;
            ++differing;
          }
        }
        std::printf("%s, %s: %s of the %s sequence (%lld rows at %lld): %lld rows differ",
                    what.c_str(), l.name.c_str(), outs[o].name.c_str(), s == 0 ? "long" : "short",
                    static_cast<long long>(n), static_cast<long long>(at),
                    static_cast<long long>(differing));
        if (first >= 0) std::printf(" (first: row %lld)", static_cast<long long>(first));
        std::printf("\n");
        EXPECT_EQ(differing, 0) << what << ", " << l.name << ", " << outs[o].name << ", "
                                << (s == 0 ? "long" : "short") << " sequence";
      }
    }
  }
}

}  // namespace draftfeed::testing::batch_invariance
