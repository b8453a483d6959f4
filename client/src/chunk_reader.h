// HiddenChunks as they come off the stream: the envelope decoded with
// common/chunk_envelope.h, the payload left in gRPC's slices until it is
// copied (once) to where its batch lands.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "common/chunk_envelope.h"
#include "common/payload_checksum.h"
#include "draftfeed/v1/draftfeed.pb.h"

namespace draftfeed {

struct Chunk {
  ChunkHeader header;
  size_t payload_bytes = 0;
  // The payload: in `slices` past `skip` bytes (read raw), or in `parsed`
  // (a message the generated parser read).
  std::vector<grpc::Slice> slices;
  size_t skip = 0;
  const std::string* parsed = nullptr;

  // Copies the payload to `dst`, hashing it on the way when `hasher` is
  // given; false when the message holds fewer bytes than it announced.
  bool CopyTo(std::byte* dst, v1::PayloadHasher* hasher) const;
};

// The chunk in `raw`, when `raw` is a StreamResponse holding one that the
// envelope decoder reads; nullopt: parse `raw` with the generated parser.
std::optional<Chunk> ReadChunk(grpc::ByteBuffer& raw);

// A chunk the generated parser read (its payload stays in `c`).
Chunk ChunkOf(const v1::HiddenChunk& c);

}  // namespace draftfeed
