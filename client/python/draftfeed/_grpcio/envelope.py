"""The HiddenChunk envelope of a raw StreamResponse (common/chunk_envelope.h), in Python.

A target writes each chunk as the protobuf bytes of StreamResponse{chunk: {batch_id,
token_offset, token_count, data}} with the payload last. Reading those few dozen header bytes
here, the payload is copied once, straight from the message bytes gRPC handed over into the
batch's buffer; parsing the message with protobuf would first copy it into a `bytes` field.

decode() reads any encoding of a lone chunk whose data comes last (protobuf's own serializer's
form, the target's canonical form with zero fields written, fields 1-3 repeated or in any order,
unknown fields between them) and returns None for anything else, which the caller then parses
with the protobuf message class: that parser stays the authority on what the wire means.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

_VARINT, _FIXED64, _LENGTH, _GROUP_START, _GROUP_END, _FIXED32 = 0, 1, 2, 3, 4, 5
_CHUNK_TAG = (2 << 3) | _LENGTH  # StreamResponse.chunk
_BATCH_ID, _TOKEN_OFFSET, _TOKEN_COUNT, _DATA = 1, 2, 3, 4
# Five tags of one byte and five varints of at most ten bytes.
MAX_ENVELOPE_BYTES = 5 * (1 + 10)
_M64 = (1 << 64) - 1


class Envelope(NamedTuple):
    batch_id: int
    token_offset: int
    token_count: int
    payload_bytes: int   # the data field's length (0 when absent)
    envelope_bytes: int  # where the payload starts in the message


class _Declined(Exception):
    """Not a form this decoder reads (or not valid protobuf): parse with protobuf."""


def _varint(b, pos: int, limit: int):
    out = 0
    for i in range(10):
        if pos >= limit:
            raise _Declined
        c = b[pos]
        pos += 1
        out |= (c & 0x7F) << (7 * i)
        if not c & 0x80:
            return out & _M64, pos
    raise _Declined  # a varint longer than 10 bytes is malformed


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


def decode(msg) -> Optional[Envelope]:
    """The envelope of `msg` (bytes or memoryview: one whole serialized StreamResponse), or None
    when it is not a chunk in a form read here."""
    n = len(msg)
    if n == 0 or msg[0] != _CHUNK_TAG:
        return None
    limit = min(n, MAX_ENVELOPE_BYTES)  # the header is read from this prefix only
    try:
        chunk_len, pos = _varint(msg, 1, limit)
        if pos + chunk_len != n:
            return None  # the message holds more than the chunk, or is cut short
        batch_id = offset = count = 0
        while pos < n:
            tag, pos = _varint(msg, pos, limit)
            if tag > 0xFFFFFFFF:
                return None  # protobuf refuses tags wider than 32 bits
            field, wire = tag >> 3, tag & 7
            if field == 0:
                return None
            if _BATCH_ID <= field <= _TOKEN_COUNT and wire == _VARINT:
                v, pos = _varint(msg, pos, limit)
                if field == _BATCH_ID:
                    batch_id = v
                elif field == _TOKEN_OFFSET:
                    offset = _signed64(v)
                else:
                    count = _signed64(v)
                continue
            if field == _DATA and wire == _LENGTH:
                length, pos = _varint(msg, pos, limit)
                if pos + length != n:
                    return None  # fields after the data, or a length past the message
                return Envelope(batch_id, offset, count, length, pos)
            # Any other field is kept by protobuf as unknown: skip it too.
            if wire == _VARINT:
                _, pos = _varint(msg, pos, limit)
            elif wire == _FIXED64:
                pos += 8
            elif wire == _FIXED32:
                pos += 4
            elif wire == _LENGTH:
                length, pos = _varint(msg, pos, limit)
                pos += length
            else:
                return None  # groups, or a wire type protobuf does not have
            if pos > limit:
                return None
        if pos != n:
            return None
        # No data field: an empty payload.
        return Envelope(batch_id, offset, count, 0, n)
    except _Declined:
        return None
