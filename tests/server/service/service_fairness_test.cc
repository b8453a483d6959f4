// Streams that share a target cannot hurt one another: the scheduler takes
// batches fairly across streams whatever one of them queues; a stream whose
// results wait unread stops being scheduled while the others run on; the
// number of open streams is bounded; and idle streams are ended. The order
// assertions read the order the engine ran batches in (a gated engine holds
// them back until every stream has queued), never timings.
#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "tests/server/service/gated_target.h"
#include "tests/server/service/loopback_target.h"

namespace draftfeed {
namespace {

using testing::GatedTarget;
using testing::OpenFor;
using Clock = std::chrono::steady_clock;

constexpr int32_t kHostile = 1;  // first token id of a hostile stream's batches
constexpr int32_t kHealthy = 2;  // ... and of a healthy one's

// A channel whose receive window stays small, so results the client does not
// read back up into the target after a few kilobytes.
std::shared_ptr<grpc::Channel> SmallWindowChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

// One raw StreamHiddenStates call with a deadline, so that a test of a
// missing bound fails instead of hanging.
struct RawStream {
  RawStream(std::shared_ptr<grpc::Channel> channel, int deadline_s = 60)
      : stub(v1::TargetService::NewStub(std::move(channel))) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
    stream = stub->StreamHiddenStates(&ctx);
  }
  bool Open(std::vector<int32_t> layers, int32_t credits) {
    v1::StreamRequest req;
    *req.mutable_open() = OpenFor(std::move(layers));
    req.mutable_open()->set_max_inflight_batches(credits);
    return stream->Write(req);
  }
  // A batch of `tokens` tokens (sequences of at most 500) whose first token
  // id is `mark`.
  bool Send(uint64_t id, int32_t mark, int tokens) {
    v1::StreamRequest req;
    v1::Batch* b = req.mutable_batch();
    b->set_batch_id(id);
    b->add_token_ids(mark);
    for (int i = 1; i < tokens; ++i) b->add_token_ids(i % 4096);
    for (int left = tokens; left > 0; left -= 500) b->add_seq_lens(std::min(left, 500));
    return stream->Write(req);
  }
  // Reads up to the next BatchDone or BatchError; the batch id, or 0 when
  // the stream ended first. Counts payload bytes.
  uint64_t ReadBatch(int64_t* payload = nullptr) {
    v1::StreamResponse r;
    while (stream->Read(&r)) {
      if (r.has_chunk() && payload != nullptr) *payload += r.chunk().data().size();
      if (r.has_done()) return r.done().batch_id();
      if (r.has_error()) return r.error().batch_id();
    }
    return 0;
  }
  bool ReadOpened() {
    v1::StreamResponse r;
    return stream->Read(&r) && r.has_opened();
  }
  grpc::Status Close() {
    stream->WritesDone();
    v1::StreamResponse r;
    while (stream->Read(&r)) {
    }
    return stream->Finish();
  }

  std::unique_ptr<v1::TargetService::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream;
};

std::shared_ptr<grpc::Channel> PlainChannel(const std::string& address) {
  return grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

// Polls `done` for up to `limit`; true once it holds.
template <typename F>
bool Eventually(F done, std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto deadline = Clock::now() + limit;
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

std::vector<size_t> PositionsOf(const std::vector<int32_t>& order, int32_t mark) {
  std::vector<size_t> at;
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i] == mark) at.push_back(i);
  }
  return at;
}

// A stream that never reads queues its 32 credits of batches ahead of a
// healthy stream's 4. First come, first served would run all 32 first; fair
// scheduling by tokens alternates the two streams (equal batch sizes), so
// the healthy stream's n-th batch (from 0) runs at position 2n + 1 at the
// latest: behind one hostile batch per healthy one.
TEST(FairnessTest, HealthyStreamIsNotQueuedBehindANonReadingNeighbour) {
  GatedTarget target;
  const Scheduler& sched = target.service().scheduler();
  target.engine().Shut();
  RawStream hostile(SmallWindowChannel(target.address()));
  ASSERT_TRUE(hostile.Open({-1}, 32));
  for (uint64_t id = 1; id <= 32; ++id) ASSERT_TRUE(hostile.Send(id, kHostile, 256));
  // The first hostile batch is in the (shut) engine, the other 31 queued.
  ASSERT_TRUE(target.engine().WaitForForwards(1));
  ASSERT_TRUE(Eventually([&] { return sched.queued() == 31; })) << sched.queued();

  RawStream healthy(PlainChannel(target.address()));
  ASSERT_TRUE(healthy.Open({-1}, 4));
  ASSERT_TRUE(healthy.ReadOpened());
  for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(healthy.Send(id, kHealthy, 256));
  ASSERT_TRUE(Eventually([&] { return sched.queued() == 35; })) << sched.queued();
  target.engine().Open();

  for (uint64_t id = 1; id <= 4; ++id) {
    int64_t payload = 0;
    ASSERT_EQ(healthy.ReadBatch(&payload), id);
    EXPECT_EQ(payload, 256 * target.model().config.hidden_size * 2);
  }
  EXPECT_TRUE(healthy.Close().ok());
  const std::vector<size_t> at = PositionsOf(target.engine().order(), kHealthy);
  ASSERT_EQ(at.size(), 4u);
  for (size_t n = 0; n < at.size(); ++n) {
    EXPECT_LE(at[n], 2 * n + 1) << "healthy batch " << n << " ran behind " << at[n] - n
                                << " hostile batches";
  }
  hostile.ctx.TryCancel();
}

// A stream that stops reading may hold at most --max_stream_pending_mib of
// results: at the cap its batches wait (it has credits for 8, the cap is 2
// batches' bytes) while another stream's 8 batches all run and arrive. When
// it reads again, the rest of its batches run and arrive too.
TEST(FairnessTest, PendingCapStallsOnlyTheStreamThatDoesNotRead) {
  constexpr int kTokens = 1000, kBatches = 8;
  const std::vector<int32_t> layers = {0, 1, 2, 3, -1};
  const int64_t batch_bytes = int64_t{kTokens} * 5 * 128 * 2;  // 1.28 MB
  ServiceOptions options;
  options.max_stream_pending_bytes = 2 * batch_bytes;
  GatedTarget target(options);
  ASSERT_EQ(target.model().config.hidden_size, 128);

  RawStream stalled(SmallWindowChannel(target.address()));
  ASSERT_TRUE(stalled.Open(layers, kBatches));
  for (uint64_t id = 1; id <= kBatches; ++id) ASSERT_TRUE(stalled.Send(id, kHostile, kTokens));
  ASSERT_TRUE(
      Eventually([&] { return PositionsOf(target.engine().order(), kHostile).size() >= 2; }));

  RawStream healthy(PlainChannel(target.address()));
  ASSERT_TRUE(healthy.Open(layers, 2));
  std::thread sender([&] {
    for (uint64_t id = 1; id <= kBatches; ++id) healthy.Send(id, kHealthy, kTokens);
    healthy.stream->WritesDone();
  });
  ASSERT_TRUE(healthy.ReadOpened());
  for (uint64_t id = 1; id <= kBatches; ++id) {
    int64_t payload = 0;
    ASSERT_EQ(healthy.ReadBatch(&payload), id);
    EXPECT_EQ(payload, batch_bytes);
  }
  sender.join();
  EXPECT_TRUE(healthy.stream->Finish().ok());
  // 2 batches up to the cap, and at most one more whose bytes all fit in
  // the transport's buffers (so counted as written).
  const size_t stalled_runs = PositionsOf(target.engine().order(), kHostile).size();
  EXPECT_LE(stalled_runs, 3u) << "the unread stream kept being scheduled past its cap";

  ASSERT_TRUE(stalled.ReadOpened());
  for (uint64_t id = 1; id <= kBatches; ++id) {
    int64_t payload = 0;
    ASSERT_EQ(stalled.ReadBatch(&payload), id);
    EXPECT_EQ(payload, batch_bytes);
  }
  EXPECT_TRUE(stalled.Close().ok());
}

TEST(FairnessTest, OpenStreamsAreLimited) {
  ServiceOptions options;
  options.max_streams = 2;
  testing::LoopbackTarget server(options);
  RawStream a(PlainChannel(server.address()), 20), b(PlainChannel(server.address()), 20);
  ASSERT_TRUE(a.Open({-1}, 1));
  ASSERT_TRUE(a.ReadOpened());
  ASSERT_TRUE(b.Open({-1}, 1));
  ASSERT_TRUE(b.ReadOpened());

  RawStream refused(PlainChannel(server.address()), 20);
  refused.Open({-1}, 1);
  EXPECT_FALSE(refused.ReadOpened()) << "a third stream was served beside a limit of 2";
  const grpc::Status st = refused.stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find("--max_streams=2"), std::string::npos) << st.error_message();

  // Closing a stream frees its slot.
  EXPECT_TRUE(a.Close().ok());
  ASSERT_TRUE(Eventually([&] { return server.service().open_streams() <= 1; }));
  RawStream next(PlainChannel(server.address()), 20);
  ASSERT_TRUE(next.Open({-1}, 1));
  EXPECT_TRUE(next.ReadOpened());
  EXPECT_TRUE(next.Close().ok());
  EXPECT_TRUE(b.Close().ok());
}

// With --stream_idle_timeout_s=0.5: a stream that sends nothing and has
// nothing to read is ended with DEADLINE_EXCEEDED naming the flag; one that
// never reads its results is ended and everything it held is freed; one
// waiting on its own batch in a busy engine, and one reading a large result
// slowly, are not idle and finish normally.
TEST(FairnessTest, IdleStreamsAreEnded) {
  ServiceOptions options;
  options.stream_idle_timeout_s = 0.5;
  options.chunk_bytes = 512 << 10;
  GatedTarget target(options);
  const std::vector<int32_t> layers = {0, 1, 2, 3, -1};

  {
    RawStream quiet(PlainChannel(target.address()), 20);
    ASSERT_TRUE(quiet.Open({-1}, 1));
    ASSERT_TRUE(quiet.ReadOpened());
    v1::StreamResponse r;
    EXPECT_FALSE(quiet.stream->Read(&r));
    const grpc::Status st = quiet.stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
    EXPECT_NE(st.error_message().find("--stream_idle_timeout_s"), std::string::npos)
        << st.error_message();
  }
  {
    RawStream unread(SmallWindowChannel(target.address()), 120);  // outlives the wait below
    ASSERT_TRUE(unread.Open(layers, 4));
    for (uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(unread.Send(id, kHostile, 4000));
    // Once a result waits unwritten the stream is idle; what it had queued
    // is cancelled, not run.
    ASSERT_TRUE(target.engine().WaitForForwards(1));
    const HostBufferPool& pool = target.service().scheduler().pool();
    EXPECT_TRUE(Eventually([&] {
      return target.service().open_streams() == 0 && pool.live_bytes() == 0;
    })) << target.service().open_streams()
        << " streams open, " << pool.live_bytes() << " capture bytes live";
    unread.ctx.TryCancel();
  }
  {
    // Waiting for its own batch: the engine is shut for 4 idle periods.
    RawStream waiting(PlainChannel(target.address()), 20);
    target.engine().Shut();
    const size_t before = target.engine().order().size();
    ASSERT_TRUE(waiting.Open({-1}, 1));
    ASSERT_TRUE(waiting.ReadOpened());
    ASSERT_TRUE(waiting.Send(1, kHealthy, 100));
    ASSERT_TRUE(target.engine().WaitForForwards(before + 1));
    std::this_thread::sleep_for(std::chrono::seconds(2));
    target.engine().Open();
    EXPECT_EQ(waiting.ReadBatch(), 1u);
    EXPECT_TRUE(waiting.Close().ok());
  }
  {
    // Reading a 5 MB result (10 chunks) one chunk per 0.2 s.
    RawStream slow(SmallWindowChannel(target.address()), 30);
    ASSERT_TRUE(slow.Open(layers, 1));
    ASSERT_TRUE(slow.ReadOpened());
    ASSERT_TRUE(slow.Send(1, kHealthy, 4000));
    ASSERT_TRUE(slow.stream->WritesDone());
    v1::StreamResponse r;
    int64_t payload = 0;
    bool done = false;
    while (!done && slow.stream->Read(&r)) {
      if (r.has_chunk()) payload += r.chunk().data().size();
      done = r.has_done();
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    EXPECT_TRUE(done);
    EXPECT_EQ(payload, int64_t{4000} * 5 * 128 * 2);
    EXPECT_FALSE(slow.stream->Read(&r));
    const grpc::Status st = slow.stream->Finish();
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
}

}  // namespace
}  // namespace draftfeed
