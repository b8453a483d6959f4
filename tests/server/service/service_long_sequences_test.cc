// Long sequences end to end over gRPC through the C++ client: a target whose
// forward takes 128 tokens serves batches of up to --max_sequence_tokens in
// chunks, streaming each chunk's rows as it finishes, and the client gets the
// same bytes (hidden states and target outputs) and checksum as one forward
// of the whole batch. Over the limit, the error names both numbers and the
// flag; a target without chunking still says to split the batch.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "common/payload_checksum.h"
#include "draftfeed/client.h"
#include "tests/server/service/loopback_target.h"
#include "tests/server/service/test_tokens.h"

namespace draftfeed {
namespace {

using Server = testing::LoopbackTarget;
using testing::RandomTokens;

ServiceOptions ChunkingOptions() {
  ServiceOptions o;
  o.max_batch_tokens = 128;
  o.max_sequence_tokens = 4096;
  return o;
}

TEST(ServiceLongSequences, ABatchOverOneForwardArrivesWholeAndExact) {
  for (const char* spec : {"tiny-random:0", "tiny-random-qwen3-moe:0"}) {
    SCOPED_TRACE(spec);
    Server server(ChunkingOptions(), spec);
    const ModelConfig& c = server.model().config;
    FeedOptions opt;
    opt.targets = {server.address()};
    opt.layers = {0, 2, -1};
    opt.target_outputs = {.argmax = true, .top_k = 4};
    auto feed = Feed::Open(opt);
    ASSERT_TRUE(feed.ok()) << feed.status();
    EXPECT_EQ((*feed)->target().max_batch_tokens, 128);
    EXPECT_EQ((*feed)->target().max_sequence_tokens, 4096);
    // A 1,000-token sequence between short ones: nine forwards.
    const std::vector<int32_t> lens = {30, 1000, 7};
    const std::vector<int32_t> tokens = RandomTokens(1037, static_cast<int>(c.vocab_size), 9);
    ASSERT_TRUE((*feed)->Submit(tokens, lens).ok());
    absl::StatusOr<HiddenBatch> b = (*feed)->Next();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(b->num_tokens, 1037);

    const TargetOutputs o{.argmax = true, .top_k = 4};
    const std::vector<int32_t> layers = {0, 2, -1};
    ForwardInput in{tokens, lens, layers};
    in.outputs = &o;
    std::vector<std::byte> want(CaptureBytes(c, in));
    ASSERT_TRUE(server.engine().Forward(in, want).ok());  // one pass: the engine has no budget
    ASSERT_EQ(b->num_bytes, want.size());
    EXPECT_EQ(std::memcmp(b->bytes().data(), want.data(), want.size()), 0);
    EXPECT_EQ(b->checksum, v1::PayloadChecksum(want.data(), want.size()));
    // The stream goes on: a short batch after the long one.
    ASSERT_TRUE((*feed)->Submit(std::vector<int32_t>(tokens.begin(), tokens.begin() + 50), {50})
                    .ok());
    ASSERT_TRUE((*feed)->Next().ok());
  }
}

TEST(ServiceLongSequences, OverTheLimitTheErrorNamesBothNumbersAndTheFlag) {
  Server server(ChunkingOptions());
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = {-1};
  auto feed = Feed::Open(opt);
  ASSERT_TRUE(feed.ok()) << feed.status();
  const std::vector<int32_t> tokens = RandomTokens(4097, 4096, 2);
  ASSERT_TRUE((*feed)->Submit(tokens, {4000, 97}).ok());
  absl::StatusOr<HiddenBatch> b = (*feed)->Next();
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EXPECT_NE(b.status().message().find("it has 4097 tokens, over this target's 4096 "
                                      "(--max_sequence_tokens"),
            std::string::npos)
      << b.status();
  // The target keeps serving the stream.
  ASSERT_TRUE((*feed)->Submit(std::vector<int32_t>(tokens.begin(), tokens.begin() + 300), {300})
                  .ok());
  EXPECT_TRUE((*feed)->Next().ok());
}

TEST(ServiceLongSequences, WithoutChunkingTheBudgetIsTheLimit) {
  ServiceOptions o;
  o.max_batch_tokens = 128;  // max_sequence_tokens 0: no chunked prefill
  Server server(o);
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = {-1};
  auto feed = Feed::Open(opt);
  ASSERT_TRUE(feed.ok()) << feed.status();
  EXPECT_EQ((*feed)->target().max_sequence_tokens, 128);
  ASSERT_TRUE((*feed)->Submit(RandomTokens(129, 4096, 2), {129}).ok());
  absl::StatusOr<HiddenBatch> b = (*feed)->Next();
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("--max_batch_tokens of 128"), std::string::npos)
      << b.status();
}

}  // namespace
}  // namespace draftfeed
