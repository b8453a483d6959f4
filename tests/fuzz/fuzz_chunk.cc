// libFuzzer target: the client's decoding of a HiddenChunk off the wire. The
// input's first byte picks where the message is cut into gRPC slices (as the
// transport may deliver it); the rest is the serialized StreamResponse.
// ReadChunk (the envelope decoder plus the slice walk) is compared with the
// generated parser, which is the authority: whatever the fast path accepts,
// the parser must accept as the same chunk with the same payload bytes.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "client/src/chunk_reader.h"
#include "common/chunk_envelope.h"
#include "draftfeed/v1/draftfeed.pb.h"
#include "google/protobuf/stubs/logging.h"

namespace {

void Require(bool ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "fuzz_chunk: invariant broken: %s\n", what);
    abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  grpc_init();
  // The parser logs every invalid UTF-8 string it meets; mutated inputs are
  // full of them.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t cut = data[0];
  const uint8_t* msg = data + 1;
  const size_t n = size - 1;

  // Slices of 1 + (cut % 16) bytes, the last one holding the rest (cut >= 128),
  // or the whole message in one slice (cut < 16).
  std::vector<grpc::Slice> slices;
  if (cut < 16 || n == 0) {
    slices.emplace_back(msg, n);
  } else {
    const size_t step = 1 + cut % 16;
    for (size_t at = 0; at < n; at += step) slices.emplace_back(msg + at, std::min(step, n - at));
  }
  grpc::ByteBuffer raw(slices.data(), slices.size());
  std::optional<draftfeed::Chunk> chunk = draftfeed::ReadChunk(raw);

  // The decoder itself over the whole message: a payload that ends the
  // message, and the answer ReadChunk gave from its prefix (which may decline
  // an envelope longer than kMaxChunkEnvelopeBytes that the whole message
  // holds, leaving it to the parser).
  auto env = draftfeed::DecodeChunkEnvelope(std::span<const uint8_t>(msg, n), n);
  if (env.ok()) {
    Require(env->envelope_bytes + env->payload_bytes == n, "a payload that ends the message");
    if (env->envelope_bytes <= draftfeed::kMaxChunkEnvelopeBytes) {
      Require(chunk.has_value(), "ReadChunk reads an envelope within its prefix");
    }
  }
  if (chunk.has_value()) Require(env.ok(), "ReadChunk accepts only what the decoder accepts");

  draftfeed::v1::StreamResponse parsed;
  const bool parses = parsed.ParseFromArray(msg, static_cast<int>(n));
  if (!chunk.has_value()) return 0;
  Require(chunk->header == env->header && chunk->payload_bytes == env->payload_bytes,
          "ReadChunk returns the decoder's envelope");
  Require(parses, "what the fast path accepts, the parser accepts");
  Require(parsed.has_chunk(), "the parser sees a chunk");
  const auto& c = parsed.chunk();
  Require(c.batch_id() == chunk->header.batch_id &&
              c.token_offset() == chunk->header.token_offset &&
              c.token_count() == chunk->header.token_count,
          "the parser reads the same header");
  Require(c.data().size() == chunk->payload_bytes, "the parser reads the same payload length");
  std::vector<std::byte> copy(chunk->payload_bytes);
  Require(chunk->CopyTo(copy.data(), nullptr), "the payload is all there");
  Require(copy.empty() || std::memcmp(copy.data(), c.data().data(), copy.size()) == 0,
          "the parser reads the same payload bytes");

  // The encoder's canonical form of this header decodes to it.
  uint8_t out[draftfeed::kMaxChunkEnvelopeBytes];
  const size_t len = draftfeed::EncodeChunkEnvelope(chunk->header, chunk->payload_bytes, out);
  auto again = draftfeed::DecodeChunkEnvelope(std::span<const uint8_t>(out, len),
                                              len + chunk->payload_bytes);
  Require(again.ok() && again->header == chunk->header &&
              again->payload_bytes == chunk->payload_bytes && again->envelope_bytes == len,
          "the encoder's envelope decodes to the header");
  return 0;
}
