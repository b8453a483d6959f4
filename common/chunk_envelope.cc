#include "common/chunk_envelope.h"

#include <algorithm>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace draftfeed {

namespace {

// Wire types and the tags of the canonical form.
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;
constexpr uint32_t kGroupStart = 3, kGroupEnd = 4;
constexpr uint8_t kChunkTag = (2 << 3) | kLengthDelimited;  // StreamResponse.chunk
constexpr uint32_t kBatchId = 1, kTokenOffset = 2, kTokenCount = 3, kData = 4;

size_t PutVarint(uint8_t* p, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    p[n++] = static_cast<uint8_t>(v | 0x80);
    v >>= 7;
  }
  p[n++] = static_cast<uint8_t>(v);
  return n;
}

size_t VarintSize(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}

absl::Status Declined(absl::string_view why) {
  return absl::UnimplementedError(absl::StrCat("chunk envelope: ", why));
}
absl::Status Malformed(absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("chunk envelope: ", why));
}

// Reads from the prefix; running out of it before the message ends declines
// (a longer prefix, or the generated parser, could read on), running past
// the message is malformed.
class Reader {
 public:
  Reader(std::span<const uint8_t> prefix, uint64_t message_bytes)
      : data_(prefix.data()),
        limit_(std::min<uint64_t>(prefix.size(), message_bytes)),
        message_bytes_(message_bytes) {}

  uint64_t pos() const { return pos_; }

  absl::Status Varint(uint64_t* v) {
    uint64_t out = 0;
    for (int i = 0; i < 10; ++i) {
      if (pos_ >= limit_) return OutOfBytes(pos_ + 1, "a varint");
      const uint8_t b = data_[pos_++];
      out |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) {
        *v = out;
        return absl::OkStatus();
      }
    }
    return Malformed("a varint longer than 10 bytes");
  }

  // Moves past `n` bytes that must lie in the prefix.
  absl::Status Skip(uint64_t n, absl::string_view what) {
    if (n > message_bytes_ - pos_) return OutOfBytes(message_bytes_ + 1, what);
    if (n > limit_ - pos_) return OutOfBytes(pos_ + n, what);
    pos_ += n;
    return absl::OkStatus();
  }

 private:
  absl::Status OutOfBytes(uint64_t needed_end, absl::string_view what) const {
    if (needed_end > message_bytes_) {
      return Malformed(absl::StrCat(what, " runs past the message's ", message_bytes_, " bytes"));
    }
    return Declined(absl::StrCat(what, " runs past the ", limit_, " bytes of prefix given"));
  }

  const uint8_t* data_;
  uint64_t limit_;
  uint64_t message_bytes_;
  uint64_t pos_ = 0;
};

// A length-delimited field's length, checked against where its parent ends.
absl::Status Length(Reader& r, uint64_t end, uint64_t* len, absl::string_view what) {
  DF_RETURN_IF_ERROR(r.Varint(len));
  if (*len > end - r.pos()) {
    return Malformed(absl::StrCat(what, " of ", *len, " bytes runs past its message"));
  }
  return absl::OkStatus();
}

}  // namespace

size_t EncodeChunkEnvelope(const ChunkHeader& h, uint64_t payload_bytes, uint8_t* out) {
  const auto offset = static_cast<uint64_t>(h.token_offset);
  const auto count = static_cast<uint64_t>(h.token_count);
  const uint64_t inner = 1 + VarintSize(h.batch_id) + 1 + VarintSize(offset) + 1 +
                         VarintSize(count) + 1 + VarintSize(payload_bytes) + payload_bytes;
  size_t n = 0;
  out[n++] = kChunkTag;
  n += PutVarint(out + n, inner);
  out[n++] = (kBatchId << 3) | kVarint;
  n += PutVarint(out + n, h.batch_id);
  out[n++] = (kTokenOffset << 3) | kVarint;
  n += PutVarint(out + n, offset);
  out[n++] = (kTokenCount << 3) | kVarint;
  n += PutVarint(out + n, count);
  out[n++] = (kData << 3) | kLengthDelimited;
  n += PutVarint(out + n, payload_bytes);
  return n;
}

absl::StatusOr<DecodedChunkEnvelope> DecodeChunkEnvelope(std::span<const uint8_t> prefix,
                                                         uint64_t message_bytes) {
  // An empty StreamResponse is valid protobuf (no message set), not a chunk.
  if (message_bytes == 0) return Declined("an empty message");
  Reader r(prefix, message_bytes);
  uint64_t tag = 0;
  DF_RETURN_IF_ERROR(r.Varint(&tag));
  if (tag != kChunkTag) return Declined(absl::StrCat("tag ", tag, " is not StreamResponse.chunk"));
  uint64_t chunk_len = 0;
  DF_RETURN_IF_ERROR(Length(r, message_bytes, &chunk_len, "the chunk"));
  if (r.pos() + chunk_len != message_bytes) {
    return Declined("the message holds more than the chunk");
  }
  DecodedChunkEnvelope out;
  while (r.pos() < message_bytes) {
    DF_RETURN_IF_ERROR(r.Varint(&tag));
    // Protobuf's tags are 32 bits (field numbers up to 2^29 - 1); its parser
    // fails a message with a wider one, so skipping it as unknown would take
    // for a chunk what the generated parser rejects.
    if (tag > std::numeric_limits<uint32_t>::max()) {
      return Malformed(absl::StrCat("tag ", tag, " is wider than 32 bits"));
    }
    const uint64_t field = tag >> 3;
    const auto wire = static_cast<uint32_t>(tag & 7);
    if (field == 0) return Malformed("field number 0");
    uint64_t v = 0;
    if (field >= kBatchId && field <= kTokenCount && wire == kVarint) {
      DF_RETURN_IF_ERROR(r.Varint(&v));
      if (field == kBatchId) out.header.batch_id = v;
      if (field == kTokenOffset) out.header.token_offset = static_cast<int64_t>(v);
      if (field == kTokenCount) out.header.token_count = static_cast<int64_t>(v);
      continue;
    }
    if (field == kData && wire == kLengthDelimited) {
      DF_RETURN_IF_ERROR(Length(r, message_bytes, &v, "data"));
      if (r.pos() + v != message_bytes) return Declined("fields follow the chunk's data");
      out.payload_bytes = v;
      out.envelope_bytes = static_cast<size_t>(r.pos());
      return out;
    }
    // Protobuf keeps any other field (a known one with another wire type
    // included) as an unknown field; so does this decoder, by skipping it.
    switch (wire) {
      case kVarint:
        DF_RETURN_IF_ERROR(r.Varint(&v));
        break;
      case kFixed64:
        DF_RETURN_IF_ERROR(r.Skip(8, "a fixed64 field"));
        break;
      case kFixed32:
        DF_RETURN_IF_ERROR(r.Skip(4, "a fixed32 field"));
        break;
      case kLengthDelimited:
        DF_RETURN_IF_ERROR(Length(r, message_bytes, &v, "an unknown field"));
        DF_RETURN_IF_ERROR(r.Skip(v, "an unknown field"));
        break;
      case kGroupStart:
      case kGroupEnd:
        return Declined("a group field");
      default:
        return Malformed(absl::StrCat("wire type ", wire));
    }
  }
  // No data field: an empty payload (how protobuf writes one, and how the
  // NCCL transport's announcements read).
  out.envelope_bytes = static_cast<size_t>(message_bytes);
  return out;
}

}  // namespace draftfeed
