// What the target-output goldens tests share: target_outputs_goldens_test.cc
// (the CPU engine; it also defines everything declared here) and, with CUDA,
// target_outputs_goldens_cuda_test.cc (the CUDA engine, in the same binary).
//
// The goldens are tests/data/goldens_outputs_<model>.safetensors, made by
// tests/data/make_target_output_goldens.py from transformers' fp32 logits on
// the CPU (FP8 checkpoints: on the dequantized weights), each sequence of
// goldens_<model>.safetensors run alone: per token the argmax, the top-8 of
// log_softmax over the full vocabulary and the softmax over a 100-id draft
// vocabulary (tests/data/README.md, "Target-output goldens"). The tests ask an
// engine for the same outputs (ForwardInput::outputs, no hidden states), decode
// each token's row by common/target_outputs.h's layout and compare, pooled over
// every token of every sequence.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/capture_encoding.h"
#include "common/target_outputs.h"
#include "server/model/engine.h"
#include "server/model/model.h"
#include "tests/server/model/goldens.h"

namespace draftfeed::testing {

// Two golden logits (argmax) or log-probs (top-k neighbours) closer than this
// count as tied: an engine may order them either way. The CPU engine's fp32
// logits are within ~1e-5 of transformers' (goldens.h: its final state is
// within 2e-5 of max|ref|, and lm_head adds a 64-128 term fp32 dot product),
// so only gaps that small can swap; 1e-3 leaves a factor 50.
inline constexpr double kTieGap = 1e-3;

struct OutputGoldenSeq {
  std::vector<int32_t> ids;           // [T]
  std::vector<int32_t> argmax;        // [T]
  std::vector<float> top2_margin;     // [T] top-1 minus top-2 logit
  std::vector<int32_t> top_k_ids;     // [T, k], best first
  std::vector<float> top_k_logprobs;  // [T, k]
  std::vector<float> draft_probs;     // [T, Vd], columns in draft_vocab's order
};

struct OutputGoldens {
  int64_t vocab = 0;
  int32_t top_k = 0;
  std::vector<int32_t> draft_vocab;  // [Vd]
  std::vector<OutputGoldenSeq> seqs;
  int64_t tokens() const;
};

// "goldens_outputs_<model>.safetensors", in DataDir().
std::string OutputGoldensFile(const std::string& model);
absl::StatusOr<OutputGoldens> LoadOutputGoldens(const std::string& model);

// argmax, top_k = the goldens' k, their draft vocabulary, probs in `probs`.
TargetOutputs OutputsRequest(const OutputGoldens& g, CaptureEncoding probs);

// One token's outputs, decoded from its row or computed by a bar.
struct TokenOutputs {
  int32_t argmax = -1;
  std::vector<int32_t> top_ids;
  std::vector<float> top_logprobs;
  std::vector<float> probs;    // bf16 widened, or code * scale
  float probs_scale = 0;       // fp8_e4m3 only
  std::vector<uint8_t> codes;  // fp8_e4m3 only
};
using SeqOutputs = std::vector<TokenOutputs>;  // one per token

// Decodes LayoutOf(spec).bytes bytes (every value little-endian).
TokenOutputs DecodeTokenOutputs(std::span<const std::byte> bytes, const TargetOutputs& spec);

// Each golden sequence alone through engine.Forward: its token ids,
// seq_lens = {T}, layers = {}, bf16 encoding, outputs = &spec. Checks that the
// row is RowBytesPerToken = LayoutOf(spec).bytes and the buffer CaptureBytes.
absl::StatusOr<std::vector<SeqOutputs>> RunOutputsAlone(Engine& engine, const OutputGoldens& g,
                                                        const TargetOutputs& spec);

// What a bf16 engine is held to: the outputs, computed in double by the
// definitions of kernels/cpu/target_outputs.h, of the final-normed states of
// goldens_<model>.safetensors' reduced-precision run (seq{i}.bf16.final:
// transformers in bf16 on the H200; FP8 checkpoints seq{i}.emu.final:
// make_fp8_goldens.py's emulation of an FP8 engine) through the model's
// lm_head (the embedding where tied), draft probs rounded to bf16 once.
absl::StatusOr<std::vector<SeqOutputs>> ReducedPrecisionBar(const std::string& model,
                                                            const Model& m, const OutputGoldens& g);

// Pooled over every token of every sequence.
struct OutputsStats {
  int64_t tokens = 0;
  // Rows that break the format's own rules: an id outside the vocabulary or
  // listed twice, log-probs not descending or above 0, a non-finite value, a
  // negative prob, an fp8 NaN code or a scale that is not finite and > 0, or
  // argmax != top_ids[0] (both order logits larger first, ties to the lower id).
  int64_t malformed = 0;
  int64_t argmax_checked = 0;   // tokens whose golden top2_margin > kTieGap
  int64_t argmax_mismatch = 0;  // of those, argmax != the golden's
  // Tokens failing TopKIdsDiffer's position / set rule at kTieGap.
  int64_t topk_id_failures = 0;
  double topk_overlap = 0;  // mean |ours ∩ golden| / k
  // Per token: max over positions of |ours - golden| log-prob (both sorted
  // descending, so ties cannot move it); TV = 0.5 Σ |p - q| over the draft
  // vocabulary; the TV that e4m3 itself costs at the row's own scale,
  // TV(golden, s * e4m3(golden / s)) (0 for bf16).
  std::vector<double> logprob_err, tv, tv_floor;
  // Probs further from the golden than one step of their encoding (bf16:
  // 2^-7 of the value; e4m3: a step at that code, times the scale) plus 2^-10
  // of the value for the logits' own error: only for the fp32 CPU engine.
  int64_t encoding_failures = 0;
  std::vector<std::string> examples;     // the first few failures, described
  std::vector<double> TvExcess() const;  // tv - tv_floor, per token
};

// "" when `ours` top-k ids agree with the golden ones up to ties: position by
// position where a golden log-prob is more than `tie` from its neighbours; as
// sets within each run of positions whose consecutive golden log-probs are
// within `tie`; and in the last run (which may be tied with entries past k that
// the goldens do not list) an id outside the golden run is allowed when its
// log-prob is within `tie` of the golden k-th. Else what differs.
std::string TopKIdsDiffer(std::span<const int32_t> golden_ids, std::span<const float> golden_lp,
                          std::span<const int32_t> ids, std::span<const float> lp, double tie);

OutputsStats CompareOutputs(const OutputGoldens& g, const std::vector<SeqOutputs>& ours,
                            const TargetOutputs& spec);

// Nearest rank: the smallest value with at least q of the values <= it.
double Quantile(std::vector<double> v, double q);

// One line: argmax, top-k, log-prob error, TV (median / p99) of `s`.
std::string Summary(const OutputsStats& s);

class TargetOutputsGoldensTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string file = OutputGoldensFile(GetParam());
    if (!std::filesystem::exists(DataDir() / file)) {
      GTEST_SKIP() << "tests/data/" << file
                   << " is not made yet: run `cd tests/data && python3 "
                      "make_target_output_goldens.py` where transformers >= 5 and safetensors "
                      "are installed (the CPU is enough; tests/data/README.md, \"Target-output "
                      "goldens\")";
    }
    absl::StatusOr<OutputGoldens> g = LoadOutputGoldens(GetParam());
    ASSERT_TRUE(g.ok()) << g.status();
    goldens_ = *std::move(g);
    absl::StatusOr<Loaded> l = LoadWithEngine((DataDir() / "models" / GetParam()).string());
    ASSERT_TRUE(l.ok()) << GetParam() << ": " << l.status();
    loaded_ = *std::move(l);
  }

  OutputGoldens goldens_;
  Loaded loaded_;
};

}  // namespace draftfeed::testing
