// The HiddenChunk envelope: the protobuf wire bytes of a StreamResponse whose
// `chunk` (field 2) holds batch_id, token_offset, token_count (fields 1-3) and
// then `data` (field 4), up to the first payload byte. The target writes the
// envelope and lets the payload follow as its own gRPC slice, and the client
// reads it and copies the payload straight out of gRPC's slices; neither
// builds a HiddenChunk message, whose `bytes` field would copy the payload.
//
// The encoder writes one canonical form (every field, zeros included, in
// field order). The decoder reads any encoding of a lone chunk whose data
// comes last, which covers what protobuf's own serializer writes (fields in
// number order, zero fields and empty data omitted) as well as fields 1-3 in
// any order, repeated (the last wins) or interleaved with unknown fields.
// Anything else it declines with UNIMPLEMENTED, and the caller parses the
// message with the generated StreamResponse parser, which stays the
// authority on what the wire means.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "absl/status/statusor.h"

namespace draftfeed {

struct ChunkHeader {
  uint64_t batch_id = 0;
  int64_t token_offset = 0;  // first token of the chunk within its batch
  int64_t token_count = 0;   // whole tokens
  friend bool operator==(const ChunkHeader&, const ChunkHeader&) = default;
};

// Five tags of one byte and five varints of at most ten bytes.
inline constexpr size_t kMaxChunkEnvelopeBytes = 5 * (1 + 10);

// Writes the envelope of a chunk whose data is `payload_bytes` long to `out`
// (room for kMaxChunkEnvelopeBytes) and returns its length; the payload's
// bytes follow it on the wire.
size_t EncodeChunkEnvelope(const ChunkHeader& header, uint64_t payload_bytes, uint8_t* out);

struct DecodedChunkEnvelope {
  ChunkHeader header;
  uint64_t payload_bytes = 0;  // the data field's length (0 when absent)
  size_t envelope_bytes = 0;   // where the payload starts in the message
};

// Reads the envelope from `prefix`, the first bytes (possibly all) of one
// serialized StreamResponse of `message_bytes` bytes. On success the payload
// is the message's last `payload_bytes` bytes, starting at `envelope_bytes`.
// Errors:
//   INVALID_ARGUMENT: the bytes cannot be a StreamResponse (a varint or a
//     length runs past the message, a known field has the wrong wire type);
//   UNIMPLEMENTED: not the form this decoder reads (another message than a
//     chunk, a chunk with fields after its data or beside the chunk, an
//     envelope longer than `prefix`): parse it with the generated parser.
absl::StatusOr<DecodedChunkEnvelope> DecodeChunkEnvelope(std::span<const uint8_t> prefix,
                                                         uint64_t message_bytes);

}  // namespace draftfeed
