// What the long-sequence goldens tests share (tests/data/make_long_goldens.py):
// one 3,000-token sequence per model family with transformers' states at a
// stored subset of its tokens, the batch the tests run it in (between two
// short sequences), the forwards a batch is cut into, and the fixture that
// loads a checkpoint, its long goldens and a CPU engine that can carry the
// sequence. The bounds are goldens.h's.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/model/engine.h"
#include "server/service/forward_chunks.h"
#include "tests/server/model/golden_moe_routing.h"
#include "tests/server/model/goldens.h"

namespace draftfeed::testing {

struct LongGoldens {
  int64_t num_layers = 0, hidden = 0;
  std::vector<std::string> layer_types;
  std::vector<int32_t> ids;     // [T], the whole sequence
  std::vector<int32_t> rows;    // [R] token positions stored, ascending
  std::vector<int32_t> layers;  // [K] draftfeed capture ids (-1: the final norm)
  // [R, K, H]: HF fp32 (the reference) and HF bf16 (the CUDA bar), widened.
  std::vector<float> fp32, bf16;
  MoeGoldens moe;  // one "sequence" of R rows; experts == 0 for a dense model
};

// tests/data/goldens_long_<model>.safetensors; NOT_FOUND when the file is not
// there (LongGoldensTest skips then), other errors naming the bad tensor.
absl::StatusOr<LongGoldens> LoadLongGoldens(const std::string& model);

// The tests' batch: kLeadTokens of another sequence, the long one, kTailTokens
// of a third, so that the long sequence resumes as a forward's first sequence
// after a neighbour and is carried out of one with a neighbour before it.
inline constexpr int32_t kLeadTokens = 37;
inline constexpr int32_t kTailTokens = 11;
struct LongBatch {
  std::vector<int32_t> tokens, lens;
  int64_t offset = 0;  // the long sequence's first token in `tokens`
};
LongBatch MakeLongBatch(const std::vector<int32_t>& long_ids, int64_t vocab);

// Cuts of the long sequence (token counts from its start) off the 64-token
// grid: 1 token in (the conv window reaches back over two cuts), 63 and 65
// (either side of the first GDN chunk edge, 2 tokens between), 1000, 2047
// (one before an edge) and 2999 (the last token alone, with the tail).
inline const std::vector<int32_t> kAwkwardCuts = {1, 63, 65, 1000, 2047, 2999};

// The batch cut into forwards: the long sequence at `cuts`, the lead in the
// first forward and the tail in the last.
std::vector<ForwardChunk> CutLongSequence(const LongBatch& batch, const std::vector<int32_t>& cuts);

// Where `chunks` cut the long sequence (token counts from its start).
std::vector<int32_t> CutsOfLongSequence(const LongBatch& batch,
                                        const std::vector<ForwardChunk>& chunks);

// Runs `chunks` in order on `engine`, joining the captures: fp32 for a
// CpuEngine (ForwardFloat), bf16 widened for any engine (Forward).
absl::StatusOr<std::vector<float>> RunChunksFloat(CpuEngine& engine, const LongBatch& batch,
                                                  const std::vector<ForwardChunk>& chunks,
                                                  const std::vector<int32_t>& layers);
absl::StatusOr<std::vector<float>> RunChunksBf16(Engine& engine, const LongBatch& batch,
                                                 const std::vector<ForwardChunk>& chunks,
                                                 const std::vector<int32_t>& layers);

// One batch forward, no chunking.
std::vector<ForwardChunk> OneForward(const LongBatch& batch);

class LongGoldensTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override;

  // The stored rows of slot `k` of a [T_batch, K, H] capture of the batch,
  // as an [R, H] layer; and the golden's.
  std::vector<float> OursAtRows(const std::vector<float>& capture, int64_t k) const;
  std::vector<float> Golden(int64_t k, bool bf16 = false) const;
  std::string SlotName(int64_t k) const;
  std::vector<std::string> SlotNames() const;
  // Each slot of `capture` against the fp32 goldens within goldens.h's fp32
  // bound (kRelTol, kAbsTol); returns the errors, slot by slot.
  std::vector<Err> ExpectMatchesFp32(const std::vector<float>& capture, const std::string& what);
  // ASSERTs that the goldens store the tokens either side of every cut.
  void ExpectRowsAround(const std::vector<int32_t>& cuts) const;
  // The CPU engine's one-pass capture of the batch (computed once a model).
  const std::vector<float>& OnePass();

  LongGoldens goldens_;
  Loaded loaded_;
  LongBatch batch_;
  int64_t h_ = 0, k_ = 0;
};

// The table goldens_test prints, one row per slot.
std::string ErrTable(const std::string& model, const std::string& what,
                     const std::vector<std::string>& slots, const std::vector<Err>& errs);

}  // namespace draftfeed::testing
