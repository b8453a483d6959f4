// Chunked prefill's carries between forwards (kernels/gdn.cuh): the causal
// conv's x_prefix and the gated delta rule's initial_state / final_state. A
// sequence run in pieces, each piece a call of its own, must give the one-pass
// bits where the pieces allow it (the conv: always; the delta rule: pieces
// that start at multiples of the 64-token chunk), else the fp32 reference's
// tolerance; only sequence 0 reads the carry in, only the last writes it out.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/gdn.h"
#include "kernels/gdn.cuh"
#include "tests/kernels/cuda/gdn_test_data.h"
#include "tests/kernels/cuda/gpu_test_util.h"

namespace draftfeed::cuda::gdn_test {
namespace {

// Where a sequence of `total` tokens is cut: piece i is [cuts[i−1], cuts[i]).
std::vector<int64_t> PieceBounds(const std::vector<int64_t>& cuts, int64_t total) {
  std::vector<int64_t> b = {0};
  b.insert(b.end(), cuts.begin(), cuts.end());
  b.push_back(total);
  return b;
}

std::string CutsName(const std::vector<int64_t>& cuts) {
  std::string s = "cut at";
  for (int64_t c : cuts) {
    s += ' ';
    s += std::to_string(c);
  }
  return s;
}

// Elements whose bits differ (bf16 or fp32).
template <typename T>
int64_t BitsDiffer(const std::vector<T>& a, const std::vector<T>& b) {
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return n;
}

// ---------------------------------------------------------------------------
// Causal conv: x_prefix.

constexpr int64_t kConvTokens = 1100;

struct ConvCase {
  int64_t channels, x_stride, kernel;
};

// The x_prefix of a piece starting at token p: inputs p − (K−1) .. p − 1 of
// the sequence, dense, zero rows for those before its start.
std::vector<float> PrefixRows(const std::vector<float>& x, int64_t x_stride, int64_t channels,
                              int64_t kernel, int64_t p) {
  std::vector<float> rows((kernel - 1) * channels, 0.0f);
  for (int64_t i = 0; i < kernel - 1; ++i) {
    const int64_t src = p - (kernel - 1) + i;
    if (src >= 0) std::copy_n(&x[src * x_stride], channels, &rows[i * channels]);
  }
  return rows;
}

class ConvPrefixCudaTest : public ::testing::TestWithParam<ConvCase> {};

// One sequence in pieces, each with its x_prefix (none for the first), against
// the one-pass bits and the reference. The cuts: 1 token, around a chunk, deep
// in, and inside the conv window (pieces of 1 and 2 tokens whose prefixes
// reach before the sequence).
TEST_P(ConvPrefixCudaTest, PiecesGiveOnePassBits) {
  DF_REQUIRE_GPU();
  const ConvCase cc = GetParam();
  const int64_t T = kConvTokens, C = cc.channels, K = cc.kernel;
  const std::vector<float> x = RandomBf16Values(T * cc.x_stride, 1.0f, 31 + C);
  const std::vector<float> w = RandomBf16Values(C * K, 0.5f, 32 + K);
  std::vector<float> x_dense(T * C), ref(T * C);
  for (int64_t t = 0; t < T; ++t) std::copy_n(&x[t * cc.x_stride], C, &x_dense[t * C]);
  const std::vector<int32_t> cu_all = {0, static_cast<int32_t>(T)};
  cpu::CausalConv1dSilu(x_dense.data(), w.data(), cu_all.data(), 1, C, K, ref.data());

  DeviceBuffer<bf16> d_x(ToBf16(x)), d_w(ToBf16(w)), d_y(T * C), d_pieces(T * C);
  DeviceBuffer<int32_t> d_cu(cu_all);
  DF_CUDA_OK(CausalConv1dSilu(d_x.get(), cc.x_stride, d_w.get(), T, C, K, d_cu.get(), 1, d_y.get(),
                              nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<bf16> one_pass = d_y.Download();

  const std::vector<std::vector<int64_t>> plans = {{1},    {63},   {64},       {65},
                                                   {1000}, {1, 2}, {2, 3, 600}};
  for (const std::vector<int64_t>& cuts : plans) {
    const std::string what =
        "conv C=" + std::to_string(C) + " K=" + std::to_string(K) + ", " + CutsName(cuts);
    DF_CUDA_OK(cudaMemset(d_pieces.get(), 0xff, T * C * sizeof(bf16)));  // NaN poison
    const std::vector<int64_t> bounds = PieceBounds(cuts, T);
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      const int64_t p = bounds[i], n = bounds[i + 1] - p;
      DeviceBuffer<int32_t> cu(std::vector<int32_t>{0, static_cast<int32_t>(n)});
      DeviceBuffer<bf16> prefix(ToBf16(PrefixRows(x, cc.x_stride, C, K, p)));
      DF_CUDA_OK(CausalConv1dSilu(d_x.get() + p * cc.x_stride, cc.x_stride, d_w.get(), n, C, K,
                                  cu.get(), 1, d_pieces.get() + p * C, nullptr,
                                  i == 0 ? nullptr : prefix.get()));
      DF_CUDA_OK(cudaDeviceSynchronize());
    }
    const std::vector<bf16> pieces = d_pieces.Download();
    EXPECT_EQ(BitsDiffer(pieces, one_pass), 0) << what << ": not the one-pass bits";
    const std::vector<float> y = ToF32(pieces);
    for (int64_t i = 0; i < T * C; ++i) {  // the reference's bound (gdn_cuda_test.cc's)
      ASSERT_LE(std::fabs(y[i] - ref[i]), std::ldexp(1.0, -8) * std::fabs(ref[i]) + 1e-5)
          << what << ": t=" << i / C << " c=" << i % C << " gpu=" << y[i] << " ref=" << ref[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ConvPrefixCudaTest,
                         ::testing::Values(ConvCase{13, 20, 4},  // scalar path, strided rows
                                           ConvCase{40, 56, 4},  // 16-byte path
                                           ConvCase{1032, 1032, 4}, ConvCase{24, 24, 3},
                                           ConvCase{16, 24, 8}));

// Packed sequences with an x_prefix: sequence 0 reads it (against the
// reference over the prefix rows followed by that sequence), the others give
// the bits they give without one.
TEST(CausalConvPrefixCudaTest, OnlySequenceZeroReadsThePrefix) {
  DF_REQUIRE_GPU();
  const std::vector<int32_t> lens = {70, 2, 33, 5};
  const std::vector<int32_t> cu = Offsets(lens);
  const int64_t T = cu.back(), C = 40, K = 4, len0 = lens[0];
  const std::vector<float> x = RandomBf16Values(T * C, 1.0f, 41);
  const std::vector<float> w = RandomBf16Values(C * K, 0.5f, 42);
  const std::vector<float> prefix = RandomBf16Values((K - 1) * C, 1.0f, 43);
  DeviceBuffer<bf16> d_x(ToBf16(x)), d_w(ToBf16(w)), d_prefix(ToBf16(prefix));
  DeviceBuffer<bf16> d_with(T * C), d_without(T * C);
  DeviceBuffer<int32_t> d_cu(cu);
  const int32_t nseq = static_cast<int32_t>(lens.size());
  DF_CUDA_OK(CausalConv1dSilu(d_x.get(), C, d_w.get(), T, C, K, d_cu.get(), nseq, d_with.get(),
                              nullptr, d_prefix.get()));
  DF_CUDA_OK(CausalConv1dSilu(d_x.get(), C, d_w.get(), T, C, K, d_cu.get(), nseq, d_without.get(),
                              nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<bf16> with = d_with.Download(), without = d_without.Download();
  const std::vector<bf16> rest_with(with.begin() + len0 * C, with.end());
  const std::vector<bf16> rest_without(without.begin() + len0 * C, without.end());
  EXPECT_EQ(BitsDiffer(rest_with, rest_without), 0) << "the prefix reached past sequence 0";

  // Sequence 0 after its prefix = the last len0 rows of one sequence that
  // holds the prefix rows first.
  std::vector<float> joined(prefix);
  joined.insert(joined.end(), x.begin(), x.begin() + len0 * C);
  std::vector<float> ref(joined.size());
  const std::vector<int32_t> cu_joined = {0, static_cast<int32_t>(K - 1 + len0)};
  cpu::CausalConv1dSilu(joined.data(), w.data(), cu_joined.data(), 1, C, K, ref.data());
  const std::vector<float> y = ToF32(with);
  for (int64_t i = 0; i < len0 * C; ++i) {
    const float r = ref[(K - 1) * C + i];
    ASSERT_LE(std::fabs(y[i] - r), std::ldexp(1.0, -8) * std::fabs(r) + 1e-5)
        << "t=" << i / C << " c=" << i % C << " gpu=" << y[i] << " ref=" << r;
  }
}

// ---------------------------------------------------------------------------
// Gated delta rule: initial_state / final_state.

// A batch's inputs on the device (GdnDevice) run in pieces, each piece a
// call over rows [p, p + n) of qkv, a and b that writes rows [p, p + n) of
// `out`: Run chains one sequence's pieces through the state buffers
// (ping-pong, or one buffer in place), Piece gives one call's args.
struct PieceRunner {
  const GdnInputs& in;
  GdnDevice& dev;
  bool in_place = false;
  DeviceBuffer<float> state_a, state_b;
  DeviceBuffer<bf16> out;

  PieceRunner(const GdnInputs& inputs, GdnDevice& device)
      : in(inputs),
        dev(device),
        state_a(StateSize(inputs.s)),
        state_b(StateSize(inputs.s)),
        out(inputs.T * inputs.s.nv * inputs.s.dv) {}

  static size_t StateSize(const GdnShape& s) { return s.nv * s.dk * s.dv; }

  // Runs the pieces given by `bounds` (token offsets into the batch, each a
  // single sequence: the batch must be one sequence), returning the final state.
  void Run(const std::vector<int64_t>& bounds, std::vector<float>* final_state) {
    ASSERT_EQ(cudaMemset(out.get(), 0xff, out.size() * sizeof(bf16)), cudaSuccess);
    float* state = state_a.get();
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      const int64_t p = bounds[i], n = bounds[i + 1] - p;
      DeviceBuffer<int32_t> cu(std::vector<int32_t>{0, static_cast<int32_t>(n)});
      float* next = in_place ? state : (state == state_a.get() ? state_b.get() : state_a.get());
      GdnArgs a = Piece(p, n, cu.get(), 1);
      a.initial_state = i == 0 ? nullptr : state;
      a.final_state = next;
      DF_CUDA_OK(GatedDeltaRule(a, dev.ws.get(), nullptr));
      DF_CUDA_OK(cudaDeviceSynchronize());
      state = next;
    }
    DF_CUDA_OK(cudaMemcpy(final_state->data(), state, final_state->size() * sizeof(float),
                          cudaMemcpyDeviceToHost));
  }

  // Args of rows [p, p + n) of the batch as `num_seqs` sequences given by cu.
  GdnArgs Piece(int64_t p, int64_t n, const int32_t* cu, int32_t num_seqs) const {
    GdnArgs a = dev.args;
    a.qkv += p * in.stride;
    a.a += p * in.ab_stride;
    a.b += p * in.ab_stride;
    a.num_tokens = n;
    a.cu_seqlens = cu;
    a.num_seqs = num_seqs;
    a.out = out.get() + p * in.s.nv * in.s.dv;
    return a;
  }
};

// The batch's one pass: outputs and the last sequence's final state.
void RunOnePass(GdnDevice& dev, const GdnShape& s, std::vector<bf16>* out,
                std::vector<float>* final_state) {
  DeviceBuffer<float> state(s.nv * s.dk * s.dv);
  GdnArgs a = dev.args;
  a.final_state = state.get();
  DF_CUDA_OK(GatedDeltaRule(a, dev.ws.get(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  *out = dev.out.Download();
  *final_state = state.Download();
}

std::string ShapeName(const GdnShape& s, int64_t T) {
  return "Nk=" + std::to_string(s.nk) + " Nv=" + std::to_string(s.nv) +
         " dk=" + std::to_string(s.dk) + " dv=" + std::to_string(s.dv) + " T=" + std::to_string(T);
}

// One sequence of T tokens cut as each plan says: every cut a multiple of 64
// gives the one-pass bits, outputs and final state; other cuts give the
// reference's tolerance, and a final state within the same bounds of the
// one-pass one (both fp32 states of the same recurrence, chunked differently).
void CheckPieces(const GdnShape& shape, int64_t T, const std::vector<std::vector<int64_t>>& plans,
                 uint64_t seed) {
  const GdnInputs in = MakeInputs(shape, {static_cast<int32_t>(T)}, seed);
  GdnDevice dev(in);
  std::vector<bf16> one_pass;
  std::vector<float> one_pass_state;
  RunOnePass(dev, shape, &one_pass, &one_pass_state);
  if (::testing::Test::HasFatalFailure()) return;
  const std::vector<float> ref = Reference(in);
  PieceRunner runner(in, dev);
  for (const std::vector<int64_t>& cuts : plans) {
    const std::string what = ShapeName(shape, T) + ", " + CutsName(cuts);
    std::vector<float> state(one_pass_state.size());
    runner.Run(PieceBounds(cuts, T), &state);
    if (::testing::Test::HasFatalFailure()) return;
    const std::vector<bf16> out = runner.out.Download();
    const bool aligned =
        std::all_of(cuts.begin(), cuts.end(), [](int64_t c) { return c % 64 == 0; });
    const int64_t out_differ = BitsDiffer(out, one_pass),
                  state_differ = BitsDiffer(state, one_pass_state);
    const ErrorStats e = Compare(ToF32(out), ref);
    const ErrorStats es = Compare(state, one_pass_state);
    std::printf(
        "gdn pieces %s: %lld outputs, %lld state elements differ from one pass; vs reference "
        "max|Δ|/max|ref| %.3g relL2 %.3g; state vs one pass max|Δ|/max|S| %.3g relL2 %.3g\n",
        what.c_str(), static_cast<long long>(out_differ), static_cast<long long>(state_differ),
        e.max_err / e.max_ref, e.rel_l2, es.max_err / es.max_ref, es.rel_l2);
    EXPECT_EQ(e.non_finite, 0) << what << ": unwritten or non-finite outputs";
    EXPECT_EQ(es.non_finite, 0) << what << ": non-finite state";
    if (aligned) {
      EXPECT_EQ(out_differ, 0) << what << ": outputs are not the one-pass bits";
      EXPECT_EQ(state_differ, 0) << what << ": final state is not the one-pass bits";
    }
    EXPECT_LE(e.max_err, kMaxErrVsMaxRef * e.max_ref) << what;
    EXPECT_LE(e.rel_l2, kRelL2) << what;
    EXPECT_LE(es.max_err, kMaxErrVsMaxRef * es.max_ref) << what << ": final state";
    EXPECT_LE(es.rel_l2, kRelL2) << what << ": final state";
  }
}

// At multiples of the chunk: one cut, a deep one, and a chain of three pieces.
const std::vector<std::vector<int64_t>> kAlignedPlans = {{64}, {640}, {64, 128, 512}};
// Elsewhere: 1 token, one short of and one past a chunk, deep in, and a
// chain through all of them.
const std::vector<std::vector<int64_t>> kUnalignedPlans = {
    {1}, {63}, {65}, {1000}, {1, 63, 65, 1000}};

TEST(GdnStateCudaTest, PiecesAtChunkMultiplesGiveOnePassBits) {
  DF_REQUIRE_GPU();
  CheckPieces({2, 4, 128, 128, 0, 0}, 1100, kAlignedPlans, 700);
  CheckPieces({1, 2, 32, 128, 16, 1}, 1100, kAlignedPlans, 701);  // two state slices
  CheckPieces({2, 6, 64, 32, 8, 3}, 1100, kAlignedPlans, 702);    // dk ≠ dv, padded rows
}

TEST(GdnStateCudaTest, PiecesElsewhereMatchTheReference) {
  DF_REQUIRE_GPU();
  CheckPieces({2, 4, 128, 128, 0, 0}, 1100, kUnalignedPlans, 710);
  CheckPieces({2, 6, 64, 32, 8, 3}, 1100, kUnalignedPlans, 711);
}

TEST(GdnStateCudaTest, Qwen36_27BShapePieces) {
  DF_REQUIRE_GPU();
  CheckPieces({16, 48, 128, 128, 0, 0}, 700, {{512}, {64, 320}, {100}, {1, 641}}, 720);
}

// One buffer as both initial_state and final_state of each single-sequence
// piece gives the bits of two (ping-pong), at chunk multiples and elsewhere.
TEST(GdnStateCudaTest, InPlaceStateGivesTheSameBits) {
  DF_REQUIRE_GPU();
  const GdnShape s = {2, 4, 128, 128, 0, 0};
  const GdnInputs in = MakeInputs(s, {1100}, 730);
  GdnDevice dev(in);
  for (const std::vector<int64_t>& cuts : {std::vector<int64_t>{64, 640}, {1, 65}}) {
    std::vector<std::vector<bf16>> outs;
    std::vector<std::vector<float>> states;
    for (const bool in_place : {false, true}) {
      PieceRunner runner(in, dev);
      runner.in_place = in_place;
      std::vector<float> state(PieceRunner::StateSize(s));
      runner.Run(PieceBounds(cuts, in.T), &state);
      if (HasFatalFailure()) return;
      outs.push_back(runner.out.Download());
      states.push_back(state);
    }
    EXPECT_EQ(BitsDiffer(outs[0], outs[1]), 0) << CutsName(cuts) << ": outputs";
    EXPECT_EQ(BitsDiffer(states[0], states[1]), 0) << CutsName(cuts) << ": final state";
  }
}

// The layout, pinned without the chunked maths: one token from the zero
// state leaves S = β·k̂·vᵀ, S[j][a][b] = β_j k̂_a v_b (key dim a, value dim b;
// dk ≠ dv, so a transposed layout does not even fit the same indices).
TEST(GdnStateCudaTest, FinalStateIsKeyByValue) {
  DF_REQUIRE_GPU();
  const GdnShape s = {1, 2, 32, 64, 0, 0};
  const GdnInputs in = MakeInputs(s, {1}, 740);
  GdnDevice dev(in);
  std::vector<bf16> out;
  std::vector<float> state;
  RunOnePass(dev, s, &out, &state);
  if (HasFatalFailure()) return;
  std::vector<float> k(in.qkv.begin() + s.nk * s.dk, in.qkv.begin() + 2 * s.nk * s.dk);
  cpu::L2NormHeads(k.data(), 1, s.nk, s.dk, s.nk * s.dk, 1e-6f, 1.0f);
  std::vector<float> g(s.nv), beta(s.nv);
  cpu::GdnGates(in.a.data(), in.b.data(), in.a_log.data(), in.dt_bias.data(), 1, s.nv, g.data(),
                beta.data());
  const float* v = in.qkv.data() + 2 * s.nk * s.dk;
  std::vector<float> want(state.size());
  for (int64_t j = 0; j < s.nv; ++j) {
    for (int64_t a = 0; a < s.dk; ++a) {
      for (int64_t b = 0; b < s.dv; ++b) {
        want[(j * s.dk + a) * s.dv + b] =
            beta[j] * k[(j / (s.nv / s.nk)) * s.dk + a] * v[j * s.dv + b];
      }
    }
  }
  // U = β·v and V_new·kf rounded to bf16 on the way (2^-9 each), doubled.
  const ErrorStats e = Compare(state, want);
  EXPECT_EQ(e.non_finite, 0);
  EXPECT_LE(e.max_err, std::ldexp(1.0, -7) * e.max_ref)
      << "worst at S[" << e.worst / (s.dk * s.dv) << "][" << e.worst / s.dv % s.dk << "]["
      << e.worst % s.dv << "]: gpu " << state[e.worst] << " want " << want[e.worst];
}

// A batch whose first sequence continues a carried one and whose last is
// carried on, with a whole sequence between: A's first 128 tokens run alone
// (forward 1), then [the rest of A | B | the start of C] (forward 2) from
// A's state. A's rows are the one-pass bits, B's are B's from zero, and the
// final state is C's; nothing leaks into B.
TEST(GdnStateCudaTest, OnlyTheFirstSequenceReadsAndTheLastWrites) {
  DF_REQUIRE_GPU();
  const GdnShape s = {2, 4, 128, 128, 0, 0};
  const std::vector<int32_t> lens = {400, 100, 200};  // A, B, C's start
  const GdnInputs in = MakeInputs(s, lens, 750);
  GdnDevice dev(in);
  std::vector<bf16> one_pass;  // A, B and C each from zero: the reference bits
  std::vector<float> c_state;
  RunOnePass(dev, s, &one_pass, &c_state);
  if (HasFatalFailure()) return;

  PieceRunner runner(in, dev);
  ASSERT_EQ(cudaMemset(runner.out.get(), 0xff, runner.out.size() * sizeof(bf16)), cudaSuccess);
  constexpr int64_t kFirst = 128;
  DeviceBuffer<int32_t> cu1(std::vector<int32_t>{0, static_cast<int32_t>(kFirst)});
  GdnArgs f1 = runner.Piece(0, kFirst, cu1.get(), 1);
  f1.final_state = runner.state_a.get();
  DF_CUDA_OK(GatedDeltaRule(f1, dev.ws.get(), nullptr));
  DeviceBuffer<int32_t> cu2(Offsets({lens[0] - static_cast<int32_t>(kFirst), lens[1], lens[2]}));
  GdnArgs f2 = runner.Piece(kFirst, in.T - kFirst, cu2.get(), 3);
  f2.initial_state = runner.state_a.get();
  f2.final_state = runner.state_b.get();
  DF_CUDA_OK(GatedDeltaRule(f2, dev.ws.get(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(BitsDiffer(runner.out.Download(), one_pass), 0)
      << "A continued, B and C from zero: not the one-pass bits";
  EXPECT_EQ(BitsDiffer(runner.state_b.Download(), c_state), 0) << "final state is not C's";
}

// No tokens: the state passes through (or is zero without one), and one
// buffer as both is refused when another sequence's blocks could write it
// before sequence 0's have read it.
TEST(GdnStateCudaTest, EmptyBatchesAndAliasing) {
  DF_REQUIRE_GPU();
  const GdnShape s = {2, 4, 16, 16, 0, 0};
  const GdnInputs in = MakeInputs(s, {5, 7}, 760);
  GdnDevice dev(in);
  const size_t n = s.nv * s.dk * s.dv;
  const std::vector<float> carried = RandomBf16Values(n, 1.0f, 761);
  DeviceBuffer<float> d_in(carried), d_out(n);

  GdnArgs a = dev.args;
  a.num_tokens = 0;
  a.num_seqs = 1;
  DeviceBuffer<int32_t> cu0(std::vector<int32_t>{0, 0});
  a.cu_seqlens = cu0.get();
  a.initial_state = d_in.get();
  a.final_state = d_out.get();
  DF_CUDA_OK(GatedDeltaRule(a, dev.ws.get(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(BitsDiffer(d_out.Download(), carried), 0) << "an empty sequence kept no state";
  a.initial_state = nullptr;
  DF_CUDA_OK(GatedDeltaRule(a, dev.ws.get(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_EQ(BitsDiffer(d_out.Download(), std::vector<float>(n, 0.0f)), 0);

  GdnArgs two = dev.args;  // two sequences
  two.initial_state = d_in.get();
  two.final_state = d_in.get();
  EXPECT_EQ(GatedDeltaRule(two, dev.ws.get(), nullptr), cudaErrorInvalidValue);
  two.final_state = d_in.get() + 1;  // overlapping
  EXPECT_EQ(GatedDeltaRule(two, dev.ws.get(), nullptr), cudaErrorInvalidValue);
  two.final_state = d_out.get();
  DF_CUDA_OK(GatedDeltaRule(two, dev.ws.get(), nullptr));
  DF_CUDA_OK(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace draftfeed::cuda::gdn_test
