// The goldens suite (goldens.h) on packed batches: every golden sequence packed
// with the others gives its states alone, bit for bit, and within the fp32
// bound of the goldens.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "tests/server/model/goldens.h"

namespace draftfeed::testing {
namespace {

// All sequences packed in one batch (in both orders, so each lands at other
// offsets and next to other neighbours) give each sequence's states alone, bit
// for bit: every op of the CPU engine is row-local (GEMM tiles run the same
// instruction sequence for every row, norms and gates per token) or per
// sequence with a fixed summation order (attention rows, conv taps, delta rule
// per (sequence, head), chunks starting at each sequence's first token), and
// threads split only rows/heads, never a reduction.
TEST_P(GoldensTest, PackedBatchEqualsSequencesAlone) {
  const std::vector<int32_t> ids = AllLayers(n_);
  const int64_t k_total = n_ + 1;
  std::vector<std::vector<float>> alone;
  for (const GoldenSeq& s : goldens_.seqs) {
    const std::vector<int32_t> lens = {static_cast<int32_t>(s.ids.size())};
    absl::StatusOr<std::vector<float>> out = RunFloat(engine(), s.ids, lens, ids);
    ASSERT_TRUE(out.ok()) << out.status();
    alone.push_back(*std::move(out));
  }
  for (const bool reversed : {false, true}) {
    std::vector<size_t> order(goldens_.seqs.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = reversed ? order.size() - 1 - i : i;
    std::vector<int32_t> tokens, lens;
    for (size_t i : order) {
      const GoldenSeq& s = goldens_.seqs[i];
      tokens.insert(tokens.end(), s.ids.begin(), s.ids.end());
      lens.push_back(static_cast<int32_t>(s.ids.size()));
    }
    absl::StatusOr<std::vector<float>> packed = RunFloat(engine(), tokens, lens, ids);
    ASSERT_TRUE(packed.ok()) << packed.status();
    size_t offset = 0;  // in elements of the [T, K, H] output
    for (size_t i : order) {
      const GoldenSeq& s = goldens_.seqs[i];
      const int64_t t = static_cast<int64_t>(s.ids.size());
      const size_t n = static_cast<size_t>(t * k_total * h_);
      const std::vector<float> slice(packed->begin() + offset, packed->begin() + offset + n);
      offset += n;
      size_t mismatches = 0;
      for (size_t e = 0; e < n; ++e) {
        if (std::memcmp(&slice[e], &alone[i][e], sizeof(float)) != 0 && mismatches++ == 0) {
          const int64_t tok = e / (k_total * h_), k = (e / h_) % k_total;
          ADD_FAILURE() << GetParam() << (reversed ? " reversed" : "") << " packed seq" << i
                        << " first differs at token " << tok << ", " << SlotName(k) << ": "
                        << slice[e] << " vs alone " << alone[i][e];
        }
      }
      EXPECT_EQ(mismatches, 0u) << "seq" << i << " of " << n << " values";
      for (int64_t k = 0; k < k_total; ++k) {
        const Err e = Compare(Layer(slice, t, k_total, k, h_), Golden(s, k), h_);
        EXPECT_TRUE(e.Within(kRelTol, kAbsTol))
            << "packed seq" << i << " " << SlotName(k) << ": " << Describe(e);
      }
    }
  }
}

}  // namespace
}  // namespace draftfeed::testing
