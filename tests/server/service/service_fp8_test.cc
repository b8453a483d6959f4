// fp8_e4m3 end to end over gRPC: a CPU target's fp8 capture reaches the
// client byte for byte (fp8_raw), or dequantized on the way in to the bf16 of
// bf16(code * scale), within e4m3's bound of the engine's fp32 states; the
// checksum covers the fp8 bytes sent, and a token costs K*H + 4K bytes.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "common/fp8_capture.h"
#include "common/payload_checksum.h"
#include "draftfeed/client.h"
#include "draftfeed/v1/draftfeed.grpc.pb.h"
#include "server/model/tensor.h"
#include "tests/server/service/loopback_target.h"
#include "tests/server/service/test_tokens.h"

namespace draftfeed {
namespace {

using Server = testing::LoopbackTarget;
using testing::RandomTokens;

struct Batch {
  std::vector<int32_t> tokens, lens;
};

std::vector<Batch> Batches(int vocab) {
  std::vector<Batch> b;
  const std::vector<std::vector<int32_t>> lens = {{1}, {5, 17, 9}, {130}};
  for (size_t i = 0; i < lens.size(); ++i) {
    int n = 0;
    for (int32_t l : lens[i]) n += l;
    b.push_back({RandomTokens(n, vocab, 300 + i), lens[i]});
  }
  return b;
}

std::vector<std::byte> EngineFp8(CpuEngine& e, const Batch& b, const std::vector<int32_t>& layers) {
  ForwardInput in{b.tokens, b.lens, layers, CaptureEncoding::kFp8E4m3};
  std::vector<std::byte> out(CaptureBytes(e.model().config, in));
  const absl::Status s = e.Forward(in, out);
  EXPECT_TRUE(s.ok()) << s;
  return out;
}

std::unique_ptr<Feed> OpenFp8(const Server& server, const std::vector<int32_t>& layers, bool raw) {
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = layers;
  opt.prefetch = 3;
  opt.encoding = Encoding::kFp8E4m3;
  opt.fp8_raw = raw;
  absl::StatusOr<std::unique_ptr<Feed>> feed = Feed::Open(opt);
  EXPECT_TRUE(feed.ok()) << feed.status();
  return feed.ok() ? *std::move(feed) : nullptr;
}

TEST(ServiceFp8Test, TargetInfoOffersFp8) {
  Server server;
  auto stub = v1::TargetService::NewStub(
      grpc::CreateChannel(server.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::TargetInfo info;
  ASSERT_TRUE(stub->GetTargetInfo(&ctx, v1::GetTargetInfoRequest(), &info).ok());
  std::vector<int> encodings(info.encodings().begin(), info.encodings().end());
  EXPECT_EQ(encodings, (std::vector<int>{v1::ENCODING_BF16, v1::ENCODING_FP8_E4M3}));
}

TEST(ServiceFp8Test, RawModeReturnsTheEnginesBytes) {
  ServiceOptions options;
  options.chunk_bytes = 8 * (3 * 128 + 12);  // 8 tokens a chunk: most batches in pieces
  Server server(options);
  const std::vector<int32_t> layers = {2, 0, -1};
  const int64_t K = 3, H = server.model().config.hidden_size;
  std::unique_ptr<Feed> feed = OpenFp8(server, layers, /*raw=*/true);
  ASSERT_NE(feed, nullptr);
  const std::vector<Batch> batches = Batches(static_cast<int>(server.model().config.vocab_size));
  for (const Batch& b : batches) ASSERT_TRUE(feed->Submit(b.tokens, b.lens).ok());
  for (const Batch& b : batches) {
    absl::StatusOr<HiddenBatch> r = feed->Next();
    ASSERT_TRUE(r.ok()) << r.status();
    const int64_t T = static_cast<int64_t>(b.tokens.size());
    EXPECT_EQ(r->encoding, Encoding::kFp8E4m3);
    EXPECT_EQ(r->bytes_per_token, K * H + 4 * K);  // 396 bytes; bf16 takes 768
    ASSERT_EQ(r->num_bytes, static_cast<size_t>(T * (K * H + 4 * K)));
    const std::vector<std::byte> want = EngineFp8(server.engine(), b, layers);
    EXPECT_TRUE(std::equal(want.begin(), want.end(), r->bytes().begin()));
    EXPECT_EQ(r->checksum, v1::PayloadChecksum(want.data(), want.size()));
    // The accessors read the same layout.
    EXPECT_EQ(r->fp8_scale(T - 1, 2), Fp8CaptureScale(want.data(), K, H, T - 1, 2));
    EXPECT_EQ(r->fp8_codes(T - 1, 1)[5],
              static_cast<uint8_t>(want[static_cast<size_t>((T - 1) * (K * H + 4 * K) + H + 5)]));
  }
  EXPECT_TRUE(feed->Close().ok());
  EXPECT_EQ(feed->Stats().bytes_received, static_cast<int64_t>((1 + 31 + 130) * (K * H + 4 * K)));
}

TEST(ServiceFp8Test, DefaultModeDequantizesOnTheWayIn) {
  Server server;
  const std::vector<int32_t> layers = {1, -1};
  const int64_t K = 2, H = server.model().config.hidden_size;
  std::unique_ptr<Feed> feed = OpenFp8(server, layers, /*raw=*/false);
  ASSERT_NE(feed, nullptr);
  const std::vector<Batch> batches = Batches(static_cast<int>(server.model().config.vocab_size));
  for (const Batch& b : batches) ASSERT_TRUE(feed->Submit(b.tokens, b.lens).ok());
  for (const Batch& b : batches) {
    absl::StatusOr<HiddenBatch> r = feed->Next();
    ASSERT_TRUE(r.ok()) << r.status();
    const int64_t T = static_cast<int64_t>(b.tokens.size());
    ASSERT_EQ(r->encoding, Encoding::kBf16);
    EXPECT_EQ(r->bytes_per_token, K * H * 2);
    ASSERT_EQ(r->bf16().size(), static_cast<size_t>(T * K * H));
    // Bit for bit the host decoder over the engine's fp8 bytes ...
    const std::vector<std::byte> fp8 = EngineFp8(server.engine(), b, layers);
    std::vector<uint16_t> want(static_cast<size_t>(T * K * H));
    ASSERT_TRUE(DecodeFp8CaptureToBf16(fp8, T, K, H, want).ok());
    EXPECT_TRUE(std::equal(want.begin(), want.end(), r->bf16().begin()));
    // ... whose checksum is the one sent and verified.
    EXPECT_EQ(r->checksum, v1::PayloadChecksum(fp8.data(), fp8.size()));
    // And within half an e4m3 step (at the row's scale) plus one bf16
    // rounding of the engine's fp32 states.
    std::vector<float> ref(static_cast<size_t>(T * K * H));
    ASSERT_TRUE(server.engine().ForwardFloat({b.tokens, b.lens, layers}, ref).ok());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        const double s = Fp8CaptureScale(fp8.data(), K, H, t, k);
        for (int64_t i = 0; i < H; ++i) {
          const size_t j = static_cast<size_t>((t * K + k) * H + i);
          const double x = ref[j], got = Bf16ToFloat(r->bf16()[j]);
          // e4m3's half step is at most 2^-4 of |x / s| (normals) or 2^-10
          // (subnormals); bf16's rounding adds 2^-9 of the result.
          const double bound =
              std::max(std::fabs(x) / 16, 0x1p-10 * s) + 0x1p-8 * std::fabs(got) + 1e-30;
          ASSERT_LE(std::fabs(got - x), bound) << t << "," << k << "," << i;
        }
      }
    }
  }
  EXPECT_TRUE(feed->Close().ok());
  EXPECT_EQ(feed->Stats().bytes_received, static_cast<int64_t>(162 * (K * H + 4 * K)));
}

TEST(ServiceFp8Test, Fp8RawWithoutFp8IsRefusedByName) {
  Server server;
  FeedOptions opt;
  opt.targets = {server.address()};
  opt.layers = {0};
  opt.fp8_raw = true;
  absl::StatusOr<std::unique_ptr<Feed>> feed = Feed::Open(opt);
  ASSERT_FALSE(feed.ok());
  EXPECT_EQ(feed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(feed.status().message().find("FeedOptions.fp8_raw"), std::string::npos)
      << feed.status();
  opt.fp8_raw = false;
  opt.encoding = static_cast<Encoding>(3);
  feed = Feed::Open(opt);
  ASSERT_FALSE(feed.ok());
  EXPECT_NE(feed.status().message().find("FeedOptions.encoding is 3"), std::string::npos)
      << feed.status();
}

}  // namespace
}  // namespace draftfeed
