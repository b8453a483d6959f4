"""draftfeed.v1's message classes, built at import time from the serialized descriptor.

No generated _pb2 module: gencode from one protoc is refused by protobuf runtimes of another
major version (gencode 3.21 under protobuf 5.x fails on import), and trainer images bring
whatever protobuf their other packages pinned. A FileDescriptorSet is read by every runtime
since 3.x, so the package ships draftfeed_v1.desc (protoc --descriptor_set_out
--include_imports of proto/draftfeed/v1/draftfeed.proto; tests/client/python checks it matches)
and builds the classes from it in a pool of its own, which cannot clash with a generated
draftfeed module a process may also import.

Regenerate after editing the .proto (from the repository root):
    protoc --descriptor_set_out=client/python/draftfeed/_grpcio/draftfeed_v1.desc \
        --include_imports -Iproto proto/draftfeed/v1/draftfeed.proto
"""

from __future__ import annotations

import pathlib

try:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "draftfeed's pure-Python client needs the protobuf package (pip install protobuf; "
        f"Debian: apt install python3-protobuf): {e}") from None

DESCRIPTOR_FILE = pathlib.Path(__file__).with_name("draftfeed_v1.desc")
PACKAGE = "draftfeed.v1"
SERVICE = f"/{PACKAGE}.TargetService"
STREAM_METHOD = f"{SERVICE}/StreamHiddenStates"
INFO_METHOD = f"{SERVICE}/GetTargetInfo"


def _load_pool() -> "descriptor_pool.DescriptorPool":
    files = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_FILE.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for f in files.file:  # dependencies first, as --include_imports writes them
        pool.AddSerializedFile(f.SerializeToString())
    return pool


POOL = _load_pool()


def message_class(name: str):
    """The class of message `name` of draftfeed.v1 (e.g. "StreamResponse")."""
    desc = POOL.FindMessageTypeByName(f"{PACKAGE}.{name}")
    get = getattr(message_factory, "GetMessageClass", None)  # protobuf >= 4.22
    if get is not None:
        return get(desc)
    return message_factory.MessageFactory(POOL).GetPrototype(desc)


def enum_names(name: str) -> dict:
    """{number: name} of enum `name` of draftfeed.v1 (e.g. "Encoding")."""
    return {v.number: v.name for v in POOL.FindEnumTypeByName(f"{PACKAGE}.{name}").values}


StreamRequest = message_class("StreamRequest")
StreamResponse = message_class("StreamResponse")
Batch = message_class("Batch")
GetTargetInfoRequest = message_class("GetTargetInfoRequest")
TargetInfo = message_class("TargetInfo")
ENCODING_NAMES = enum_names("Encoding")
TRANSPORT_NAMES = enum_names("Transport")

ENCODING_BF16 = 1
ENCODING_FP8_E4M3 = 2
TRANSPORT_UNSPECIFIED = 0
TRANSPORT_GRPC = 1
