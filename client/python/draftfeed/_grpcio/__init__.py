"""draftfeed's pure-Python client: the compiled module's interface (Feed.open, describe_target,
results) over the pip `grpcio` and `protobuf` packages, for Pythons and images the compiled
module was not built for. draftfeed.Feed picks it when `draftfeed._draftfeed` is missing, or
when asked (Feed(transport="grpcio"), DRAFTFEED_TRANSPORT=grpcio).
"""

from .channel import describe_target  # noqa: F401
from .checksum import payload_checksum  # noqa: F401
from .feed import Feed  # noqa: F401

NAME = "grpcio"
