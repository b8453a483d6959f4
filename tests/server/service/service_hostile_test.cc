// Hostile clients: whatever a stream sends, and however little it reads, the
// target holds a bounded number of responses for it and keeps serving others.
#include <grpc/grpc.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "server/service/auth_tokens.h"
#include "tests/server/service/loopback_target.h"
#include "tests/server/service/test_tokens.h"

namespace draftfeed {
namespace {

using Server = testing::LoopbackTarget;
using testing::OpenFor;
using Stream = grpc::ClientReaderWriter<v1::StreamRequest, v1::StreamResponse>;

// A channel whose receive window stays small (no BDP growth), so responses
// the client does not read back up into the target after a few kilobytes
// instead of filling megabytes of transport buffers first.
std::shared_ptr<grpc::Channel> SmallWindowChannel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

// Waits until `count` stops moving for `quiet` or reaches `goal`.
void WaitUntilStill(const std::atomic<int>& count, int goal, std::chrono::milliseconds quiet) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int last = -1;
  while (count.load() < goal && std::chrono::steady_clock::now() < deadline) {
    const int now = count.load();
    if (now == last) return;
    last = now;
    std::this_thread::sleep_for(quiet);
  }
}

// A stream that sends only invalid batches (each rejected at once, taking no
// forward) and never reads. Every rejection is a BatchError the target must
// hold until it is written; were reading to go on regardless, 10,000 empty
// batches would queue thousands of them. The bound: the stream's credits
// (unsent errors count against the window) plus the Opened message.
TEST(HostileClientTest, UnreadErrorsOfInvalidBatchesStayWithinTheCredits) {
  ServiceOptions options;
  options.max_rejects_per_s = 0;  // the credits alone bound it (the rate has its own test)
  Server server(options);
  constexpr int kCredits = 4, kBatches = 10000;
  auto stub = v1::TargetService::NewStub(SmallWindowChannel(server.address()));
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream = stub->StreamHiddenStates(&ctx);
  v1::StreamRequest open;
  *open.mutable_open() = OpenFor({0, -1});
  open.mutable_open()->set_max_inflight_batches(kCredits);
  ASSERT_TRUE(stream->Write(open));

  std::atomic<int> sent{0};
  std::thread writer([&] {
    for (int id = 1; id <= kBatches; ++id) {
      v1::StreamRequest req;
      req.mutable_batch()->set_batch_id(static_cast<uint64_t>(id));  // no tokens: invalid
      if (!stream->Write(req)) return;
      ++sent;
    }
    stream->WritesDone();
  });
  // Once the target stops reading, the writer blocks on flow control.
  WaitUntilStill(sent, kBatches, std::chrono::milliseconds(1000));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the target reads what it will
  EXPECT_LE(server.service().peak_queued_responses(), kCredits + 1)
      << sent.load() << " batches sent unread";

  // The client reads at last: every error arrives, in order, and the stream
  // ends cleanly.
  v1::StreamResponse r;
  ASSERT_TRUE(stream->Read(&r));
  ASSERT_TRUE(r.has_opened());
  for (int id = 1; id <= kBatches; ++id) {
    ASSERT_TRUE(stream->Read(&r)) << "batch " << id;
    ASSERT_TRUE(r.has_error()) << "batch " << id;
    ASSERT_EQ(r.error().batch_id(), static_cast<uint64_t>(id));
    ASSERT_EQ(r.error().code(), static_cast<int32_t>(absl::StatusCode::kInvalidArgument));
    ASSERT_NE(r.error().message().find("empty batch"), std::string::npos) << r.error().message();
  }
  writer.join();
  EXPECT_FALSE(stream->Read(&r));
  grpc::Status st = stream->Finish();
  EXPECT_TRUE(st.ok()) << st.error_message();
  EXPECT_LE(server.service().peak_queued_responses(), kCredits + 1);

  // The target still serves a well-behaved stream.
  auto stub2 = v1::TargetService::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx2;
  std::unique_ptr<Stream> good = stub2->StreamHiddenStates(&ctx2);
  *open.mutable_open() = OpenFor({-1});
  ASSERT_TRUE(good->Write(open));
  v1::StreamRequest req;
  req.mutable_batch()->set_batch_id(7);
  const std::vector<int32_t> tokens = testing::RandomTokens(12, 4096, 5);
  req.mutable_batch()->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  req.mutable_batch()->add_seq_lens(12);
  ASSERT_TRUE(good->Write(req));
  good->WritesDone();
  ASSERT_TRUE(good->Read(&r));
  ASSERT_TRUE(r.has_opened());
  int64_t payload = 0;
  while (good->Read(&r) && r.has_chunk()) payload += static_cast<int64_t>(r.chunk().data().size());
  ASSERT_TRUE(r.has_done());
  EXPECT_EQ(r.done().batch_id(), 7u);
  EXPECT_EQ(r.done().tokens(), 12);
  EXPECT_EQ(payload, 12 * server.model().config.hidden_size * 2);
  EXPECT_TRUE(good->Finish().ok());
}

// A stream that floods invalid batches and reads every error: the credits do
// not hold it back (each error is written at once), so without a rate the
// target would read and refuse as fast as the client sends, a core's worth
// of work that no fair queue sees. Past a burst the stream's reads pause;
// every error still arrives, in order, and a well-behaved stream is served.
TEST(HostileClientTest, AFloodOfInvalidBatchesIsReadAtTheRejectRate) {
  ServiceOptions options;
  options.max_rejects_per_s = 400;
  Server server(options);
  constexpr int kBatches = 200;  // 32 at once, then 168 at 400/s: ~0.4 s
  auto stub = v1::TargetService::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  std::unique_ptr<Stream> stream = stub->StreamHiddenStates(&ctx);
  v1::StreamRequest open;
  *open.mutable_open() = OpenFor({0, -1});
  open.mutable_open()->set_max_inflight_batches(32);
  ASSERT_TRUE(stream->Write(open));
  std::thread writer([&] {
    for (int id = 1; id <= kBatches; ++id) {
      v1::StreamRequest req;
      req.mutable_batch()->set_batch_id(static_cast<uint64_t>(id));  // no tokens: invalid
      if (!stream->Write(req)) return;
    }
    stream->WritesDone();
  });
  v1::StreamResponse r;
  ASSERT_TRUE(stream->Read(&r));
  ASSERT_TRUE(r.has_opened());
  for (int id = 1; id <= kBatches; ++id) {
    ASSERT_TRUE(stream->Read(&r)) << "batch " << id;
    ASSERT_TRUE(r.has_error()) << "batch " << id;
    ASSERT_EQ(r.error().batch_id(), static_cast<uint64_t>(id));
    if (id == kBatches / 2) {
      // Mid-flood: the stream has paused at least once.
      int64_t pauses = 0;
      for (const StreamLoad& l : server.service().StreamLoads()) pauses += l.reject_pauses;
      EXPECT_GT(pauses, 0) << "the reads of a flooding stream never paused";
    }
  }
  writer.join();
  EXPECT_FALSE(stream->Read(&r));
  EXPECT_TRUE(stream->Finish().ok());
}

// Waits up to 10 s for `done`.
template <typename F>
bool Eventually(F done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// Opens a stream capturing the last layer, sends one 12-token batch and
// reads its result: the stream's status, and the payload bytes it got.
// With `token`, the call carries it as its bearer token.
grpc::Status ServeOneBatch(const std::string& address, int64_t* payload,
                           const std::string& token = "") {
  auto stub =
      v1::TargetService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  std::unique_ptr<Stream> stream = stub->StreamHiddenStates(&ctx);
  v1::StreamRequest req;
  *req.mutable_open() = OpenFor({-1});
  stream->Write(req);
  req.Clear();
  req.mutable_batch()->set_batch_id(1);
  const std::vector<int32_t> tokens = testing::RandomTokens(12, 4096, 9);
  req.mutable_batch()->mutable_token_ids()->Add(tokens.begin(), tokens.end());
  req.mutable_batch()->add_seq_lens(12);
  stream->Write(req);
  stream->WritesDone();
  v1::StreamResponse r;
  *payload = 0;
  while (stream->Read(&r)) {
    if (r.has_chunk()) *payload += static_cast<int64_t>(r.chunk().data().size());
  }
  return stream->Finish();
}

// Streams that never send Open used to count against --max_streams from
// their first byte, so four of them locked every good client out of a
// target of --max_streams 4 until the idle timeout (300 s). A stream counts
// from its Open now, and one that sends none is ended at --open_timeout_s.
TEST(HostileClientTest, SilentStreamsHoldNoSlotAndEndAtTheOpenDeadline) {
  ServiceOptions options;
  options.max_streams = 4;
  options.open_timeout_s = 0.5;
  Server server(options);
  auto channel = grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials());
  auto stub = v1::TargetService::NewStub(channel);
  constexpr int kSilent = 4;
  grpc::ClientContext contexts[kSilent];
  std::unique_ptr<Stream> silent[kSilent];
  for (int i = 0; i < kSilent; ++i) silent[i] = stub->StreamHiddenStates(&contexts[i]);
  ASSERT_TRUE(Eventually([&] { return server.service().StreamLoads().size() == kSilent; }));
  EXPECT_EQ(server.service().open_streams(), 0);

  int64_t payload = 0;
  const grpc::Status good = ServeOneBatch(server.address(), &payload);
  EXPECT_TRUE(good.ok()) << good.error_code() << ": " << good.error_message();
  EXPECT_EQ(payload, 12 * server.model().config.hidden_size * 2);

  for (int i = 0; i < kSilent; ++i) {
    v1::StreamResponse r;
    EXPECT_FALSE(silent[i]->Read(&r));
    const grpc::Status st = silent[i]->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
    EXPECT_EQ(st.error_message(),
              "no Open within 0.5 s of the stream's start (--open_timeout_s=0.5); send Open first");
  }
}

// One client (here: one address) holds at most its share of the streams;
// another client still gets one beside it.
TEST(HostileClientTest, OneClientHoldsAtMostItsShareOfTheStreams) {
  ServiceOptions options;
  options.max_streams = 4;
  options.max_streams_per_client = 2;
  Server server(options);
  auto stub = v1::TargetService::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext a_ctx, b_ctx;
  std::unique_ptr<Stream> a = stub->StreamHiddenStates(&a_ctx);
  std::unique_ptr<Stream> b = stub->StreamHiddenStates(&b_ctx);
  v1::StreamRequest open;
  *open.mutable_open() = OpenFor({-1});
  v1::StreamResponse r;
  for (Stream* s : {a.get(), b.get()}) {
    ASSERT_TRUE(s->Write(open));
    ASSERT_TRUE(s->Read(&r));
    ASSERT_TRUE(r.has_opened());
  }
  int64_t payload = 0;
  const grpc::Status third = ServeOneBatch(server.address(), &payload);
  EXPECT_EQ(third.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(third.error_message(),
            "this target serves at most --max_streams_per_client=2 streams of one client at "
            "once and ipv4:127.0.0.1 has that many open; close one first");
  EXPECT_EQ(payload, 0);
  for (Stream* s : {a.get(), b.get()}) {
    s->WritesDone();
    EXPECT_FALSE(s->Read(&r));
    EXPECT_TRUE(s->Finish().ok());
  }
  ASSERT_TRUE(Eventually([&] { return server.service().open_streams() == 0; }));
  EXPECT_TRUE(ServeOneBatch(server.address(), &payload).ok());
}

// A client holding idle streams up to its cap (opened streams that send
// nothing more, beside silent ones that never send Open) and asking for more
// is refused those, while another client (another bearer token) is served
// beside them: issue 30's "a good client is served beside idle streams at
// the stream cap".
TEST(HostileClientTest, AGoodClientIsServedBesideIdleStreamsAtTheCap) {
  ServiceOptions options;
  options.max_streams = 4;
  options.max_streams_per_client = 2;
  options.tokens = std::make_shared<TokenChecker>(std::vector<NamedToken>{
      {"idle", "idle-token-0123456789abcdef"}, {"good", "good-token-0123456789abcdef"}});
  Server server(options);
  auto stub = v1::TargetService::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  constexpr int kOpened = 5, kSilent = 4;
  grpc::ClientContext contexts[kOpened + kSilent];
  std::unique_ptr<Stream> streams[kOpened + kSilent];
  v1::StreamRequest open;
  *open.mutable_open() = OpenFor({-1});
  int opened = 0, refused = 0;
  for (int i = 0; i < kOpened + kSilent; ++i) {
    contexts[i].AddMetadata("authorization", "Bearer idle-token-0123456789abcdef");
    streams[i] = stub->StreamHiddenStates(&contexts[i]);
    if (i >= kOpened) continue;  // silent: never sends Open
    ASSERT_TRUE(streams[i]->Write(open));
    v1::StreamResponse r;
    if (streams[i]->Read(&r)) {
      ASSERT_TRUE(r.has_opened());
      ++opened;
    } else {
      const grpc::Status st = streams[i]->Finish();
      EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
      ++refused;
    }
  }
  EXPECT_EQ(opened, 2);
  EXPECT_EQ(refused, kOpened - 2);
  ASSERT_TRUE(Eventually([&] { return server.service().StreamLoads().size() == 2 + kSilent; }));
  EXPECT_EQ(server.service().open_streams(), 2);

  for (int round = 0; round < 3; ++round) {
    int64_t payload = 0;
    const grpc::Status good =
        ServeOneBatch(server.address(), &payload, "good-token-0123456789abcdef");
    EXPECT_TRUE(good.ok()) << good.error_code() << ": " << good.error_message();
    EXPECT_EQ(payload, 12 * server.model().config.hidden_size * 2);
  }
  for (int i = 0; i < kOpened + kSilent; ++i) contexts[i].TryCancel();
}

// Open.client_name lands in log lines and metric labels: a newline in it
// forged log lines, and an 8 MiB one wrote 16 MB of stderr. Up to 128
// printable bytes are served; more, or a control character, refuse the
// stream naming the field.
TEST(HostileClientTest, ClientNamesAreShortAndPrintable) {
  Server server;
  auto stub = v1::TargetService::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  auto open_with = [&](const std::string& name) {
    grpc::ClientContext ctx;
    std::unique_ptr<Stream> stream = stub->StreamHiddenStates(&ctx);
    v1::StreamRequest open;
    *open.mutable_open() = OpenFor({-1});
    open.mutable_open()->set_client_name(name);
    stream->Write(open);
    stream->WritesDone();
    v1::StreamResponse r;
    const bool opened = stream->Read(&r) && r.has_opened();
    while (stream->Read(&r)) {
    }
    const grpc::Status st = stream->Finish();
    return opened ? std::string("opened") : st.error_message();
  };
  EXPECT_EQ(open_with(std::string(128, 'n')), "opened");
  EXPECT_EQ(open_with("trainer \xe8\xae\xad\xe7\xbb\x83"), "opened");  // UTF-8 is printable
  EXPECT_EQ(open_with(std::string(129, 'n')), "Open.client_name has 129 bytes; at most 128");
  const std::string control =
      "Open.client_name holds a control character at byte 1; it names the client in log lines "
      "and metric labels: printable text only";
  EXPECT_EQ(open_with("a\ndraftfeed-target: stream opened from ipv4:10.0.0.1:1"), control);
  EXPECT_EQ(open_with("a\x1b[2J"), control);
  EXPECT_EQ(open_with("a\xc2\x85"), control);  // U+0085, NEL
}

// Every refused stream wrote a log line, however many came (6,000 refusals
// wrote 1.38 MB in 4 s). At most TargetService::kRefusalLinesPerS a second
// are written now, and the next line written says how many were held back:
// the lines and the counts they report add up to the refusals.
TEST(HostileClientTest, RefusedStreamLinesAreRateLimited) {
  ServiceOptions options;
  options.max_streams = 1;
  Server server(options);
  auto stub = v1::TargetService::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext holder_ctx;
  std::unique_ptr<Stream> holder = stub->StreamHiddenStates(&holder_ctx);
  v1::StreamRequest open;
  *open.mutable_open() = OpenFor({-1});
  v1::StreamResponse r;
  ASSERT_TRUE(holder->Write(open));
  ASSERT_TRUE(holder->Read(&r) && r.has_opened());
  auto refused_stream = [&] {
    grpc::ClientContext ctx;
    std::unique_ptr<Stream> s = stub->StreamHiddenStates(&ctx);
    s->Write(open);
    while (s->Read(&r)) {
    }
    return s->Finish().error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
  };
  constexpr int kRefusals = 300;
  ::testing::internal::CaptureStderr();
  int refused = 0;
  for (int i = 0; i < kRefusals; ++i) refused += refused_stream() ? 1 : 0;
  // One more after a quiet second reports what the flood's last second held back.
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  refused += refused_stream() ? 1 : 0;
  ASSERT_TRUE(Eventually([&] { return server.service().StreamLoads().size() == 1; }));
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(refused, kRefusals + 1);
  int64_t lines = 0, suppressed = 0;
  for (size_t at = log.find("stream refused from"); at != std::string::npos;
       at = log.find("stream refused from", at + 1)) {
    ++lines;
  }
  constexpr std::string_view kMore = " more stream refusals suppressed (at most 10 lines a second)";
  for (size_t at = log.find(kMore); at != std::string::npos; at = log.find(kMore, at + 1)) {
    const size_t start = log.rfind(' ', at - 1) + 1;
    suppressed += std::stoll(log.substr(start, at - start));
  }
  EXPECT_LT(lines, kRefusals / 2) << log.size() << " bytes of log";
  EXPECT_EQ(lines + suppressed, kRefusals + 1) << log;
  holder->WritesDone();
  while (holder->Read(&r)) {
  }
  EXPECT_TRUE(holder->Finish().ok());
}

}  // namespace
}  // namespace draftfeed
