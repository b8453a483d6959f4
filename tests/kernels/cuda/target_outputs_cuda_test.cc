// The GPU target outputs against the CPU reference (kernels/cpu/
// target_outputs.h) encoded on the host as the wire does: argmax and top-k
// ids equal, top-k log-probs within 1e-5, bf16 probs within one bf16 ulp of
// the reference's rounding, e4m3 codes within one code and the scale within
// 1e-6 relative. Odd vocabularies and pitches (the unaligned load path),
// shuffled draft lists up to 65,536 ids, logits with ties everywhere, flat
// rows and ascending rows (the top-k threshold then rises at every step),
// outputs at odd offsets of odd row pitches, whose other bytes must stay
// untouched. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/fp8_capture.h"
#include "common/fp8_e4m3.h"
#include "common/target_outputs.h"
#include "kernels/cpu/target_outputs.h"
#include "kernels/target_outputs.cuh"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda {
namespace {

using ::draftfeed::testing::DeviceBuffer;

uint16_t RoundBf16(float f) {
  const uint32_t b = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}

struct Case {
  int64_t tokens, vocab;
  int64_t pitch_pad;   // logits_pitch = vocab + pitch_pad
  int64_t base_shift;  // the logits start this many floats into their buffer
  int64_t draft;
  int32_t top_k;
  bool fp8;
  bool argmax = true;
};

std::string Name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::ostringstream name;
  name << "T" << c.tokens << "_V" << c.vocab << "_pad" << c.pitch_pad << "_shift" << c.base_shift
       << "_D" << c.draft << "_k" << c.top_k << (c.fp8 ? "_fp8" : "_bf16")
       << (c.argmax ? "" : "_noargmax");
  return name.str();
}

// Row t by t % 4: normal logits; the same rounded to multiples of 0.5 (ties
// all through the top-k), with the maximum copied to three more ids; a flat
// row (every order a tie); an ascending row.
std::vector<float> MakeLogits(int64_t tokens, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> l(static_cast<size_t>(tokens * vocab));
  for (int64_t t = 0; t < tokens; ++t) {
    float* r = l.data() + t * vocab;
    switch (t % 4) {
      case 0:
        for (int64_t v = 0; v < vocab; ++v) r[v] = normal(rng);
        break;
      case 1: {
        for (int64_t v = 0; v < vocab; ++v) r[v] = std::round(2.0f * normal(rng)) / 2.0f;
        const float top = *std::max_element(r, r + vocab);
        for (int i = 0; i < 3; ++i) r[rng() % static_cast<uint64_t>(vocab)] = top;
        break;
      }
      case 2:
        for (int64_t v = 0; v < vocab; ++v) r[v] = 0.5f;
        break;
      case 3:
        for (int64_t v = 0; v < vocab; ++v) r[v] = -20.0f + 1e-3f * static_cast<float>(v);
        break;
    }
  }
  return l;
}

uint32_t ReadU32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

class TargetOutputsCudaTest : public ::testing::TestWithParam<Case> {};

TEST_P(TargetOutputsCudaTest, MatchesTheCpuReference) {
  DF_REQUIRE_GPU();
  const Case c = GetParam();
  const int64_t T = c.tokens, V = c.vocab, pitch = V + c.pitch_pad;
  const std::vector<float> logits = MakeLogits(T, V, 17 + T * 131 + V);
  std::vector<float> padded(static_cast<size_t>(c.base_shift + T * pitch), -1e30f);
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(logits.begin() + t * V, V, padded.begin() + c.base_shift + t * pitch);
  }
  std::vector<int32_t> all(static_cast<size_t>(V));
  std::iota(all.begin(), all.end(), 0);
  std::mt19937_64 rng(99 + c.draft);
  std::shuffle(all.begin(), all.end(), rng);
  const std::vector<int32_t> draft(all.begin(), all.begin() + c.draft);

  TargetOutputs asked;
  asked.argmax = c.argmax;
  asked.top_k = c.top_k;
  asked.draft_vocab = draft;
  asked.probs_encoding = c.fp8 ? CaptureEncoding::kFp8E4m3 : CaptureEncoding::kBf16;
  const TargetOutputsLayout lay = LayoutOf(asked);
  // An odd "hidden capture" before each token's outputs and a little after.
  const int64_t lead = 13, row = lead + lay.bytes + 3;
  auto at = [&](int64_t o) { return o < 0 ? int64_t{-1} : lead + o; };
  TargetOutputOffsets off;
  off.argmax = at(lay.argmax);
  off.top_k_ids = at(lay.top_k_ids);
  off.top_k_logprobs = at(lay.top_k_logprobs);
  off.probs_scale = at(lay.probs_scale);
  off.probs = at(lay.probs);
  off.probs_fp8 = c.fp8;

  DeviceBuffer<float> d_logits(padded);
  DeviceBuffer<int32_t> d_draft(draft);
  DeviceBuffer<uint8_t> d_index(DraftIndexBytes(V, c.draft));
  DeviceBuffer<uint8_t> d_out(std::vector<uint8_t>(static_cast<size_t>(T * row), 0xa5));
  if (c.draft > 0) DF_CUDA_OK(BuildDraftIndex(d_draft.get(), c.draft, V, d_index.get(), nullptr));
  DF_CUDA_OK(TargetOutputsFromLogits(d_logits.get() + c.base_shift, T, V, pitch,
                                     c.draft > 0 ? d_index.get() : nullptr, c.draft, c.top_k, off,
                                     d_out.get(), row, nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> got = d_out.Download();

  const int64_t k = c.top_k, vd = c.draft;
  std::vector<int32_t> argmax(static_cast<size_t>(T)), ids(static_cast<size_t>(T * k));
  std::vector<float> lps(static_cast<size_t>(T * k)), probs(static_cast<size_t>(T * vd));
  cpu::TargetOutputsFromLogits(logits.data(), T, V, draft.data(), vd, c.top_k, argmax.data(),
                               ids.data(), lps.data(), probs.data(), 0);

  int failures = 0;
  auto fail = [&]() -> bool { return ++failures <= 10; };
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* r = got.data() + t * row;
    for (int64_t b = 0; b < lead; ++b) {
      if (r[b] != 0xa5 && fail())
        ADD_FAILURE() << "token " << t << ": lead byte " << b << " written";
    }
    for (int64_t b = lead + lay.bytes; b < row; ++b) {
      if (r[b] != 0xa5 && fail())
        ADD_FAILURE() << "token " << t << ": tail byte " << b << " written";
    }
    if (off.argmax >= 0) {
      const auto a = static_cast<int32_t>(ReadU32(r + off.argmax));
      if (a != argmax[t] && fail()) {
        ADD_FAILURE() << "token " << t << ": argmax " << a << ", reference " << argmax[t];
      }
    }
    for (int64_t i = 0; i < k; ++i) {
      const auto id = static_cast<int32_t>(ReadU32(r + off.top_k_ids + 4 * i));
      const float lp = std::bit_cast<float>(ReadU32(r + off.top_k_logprobs + 4 * i));
      if (id != ids[t * k + i] && fail()) {
        ADD_FAILURE() << "token " << t << ": top-k " << i << " id " << id << ", reference "
                      << ids[t * k + i];
      }
      if (!(std::fabs(lp - lps[t * k + i]) <= 1e-5f) && fail()) {
        ADD_FAILURE() << "token " << t << ": top-k " << i << " logprob " << lp << ", reference "
                      << lps[t * k + i];
      }
    }
    if (vd == 0) continue;
    const float* p = probs.data() + t * vd;
    if (c.fp8) {
      const float scale = Fp8RowScale(*std::max_element(p, p + vd));
      const float s = std::bit_cast<float>(ReadU32(r + off.probs_scale));
      if (!(std::fabs(s - scale) <= 1e-6f * scale) && fail()) {
        ADD_FAILURE() << "token " << t << ": scale " << s << ", reference " << scale;
      }
      for (int64_t j = 0; j < vd; ++j) {
        const int want = FloatToE4m3(p[j] / scale), code = r[off.probs + j];
        if (std::abs(code - want) > 1 && fail()) {
          ADD_FAILURE() << "token " << t << ": column " << j << " code " << code << ", reference "
                        << want << " (p " << p[j] << ")";
        }
      }
    } else {
      for (int64_t j = 0; j < vd; ++j) {
        uint16_t bits;
        std::memcpy(&bits, r + off.probs + 2 * j, 2);
        const int want = RoundBf16(p[j]);
        if (std::abs(int{bits} - want) > 1 && fail()) {
          ADD_FAILURE() << "token " << t << ": column " << j << " bf16 0x" << std::hex << bits
                        << ", reference 0x" << want << std::dec << " (p " << p[j] << ")";
        }
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, TargetOutputsCudaTest,
    ::testing::Values(
        // Small vocabularies: one step per CTA, top_k up to the vocabulary's 256.
        Case{1, 1000, 0, 0, 37, 5, false}, Case{7, 1000, 3, 0, 1, 256, true},
        Case{9, 1000, 0, 0, 1000, 256, false},
        // 4,099: rows not 16-byte aligned (the lane-strided loads).
        Case{7, 4099, 0, 0, 4000, 256, false}, Case{300, 4099, 1, 1, 37, 1, true},
        Case{300, 4099, 0, 0, 0, 0, false},
        // Qwen3's vocabulary.
        Case{7, 151936, 0, 0, 32000, 256, false}, Case{300, 151936, 0, 0, 65536, 5, true},
        Case{7, 151936, 2, 1, 32000, 256, true},
        // Qwen3.6's, with one token (the widest cluster) and with many.
        Case{1, 248320, 0, 0, 65536, 256, false}, Case{300, 248320, 0, 0, 32000, 256, true},
        Case{7, 248320, 0, 0, 0, 0, false}, Case{7, 248320, 0, 0, 0, 256, false},
        Case{7, 248320, 0, 0, 65536, 0, true, false}, Case{7, 248320, 0, 0, 37, 1, false, false}),
    Name);

TEST(TargetOutputsCudaErrorsTest, BadArgumentsAreRefused) {
  DF_REQUIRE_GPU();
  TargetOutputOffsets off;
  off.argmax = 0;
  uint8_t* out = nullptr;
  EXPECT_EQ(TargetOutputsFromLogits(nullptr, -1, 10, 10, nullptr, 0, 0, off, out, 4, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(TargetOutputsFromLogits(nullptr, 1, 10, 9, nullptr, 0, 0, off, out, 4, nullptr),
            cudaErrorInvalidValue);  // pitch < vocab
  EXPECT_EQ(TargetOutputsFromLogits(nullptr, 1, 10, 10, nullptr, 0, 11, off, out, 4, nullptr),
            cudaErrorInvalidValue);  // top_k > vocab
  off.probs = 4;
  EXPECT_EQ(TargetOutputsFromLogits(nullptr, 1, 10, 10, nullptr, 3, 0, off, out, 4, nullptr),
            cudaErrorInvalidValue);  // draft without an index
  EXPECT_EQ(TargetOutputsFromLogits(nullptr, 0, 10, 10, nullptr, 0, 0, off, out, 4, nullptr),
            cudaSuccess);  // no tokens: nothing to do
}

}  // namespace
}  // namespace draftfeed::cuda
