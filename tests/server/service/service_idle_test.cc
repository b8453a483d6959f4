// --stream_idle_timeout_s ends a stream on which nothing moves, and only
// that (issue 30): against the draftfeed-target binary with a 2 s timeout, a
// client that reads one message every 1.5 s, for far longer than 2 s in all,
// gets every batch and an OK status; one that stops reading is still cut.
// The client is a raw stub on a plain channel, so that its reads are exactly
// as slow as the test says.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/payload_checksum.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "tests/server/service/loopback_target.h"
#include "tests/server/service/target_process.h"

namespace draftfeed {
namespace {

using testing::OpenFor;
using testing::TargetProcess;

// 5 layers x 128 x 2 bytes a token: a batch is 2.5 MB, sent as two chunks of
// 1000 tokens and its BatchDone. A few of them outgrow the client's HTTP/2
// window, so the target's writes wait on the client's reads.
constexpr int kTokens = 2000;
constexpr size_t kPayloadBytes = size_t{kTokens} * 1280;
const std::vector<std::string> kFlags = {"--stream_idle_timeout_s=2", "--chunk_bytes=1280000"};

struct Stream {
  explicit Stream(const std::string& address)
      : stub(v1::TargetService::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
    // A missing bound fails the test instead of hanging it.
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    stream = stub->StreamHiddenStates(&ctx);
  }
  // Opens (every layer, a credit per batch) and sends `batches` batches.
  bool OpenAndSend(int batches) {
    v1::StreamRequest open;
    *open.mutable_open() = OpenFor({0, 1, 2, 3, -1});
    open.mutable_open()->set_max_inflight_batches(batches);
    if (!stream->Write(open)) return false;
    for (int id = 1; id <= batches; ++id) {
      v1::StreamRequest req;
      v1::Batch* b = req.mutable_batch();
      b->set_batch_id(static_cast<uint64_t>(id));
      for (int i = 0; i < kTokens; ++i) b->add_token_ids((id * 131 + i * 7) % 4096);
      for (int left = kTokens; left > 0; left -= 500) b->add_seq_lens(500);
      if (!stream->Write(req)) return false;
    }
    return true;
  }

  std::unique_ptr<v1::TargetService::Stub> stub;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>> stream;
};

// What a client read off a stream: the messages, the batches whose whole
// payload matched their BatchDone's checksum, and how the stream ended.
struct Received {
  int messages = 0;
  int batches_done = 0;
  grpc::Status status;
};

// Reads to the end of the stream, sleeping `pause` before each read.
Received ReadAll(Stream& s, std::chrono::milliseconds pause) {
  Received got;
  std::string payload;
  v1::StreamResponse r;
  for (;;) {
    std::this_thread::sleep_for(pause);
    if (!s.stream->Read(&r)) break;
    ++got.messages;
    if (r.has_chunk()) payload += r.chunk().data();
    if (r.has_done()) {
      if (payload.size() == kPayloadBytes &&
          r.done().checksum() == v1::PayloadChecksum(payload.data(), payload.size())) {
        ++got.batches_done;
      }
      payload.clear();
    }
  }
  got.status = s.stream->Finish();
  return got;
}

class IdleTest : public ::testing::Test {
 protected:
  IdleTest() : target_(kFlags, ::testing::UnitTest::GetInstance()->current_test_info()->name()) {}
  void SetUp() override {
    ASSERT_FALSE(target_.address().empty()) << "draftfeed-target did not start";
  }
  TargetProcess target_;
};

// Opened, then 2 chunks and a BatchDone for each of 4 batches: 13 messages,
// one per 1.5 s, some 20 s of reading. The client reads several chunks from
// its window between two of the target's completed writes (3.5 s apart on
// the machine this was written on), so a clock that a completed write alone
// resets ended the stream after its third batch.
TEST_F(IdleTest, ASlowReaderIsServedInFull) {
  constexpr int kBatches = 4;
  Stream s(target_.address());
  ASSERT_TRUE(s.OpenAndSend(kBatches));
  ASSERT_TRUE(s.stream->WritesDone());
  const Received got = ReadAll(s, std::chrono::milliseconds(1500));
  EXPECT_TRUE(got.status.ok()) << got.status.error_code() << ": " << got.status.error_message();
  EXPECT_EQ(got.messages, 1 + kBatches * 3);
  EXPECT_EQ(got.batches_done, kBatches);
}

// A client that reads nothing after Opened is cut, its target-side write
// pending: within 4 timeouts (8 s; the check runs every 0.5 s), so when it
// comes back 14 s later the call has ended short of its batches, cancelled
// (not even a status could reach it) or DEADLINE_EXCEEDED naming the flag.
TEST_F(IdleTest, AClientThatStopsReadingIsCut) {
  constexpr int kBatches = 8;
  Stream s(target_.address());
  ASSERT_TRUE(s.OpenAndSend(kBatches));
  v1::StreamResponse opened;
  ASSERT_TRUE(s.stream->Read(&opened));
  ASSERT_TRUE(opened.has_opened());
  std::this_thread::sleep_for(std::chrono::seconds(14));
  const Received got = ReadAll(s, std::chrono::milliseconds(0));
  EXPECT_LT(got.batches_done, kBatches);
  if (got.status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    EXPECT_NE(got.status.error_message().find("--stream_idle_timeout_s"), std::string::npos)
        << got.status.error_message();
  } else {
    EXPECT_EQ(got.status.error_code(), grpc::StatusCode::CANCELLED)
        << got.status.error_message();
  }
}

}  // namespace
}  // namespace draftfeed
