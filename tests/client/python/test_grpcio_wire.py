"""The pure-Python client's wire pieces without a target: the shipped descriptor set against
the .proto, the numpy payload checksum against the C++ one's values, and the chunk envelope
decoder against protobuf's own serializer."""

import shutil
import subprocess

import numpy as np
import pytest

from conftest import REPO

pytest.importorskip("grpc")
from draftfeed._grpcio import checksum, envelope, proto  # noqa: E402
from draftfeed._grpcio.feed import _varint as varint  # noqa: E402

PROTO = REPO / "proto" / "draftfeed" / "v1" / "draftfeed.proto"
M64 = (1 << 64) - 1

# v1::PayloadChecksum (common/payload_checksum.cc) of pattern(n), printed by a program built
# against common/ (the same numbers for its PayloadChecksumReference).
CPP_CHECKSUMS = {
    0: 0x940270253FF6A484, 1: 0x22CACEB7687A84BB, 7: 0x44AB6E4B1508D036,
    8: 0x4CABC536D5F516C3, 9: 0xEDE42D61A66036DE, 63: 0x0343E22FCB91A342,
    64: 0x97741BC11DF11C62, 65: 0x7B7C3E72C88A1324, 127: 0x90EB9A9E966604B9,
    128: 0x799A85A9A445A15B, 1000: 0x4450F5DDCCF193FE, 4096: 0xF227BE6EB9E92C0E,
    65537: 0x12334636591D4F16, 1 << 20: 0x56480ED8E2C057BC,
}


def pattern(n):
    """The C++ program's bytes: the top byte of a 64-bit LCG's successive states."""
    s, out = 0x1234567, bytearray(n)
    for i in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) & M64
        out[i] = s >> 56
    return bytes(out)


@pytest.fixture(scope="module")
def patterns():
    return {n: pattern(n) for n in CPP_CHECKSUMS}


def test_descriptor_set_matches_the_proto(tmp_path):
    protoc = shutil.which("protoc")
    if protoc is None:
        pytest.skip("protoc is not installed")
    fresh = tmp_path / "fresh.desc"
    subprocess.run([protoc, f"--descriptor_set_out={fresh}", "--include_imports",
                    f"-I{REPO / 'proto'}", str(PROTO)], check=True)
    from google.protobuf import descriptor_pb2

    want = descriptor_pb2.FileDescriptorSet.FromString(fresh.read_bytes())
    got = descriptor_pb2.FileDescriptorSet.FromString(proto.DESCRIPTOR_FILE.read_bytes())
    assert got == want, ("client/python/draftfeed/_grpcio/draftfeed_v1.desc is stale: "
                         "regenerate it as draftfeed/_grpcio/proto.py says")


def test_message_classes_round_trip_and_both_factories_agree(monkeypatch):
    r = proto.StreamResponse()
    r.done.batch_id = 7
    r.done.tokens = 33
    r.done.checksum = 0xFEDCBA9876543210
    again = proto.StreamResponse.FromString(r.SerializeToString())
    assert again.WhichOneof("msg") == "done" and again.done.checksum == 0xFEDCBA9876543210
    # The MessageFactory path (protobuf < 4.22, no GetMessageClass) builds the same message.
    from google.protobuf import message_factory

    monkeypatch.delattr(message_factory, "GetMessageClass", raising=False)
    old = proto.message_class("StreamResponse")
    assert old.FromString(r.SerializeToString()).done.tokens == 33
    assert proto.ENCODING_NAMES[2] == "ENCODING_FP8_E4M3"


def test_checksum_equals_the_cpp_implementation(patterns):
    for n, want in CPP_CHECKSUMS.items():
        assert checksum.payload_checksum(patterns[n]) == want, n
        a = np.frombuffer(patterns[n], np.uint8)
        assert checksum.payload_checksum(a) == want, n


@pytest.mark.parametrize("cuts", [[0, 64, 1 << 20], [0, 1, 13, 77, 500000, 1 << 20],
                                  [0, 3 * 65536 + 7, 1 << 20]])
def test_chunks_hashed_as_they_land_in_any_order_give_the_whole_payloads(patterns, cuts):
    n = 1 << 20
    src = np.frombuffer(patterns[n], np.uint8)
    buf = np.zeros(n, np.uint8)
    h = checksum.BatchHash()
    for a, b in reversed(list(zip(cuts, cuts[1:]))):  # last chunk first
        h.add(*checksum.copy_and_hash(buf, a, src[a:b]))
    assert bytes(buf) == patterns[n]
    assert h.finish(buf, n) == CPP_CHECKSUMS[n]


def test_a_changed_or_moved_byte_changes_the_checksum(patterns):
    base = bytearray(patterns[4096])
    want = CPP_CHECKSUMS[4096]
    flipped = bytearray(base)
    flipped[1234] ^= 1
    assert checksum.payload_checksum(bytes(flipped)) != want
    swapped = base[64:128] + base[:64] + base[128:]  # two stripes exchanged
    assert checksum.payload_checksum(bytes(swapped)) != want


def canonical(batch_id, offset, count, payload):
    """The target's envelope (common/chunk_envelope.cc EncodeChunkEnvelope): every field, zeros
    included, in field order, then the payload."""
    inner = (b"\x08" + varint(batch_id) + b"\x10" + varint(offset) + b"\x18" + varint(count)
             + b"\x22" + varint(len(payload)) + payload)
    return b"\x12" + varint(len(inner)) + inner


@pytest.mark.parametrize("batch_id, offset, count, size", [
    (1, 0, 1, 256), (2**63 + 5, 0, 0, 0), (300, 2**40, 17, 4 << 20), (0, 0, 0, 1)])
def test_envelope_reads_protobufs_form_and_the_canonical_one(batch_id, offset, count, size):
    payload = bytes(range(256)) * (size // 256) + b"\x07" * (size % 256)
    r = proto.StreamResponse()
    r.chunk.batch_id = batch_id
    r.chunk.token_offset = offset
    r.chunk.token_count = count
    r.chunk.data = payload
    for msg in (r.SerializeToString(), canonical(batch_id, offset, count, payload)):
        e = envelope.decode(msg)
        assert e is not None
        assert (e.batch_id, e.token_offset, e.token_count) == (batch_id, offset, count)
        assert e.payload_bytes == size and msg[e.envelope_bytes:] == payload
        # The authority agrees.
        parsed = proto.StreamResponse.FromString(msg)
        assert parsed.chunk.batch_id == batch_id and parsed.chunk.data == payload


def test_envelope_declines_what_it_does_not_read():
    done = proto.StreamResponse()
    done.done.batch_id = 3
    assert envelope.decode(done.SerializeToString()) is None  # not a chunk
    assert envelope.decode(b"") is None
    msg = canonical(5, 0, 2, b"ab")
    assert envelope.decode(msg[:-1]) is None  # cut short
    trailing = bytearray(msg) + b"\x28\x01"  # a field after the data
    trailing[1] += 2
    assert envelope.decode(bytes(trailing)) is None
    assert proto.StreamResponse.FromString(bytes(trailing)).chunk.data == b"ab"
    # An unknown field before the data is skipped, as protobuf keeps it as unknown.
    inner = b"\x08\x05\x38\x09\x22\x02ab"
    e = envelope.decode(b"\x12" + bytes([len(inner)]) + inner)
    assert e is not None and (e.batch_id, e.payload_bytes) == (5, 2)
