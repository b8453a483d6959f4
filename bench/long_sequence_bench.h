// draftfeed-bench's long-sequence mode (chunked prefill):
//
//   draftfeed-bench long --model random:qwen3.6-27b --sequence_tokens 131072
//       --forward_tokens 16384 [--one_pass]
//
// One sequence of --sequence_tokens run as the target runs it: forwards of
// at most --forward_tokens (PlanForwardChunks), the engine carrying the
// sequence's K/V and GDN state between them. Prints the median tokens/s and,
// from a profiled run, each op family's share and attention's TFLOP/s
// (causal: 2·hd·Hq·N² per attention layer). --one_pass also runs the whole
// sequence in one forward (the engine's workspace sized for it) in the same
// process and prints chunked / one-pass.
#pragma once

#include <cstdint>
#include <string>

namespace draftfeed::bench {

struct LongSequenceOptions {
  std::string model;
  int64_t sequence_tokens = 131072;
  int64_t forward_tokens = 16384;
  int capture = 5;
  int iters = 3;
  int device = 0;
  bool one_pass = false;
};
int RunLongSequenceBench(const LongSequenceOptions& options);

}  // namespace draftfeed::bench
