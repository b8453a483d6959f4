#include "client/src/chunk_reader.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

namespace draftfeed {

bool Chunk::CopyTo(std::byte* dst, v1::PayloadHasher* hasher) const {
  if (parsed != nullptr) {
    if (parsed->size() != payload_bytes) return false;
    if (hasher != nullptr) {
      hasher->CopyAndUpdate(dst, parsed->data(), payload_bytes);
    } else {
      std::memcpy(dst, parsed->data(), payload_bytes);
    }
    return true;
  }
  size_t skip_left = skip;
  size_t n = payload_bytes;
  for (const grpc::Slice& slice : slices) {
    if (n == 0) break;
    size_t len = slice.size();
    const unsigned char* src = slice.begin();
    if (skip_left >= len) {
      skip_left -= len;
      continue;
    }
    src += skip_left;
    len = std::min(len - skip_left, n);
    skip_left = 0;
    if (hasher != nullptr) {
      hasher->CopyAndUpdate(dst, src, len);
    } else {
      std::memcpy(dst, src, len);
    }
    dst += len;
    n -= len;
  }
  return n == 0;
}

std::optional<Chunk> ReadChunk(grpc::ByteBuffer& raw) {
  Chunk chunk;
  if (!raw.Dump(&chunk.slices).ok()) return std::nullopt;
  // The envelope is the message's first few dozen bytes: gathered from the
  // first slices (the payload itself is not touched here).
  uint8_t prefix[kMaxChunkEnvelopeBytes];
  size_t have = 0;
  for (const grpc::Slice& s : chunk.slices) {
    const size_t take = std::min(s.size(), sizeof prefix - have);
    std::memcpy(prefix + have, s.begin(), take);
    have += take;
    if (have == sizeof prefix) break;
  }
  absl::StatusOr<DecodedChunkEnvelope> env =
      DecodeChunkEnvelope(std::span<const uint8_t>(prefix, have), raw.Length());
  if (!env.ok()) return std::nullopt;
  chunk.header = env->header;
  chunk.payload_bytes = static_cast<size_t>(env->payload_bytes);
  chunk.skip = env->envelope_bytes;
  return chunk;
}

Chunk ChunkOf(const v1::HiddenChunk& c) {
  Chunk chunk;
  chunk.header = ChunkHeader{c.batch_id(), c.token_offset(), c.token_count()};
  chunk.payload_bytes = c.data().size();
  chunk.parsed = &c.data();
  return chunk;
}

}  // namespace draftfeed
