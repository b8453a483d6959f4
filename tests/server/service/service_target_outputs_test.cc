// Target outputs end to end over gRPC through the C++ client: each token's argmax, top-k and
// draft probabilities reach HiddenBatch's accessors as the engine wrote them (the whole row,
// byte for byte, under the batch's checksum), beside the hidden states; GetTargetInfo offers
// them; an Open asking what the target cannot do is refused naming the field.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "common/payload_checksum.h"
#include "draftfeed/client.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "server/service/stream_open.h"
#include "tests/server/service/loopback_target.h"
#include "tests/server/service/test_tokens.h"

namespace draftfeed {
namespace {

using Server = testing::LoopbackTarget;
using testing::RandomTokens;

TEST(ServiceTargetOutputs, RowsReachTheClientAsTheEngineWroteThem) {
  Server server;
  const ModelConfig& c = server.model().config;
  std::vector<int32_t> draft(200);
  std::iota(draft.begin(), draft.end(), 1000);
  std::reverse(draft.begin(), draft.end());
  for (Encoding probs : {Encoding::kBf16, Encoding::kFp8E4m3}) {
    FeedOptions opt;
    opt.targets = {server.address()};
    opt.layers = {1, -1};
    opt.target_outputs = {.argmax = true, .top_k = 6, .draft_vocab = draft,
                          .probs_encoding = probs};
    auto feed = Feed::Open(opt);
    ASSERT_TRUE(feed.ok()) << feed.status();
    EXPECT_EQ((*feed)->target().target_outputs.max_top_k, 256);
    EXPECT_EQ((*feed)->target().target_outputs.max_draft_vocab, 4096);
    const std::vector<int32_t> tokens = RandomTokens(77, c.vocab_size, 5), lens = {40, 37};
    ASSERT_TRUE((*feed)->Submit(tokens, lens).ok());
    absl::StatusOr<HiddenBatch> b = (*feed)->Next();
    ASSERT_TRUE(b.ok()) << b.status();

    const TargetOutputs o{.argmax = true, .top_k = 6, .draft_vocab = draft,
                          .probs_encoding = static_cast<CaptureEncoding>(probs)};
    const std::vector<int32_t> layers = {1, -1};
    ForwardInput in{tokens, lens, layers};
    in.outputs = &o;
    std::vector<std::byte> want(CaptureBytes(c, in));
    ASSERT_TRUE(server.engine().Forward(in, want).ok());
    ASSERT_EQ(b->num_bytes, want.size());
    EXPECT_EQ(std::memcmp(b->bytes().data(), want.data(), want.size()), 0);
    EXPECT_EQ(b->checksum, v1::PayloadChecksum(want.data(), want.size()));
    const int64_t hidden = 2 * 2 * c.hidden_size;
    EXPECT_EQ(b->outputs.argmax, hidden);
    EXPECT_EQ(b->outputs.num_draft, 200);
    std::vector<int32_t> ids(6);
    std::vector<float> lp(6), p(200);
    for (int64_t t = 0; t < b->num_tokens; ++t) {
      b->top_k(t, ids, lp);
      EXPECT_EQ(b->argmax(t), ids[0]);
      EXPECT_TRUE(std::is_sorted(lp.rbegin(), lp.rend()));
      b->draft_probs(t, p);
      const double sum = std::accumulate(p.begin(), p.end(), 0.0);
      EXPECT_NEAR(sum, 1.0, probs == Encoding::kBf16 ? 200 * 0x1p-9 : 200 * 0x1p-5);
    }
  }
}

TEST(ServiceTargetOutputs, FeedOptionsAreCheckedByName) {
  FeedOptions opt;
  opt.targets = {"127.0.0.1:1"};
  opt.target_outputs.top_k = 257;
  absl::StatusOr<std::unique_ptr<Feed>> feed = Feed::Open(opt);
  ASSERT_FALSE(feed.ok());
  EXPECT_NE(feed.status().message().find("FeedOptions.target_outputs.top_k is 257"),
            std::string::npos)
      << feed.status();
  opt.target_outputs = {.draft_vocab = {3, 3}};
  feed = Feed::Open(opt);
  ASSERT_FALSE(feed.ok());
  EXPECT_NE(feed.status().message().find("lists id 3 twice"), std::string::npos) << feed.status();
}

TEST(ServiceTargetOutputs, OpenIsRefusedNamingTheField) {
  Server server;
  auto stub = v1::TargetService::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  auto refused = [&](v1::Open open) {
    grpc::ClientContext ctx;
    auto stream = stub->StreamHiddenStates(&ctx);
    v1::StreamRequest req;
    *req.mutable_open() = std::move(open);
    stream->Write(req);
    stream->WritesDone();
    v1::StreamResponse r;
    EXPECT_FALSE(stream->Read(&r));
    return stream->Finish();
  };
  v1::Open open = testing::OpenFor({1});
  open.mutable_target_outputs()->add_draft_vocab(5000);
  grpc::Status s = refused(open);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("target_outputs.draft_vocab[0] is 5000, outside the target's "
                                   "vocabulary [0, 4096)"),
            std::string::npos)
      << s.error_message();
  open = testing::OpenFor({});
  open.mutable_target_outputs()->set_top_k(300);
  s = refused(open);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("top_k is 300"), std::string::npos) << s.error_message();
  open = testing::OpenFor({1});
  open.mutable_target_outputs()->set_argmax(true);
  open.mutable_target_outputs()->set_draft_probs_encoding(static_cast<v1::Encoding>(3));
  s = refused(open);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("draft_probs_encoding unknown (3)"), std::string::npos)
      << s.error_message();
  // Neither layers nor outputs: the old error, now saying outputs would do.
  s = refused(testing::OpenFor({}));
  EXPECT_NE(s.error_message().find("no target outputs are asked"), std::string::npos);
}

TEST(ServiceTargetOutputs, ATargetWithoutLmHeadSaysSoAndRefusesThem) {
  auto model = OpenModel("tiny-random:4");
  ASSERT_TRUE(model.ok());
  (*model)->weights.lm_head = Tensor{};
  auto engine = CpuEngine::Create(model->get(), 1);
  ASSERT_TRUE(engine.ok());
  TargetService service({engine->get()}, ServiceOptions{});
  EXPECT_FALSE(service.Info().has_target_outputs());
  v1::Open open = testing::OpenFor({1});
  open.mutable_target_outputs()->set_argmax(true);
  absl::StatusOr<StreamPlan> plan = PlanStream(service.stream_context(), open);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("has no lm_head"), std::string::npos) << plan.status();
  // Hidden states alone still are served.
  EXPECT_TRUE(PlanStream(service.stream_context(), testing::OpenFor({1})).ok());
  service.StopScheduler();
}

}  // namespace
}  // namespace draftfeed
