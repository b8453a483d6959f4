"""Which client a Feed runs on: the compiled one (`_draftfeed`: C++ gRPC, and NCCL where built
with it) where it loads, else the pure-Python one over the pip grpcio and protobuf packages
(draftfeed/_grpcio), which has the same Feed and Result.

    DRAFTFEED_TRANSPORT=grpcio          every feed on the pure-Python client (the compiled
                                        module is not even loaded)
    Feed(..., transport="grpcio")       this feed on it
    Feed(..., transport="grpc")         the compiled client's gRPC where it loaded, else grpcio

NCCL ("nccl", "auto") needs the compiled client; the pure-Python one refuses it by name.
"""

from __future__ import annotations

import os
import pathlib
import warnings
from typing import Optional

from ._native import load as _load_native

TRANSPORT_ENV = "DRAFTFEED_TRANSPORT"
TRANSPORTS = ("grpc", "grpcio", "nccl", "auto")

native = None
native_import_error = ""  # why the compiled module did not load ("" when it did)
if os.environ.get(TRANSPORT_ENV, "") == "grpcio":
    native_import_error = f"not loaded: {TRANSPORT_ENV}=grpcio"
else:
    try:
        native = _load_native()
    except ImportError as e:  # the message names the Python it was built for
        native_import_error = str(e)
        here = pathlib.Path(__file__).resolve().parent
        if any(here.glob("_draftfeed*.so")):
            # A compiled module that is there but does not load (another Python's, a library
            # missing) is a fast path lost: say so once; a pure-Python install has none.
            warnings.warn(f"{native_import_error}; draftfeed runs on its pure-Python client "
                          f"(grpcio)", RuntimeWarning, stacklevel=2)

_grpcio_module = None


def grpcio():
    """The pure-Python client, imported on first use (it needs grpcio and protobuf)."""
    global _grpcio_module
    if _grpcio_module is None:
        try:
            from . import _grpcio as module
        except ImportError as e:
            if native is None:
                raise ImportError(f"draftfeed has no client to run: the compiled module did not "
                                  f"load ({native_import_error}) and the pure-Python one needs "
                                  f"grpcio and protobuf ({e})") from None
            raise
        _grpcio_module = module
    return _grpcio_module


def client_for(transport: Optional[str]):
    """(module, the transport to give it, "native" or "grpcio") for Feed(transport=...); None
    is DRAFTFEED_TRANSPORT's value, else "grpc"."""
    if transport is None:
        transport = os.environ.get(TRANSPORT_ENV, "") or "grpc"
    transport = str(transport)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be 'grpc', 'grpcio', 'nccl' or 'auto', got "
                         f"'{transport}'")
    if transport == "grpcio" or native is None:
        return grpcio(), ("grpc" if transport == "grpcio" else transport), "grpcio"
    return native, transport, "native"
