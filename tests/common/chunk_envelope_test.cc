// The HiddenChunk envelope codec against protobuf itself: the generated parser
// reads what the encoder writes, the decoder reads what protobuf's serializer
// writes, and hostile bytes fail cleanly (and are ones protobuf rejects too).
#include "common/chunk_envelope.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "draftfeed/v1/draftfeed.pb.h"

namespace draftfeed {
namespace {

using namespace std::string_literals;

std::string Payload(size_t n) {
  std::string p(n, '\0');
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<char>((i * 131 + 7) & 0xff);
  return p;
}

// The envelope followed by the payload: one message as it leaves the target.
std::string Encoded(const ChunkHeader& h, const std::string& payload) {
  uint8_t head[kMaxChunkEnvelopeBytes];
  const size_t n = EncodeChunkEnvelope(h, payload.size(), head);
  return std::string(reinterpret_cast<const char*>(head), n) + payload;
}

std::string ProtobufChunk(const ChunkHeader& h, const std::string& payload) {
  v1::StreamResponse msg;
  v1::HiddenChunk* c = msg.mutable_chunk();
  c->set_batch_id(h.batch_id);
  c->set_token_offset(h.token_offset);
  c->set_token_count(h.token_count);
  c->set_data(payload);
  return msg.SerializeAsString();
}

absl::StatusOr<DecodedChunkEnvelope> Decode(const std::string& msg, size_t prefix) {
  return DecodeChunkEnvelope(
      {reinterpret_cast<const uint8_t*>(msg.data()), std::min(prefix, msg.size())}, msg.size());
}

// Bytes of a varint, for building messages by hand.
std::string Varint(uint64_t v) {
  std::string out;
  while (v >= 0x80) {
    out.push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
  return out;
}

std::string Chunk(const std::string& inner) { return "\x12" + Varint(inner.size()) + inner; }

const std::vector<ChunkHeader>& Headers() {
  static const std::vector<ChunkHeader> headers = {
      {0, 0, 0},
      {1, 0, 1},
      {127, 128, 16383},
      {uint64_t{1} << 35, 1'000'000, 16384},
      {std::numeric_limits<uint64_t>::max(), std::numeric_limits<int64_t>::max(), 3},
      {42, -1, -5},  // negative values are ten-byte varints; the caller rejects them
  };
  return headers;
}

const std::vector<size_t>& PayloadSizes() {
  static const std::vector<size_t> sizes = {0, 1, 127, 128, 16383, 16384, (size_t{1} << 20) + 3};
  return sizes;
}

TEST(ChunkEnvelope, ProtobufParsesWhatTheEncoderWrites) {
  for (const ChunkHeader& h : Headers()) {
    for (size_t n : PayloadSizes()) {
      SCOPED_TRACE(testing::Message()
                   << "id " << h.batch_id << " offset " << h.token_offset << " payload " << n);
      const std::string payload = Payload(n);
      v1::StreamResponse msg;
      ASSERT_TRUE(msg.ParseFromString(Encoded(h, payload)));
      ASSERT_TRUE(msg.has_chunk());
      EXPECT_EQ(msg.chunk().batch_id(), h.batch_id);
      EXPECT_EQ(msg.chunk().token_offset(), h.token_offset);
      EXPECT_EQ(msg.chunk().token_count(), h.token_count);
      EXPECT_EQ(msg.chunk().data(), payload);
    }
  }
}

// The bytes on the wire are the target's since the first release.
TEST(ChunkEnvelope, EncoderWritesEveryFieldInOrder) {
  uint8_t head[kMaxChunkEnvelopeBytes];
  const size_t n =
      EncodeChunkEnvelope({.batch_id = 1, .token_offset = 0, .token_count = 2}, 4, head);
  EXPECT_EQ(std::vector<uint8_t>(head, head + n),
            (std::vector<uint8_t>{0x12, 12, 0x08, 1, 0x10, 0, 0x18, 2, 0x22, 4}));
  const ChunkHeader widest{std::numeric_limits<uint64_t>::max(), -1, -1};
  EXPECT_EQ(EncodeChunkEnvelope(widest, std::numeric_limits<uint64_t>::max() - 64, head),
            kMaxChunkEnvelopeBytes);
}

TEST(ChunkEnvelope, DecoderReadsWhatTheEncoderWrites) {
  for (const ChunkHeader& h : Headers()) {
    for (size_t n : PayloadSizes()) {
      const std::string msg = Encoded(h, Payload(n));
      const size_t envelope = msg.size() - n;
      // The envelope alone is enough; so is the usual fixed-size prefix.
      for (size_t prefix : {envelope, kMaxChunkEnvelopeBytes, msg.size()}) {
        absl::StatusOr<DecodedChunkEnvelope> d = Decode(msg, prefix);
        ASSERT_TRUE(d.ok()) << d.status();
        EXPECT_EQ(d->header, h);
        EXPECT_EQ(d->payload_bytes, n);
        EXPECT_EQ(d->envelope_bytes, envelope);
      }
    }
  }
}

TEST(ChunkEnvelope, DecoderReadsWhatProtobufWrites) {
  for (const ChunkHeader& h : Headers()) {
    for (size_t n : PayloadSizes()) {
      SCOPED_TRACE(testing::Message() << "id " << h.batch_id << " payload " << n);
      const std::string payload = Payload(n);
      const std::string msg = ProtobufChunk(h, payload);  // zeros and empty data omitted
      absl::StatusOr<DecodedChunkEnvelope> d = Decode(msg, kMaxChunkEnvelopeBytes);
      ASSERT_TRUE(d.ok()) << d.status();
      EXPECT_EQ(d->header, h);
      EXPECT_EQ(d->payload_bytes, n);
      EXPECT_EQ(msg.substr(d->envelope_bytes), payload);
    }
  }
}

// Protobuf's merge rules: any order, the last of a repeated scalar wins,
// unknown fields (a known number with another wire type too) are skipped.
TEST(ChunkEnvelope, DecoderReadsOtherValidOrders) {
  const std::string data =
      "\x22\x03"
      "abc";
  const std::vector<std::string> inners = {
      "\x18\x07\x08\x05\x10\x09" + data,          // 3, 1, 2
      "\x08\x01\x08\x05\x10\x09\x18\x07" + data,  // batch_id twice
      "\x48\x2a\x08\x05\x52\x02zz\x10\x09\x5d" + std::string(4, 'x') + "\x61" +
          std::string(8, 'y') + "\x18\x07" + data,                       // unknown 9, 10, 11, 12
      "\x0d" + std::string(4, 'q') + "\x08\x05\x10\x09\x18\x07" + data,  // field 1 as fixed32
  };
  for (const std::string& inner : inners) {
    const std::string msg = Chunk(inner);
    v1::StreamResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(msg));
    absl::StatusOr<DecodedChunkEnvelope> d = Decode(msg, msg.size());
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->header.batch_id, parsed.chunk().batch_id());
    EXPECT_EQ(d->header.batch_id, 5u);
    EXPECT_EQ(d->header.token_offset, parsed.chunk().token_offset());
    EXPECT_EQ(d->header.token_count, parsed.chunk().token_count());
    EXPECT_EQ(msg.substr(d->envelope_bytes), parsed.chunk().data());
  }
}

// The NCCL transport's announcement: a chunk without data, as protobuf
// serializes it (token_offset 0 omitted).
TEST(ChunkEnvelope, ChunkWithoutDataHasAnEmptyPayload) {
  const std::string msg = ProtobufChunk({.batch_id = 9, .token_offset = 0, .token_count = 12}, "");
  absl::StatusOr<DecodedChunkEnvelope> d = Decode(msg, msg.size());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->header, (ChunkHeader{9, 0, 12}));
  EXPECT_EQ(d->payload_bytes, 0u);
  EXPECT_EQ(d->envelope_bytes, msg.size());
}

// Valid protobuf this decoder does not read: UNIMPLEMENTED, and the
// generated parser (the caller's fallback) reads it.
TEST(ChunkEnvelope, DeclinesOtherFormsForTheGeneratedParser) {
  v1::StreamResponse done;
  done.mutable_done()->set_batch_id(3);
  done.mutable_done()->set_tokens(10);
  const std::string chunk = Encoded({1, 2, 3}, "abcd");
  const std::vector<std::string> declined = {
      done.SerializeAsString(),  // not a chunk
      "",                        // no message set
      Chunk("\x22\x02"
            "ab"
            "\x08\x01"),                  // a field after data
      chunk + "\x1a\x00"s,                // a field after the chunk
      Chunk("\x0b\x08\x01\x0c\x08\x02"),  // a group
  };
  for (const std::string& msg : declined) {
    v1::StreamResponse parsed;
    EXPECT_TRUE(parsed.ParseFromString(msg));
    EXPECT_EQ(Decode(msg, msg.size()).status().code(), absl::StatusCode::kUnimplemented);
  }
  // An envelope longer than the prefix given (a long unknown field first).
  const std::string padded = Chunk("\x52\x40" + std::string(64, 'p') + "\x08\x01\x22\x01z");
  EXPECT_EQ(Decode(padded, kMaxChunkEnvelopeBytes).status().code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(Decode(padded, padded.size()).ok());
}

// Bytes that are no StreamResponse: INVALID_ARGUMENT, never a read past the
// message, and protobuf rejects them too.
TEST(ChunkEnvelope, HostileBytesFailCleanly) {
  const std::string good = Encoded({7, 0, 4}, Payload(64));
  std::vector<std::string> hostile;
  for (size_t cut : {size_t{1}, size_t{2}, size_t{5}, size_t{9}, good.size() - 1}) {
    hostile.push_back(good.substr(0, cut));  // truncated anywhere
  }
  hostile.push_back(Chunk("\x08"));       // varint cut by the chunk
  hostile.push_back("\x12\x7f\x08\x01");  // chunk overruns the message
  hostile.push_back(
      Chunk("\x08\x01\x22\x10"
            "abc"));  // data overruns the chunk
  hostile.push_back(
      Chunk("\x08\x01\x52\x10"
            "abc"));                                                    // unknown field overruns
  hostile.push_back(Chunk("\x08" + std::string(11, '\xff') + "\x01"));  // 11-byte varint
  hostile.push_back(Chunk("\x0e\x01"));                                 // wire type 6
  hostile.push_back(Chunk("\x00\x01"s));                                // field 0
  hostile.push_back(Chunk("\x5d\x01\x02"));                             // fixed32 cut
  hostile.push_back("\x12\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01");    // 2^64-1 byte chunk
  // Tags wider than protobuf's 32 bits (field numbers past 2^29 - 1), read as
  // an unknown field before the fix; found by tests/fuzz/fuzz_chunk.
  hostile.push_back(Chunk("\xe8\xfe\xb7\xb2\xf7\xfe\xb7\xae\x08\x01\x48\x4d"));
  hostile.push_back(Chunk("\x80\x80\x80\x80\x10\x01"));  // tag 2^32, a varint field
  for (const std::string& msg : hostile) {
    SCOPED_TRACE(testing::Message() << "message of " << msg.size() << " bytes");
    v1::StreamResponse parsed;
    EXPECT_FALSE(parsed.ParseFromString(msg));
    absl::StatusOr<DecodedChunkEnvelope> d = Decode(msg, msg.size());
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
  }
}

}  // namespace
}  // namespace draftfeed
