"""TLS and bearer tokens for the feed's connections to targets.

    feed = draftfeed.Feed(targets=["gpu-3.lab:50051"], layers=[1, -1],
                          tls=draftfeed.Tls(ca="ca.pem"),   # or tls=True: the system's roots
                          token=open("trainer-a.token").read().strip())

Mutual TLS (a target started with --tls_client_ca): Tls(ca=..., cert=..., key=...).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Union

__all__ = ["Tls"]


@dataclass(frozen=True)
class Tls:
    """TLS to targets started with --tls_cert.

    Args:
      ca: PEM file of the CA certificate(s) the target's certificate must chain to;
        None: the system's trust store.
      cert, key: this client's PEM certificate chain and private key, for targets that
        require client certificates (mutual TLS); both or neither.
      server_name: the name the target's certificate carries, when it is not the host
        of the address (e.g. connecting by IP to a certificate for a name).
    """

    ca: Optional[Union[str, os.PathLike]] = None
    cert: Optional[Union[str, os.PathLike]] = None
    key: Optional[Union[str, os.PathLike]] = None
    server_name: Optional[str] = None

    def __post_init__(self):
        if (self.cert is None) != (self.key is None):
            raise ValueError("Tls: cert and key go together (mutual TLS); got only "
                             + ("cert" if self.key is None else "key"))


# The C++ client (and the pure-Python one, which says the same) names TlsOptions' fields:
# "tls ca_file /x.pem: cannot open", "the CA of tls ca_file". A Python caller wrote
# Tls(ca=..., cert=..., key=..., server_name=...), so its errors name those.
_OPTION_NAMES = (  # the references to an option, as the clients' messages make them
    ("the CA of tls ca_file", "the CA of Tls(ca=...)"),
    ("give tls ca_file", "give Tls(ca=...)"),
    ("give tls cert_file and key_file", "give Tls(cert=..., key=...)"),
    ("give tls server_name", "give Tls(server_name=...)"),
)
_FILE_OPTION = re.compile(r"\btls (ca|cert|key)_file (\S.*?): ")  # "tls ca_file PATH: why"


def python_option_names(message: str) -> str:
    """`message` with the C++ TLS options' names replaced by the Tls arguments':
    "tls ca_file /x.pem: cannot open" -> "Tls(ca='/x.pem'): cannot open"."""
    if "tls " not in message:
        return message
    for cpp, python in _OPTION_NAMES:
        message = message.replace(cpp, python)
    return _FILE_OPTION.sub(lambda m: f"Tls({m.group(1)}={m.group(2)!r}): ", message)


def _native_tls(tls) -> Optional[dict]:
    """The `tls` keyword as the compiled module takes it: None, or TlsOptions by field."""
    if tls is None or tls is False:
        return None
    if tls is True:
        tls = Tls()
    if not isinstance(tls, Tls):
        raise TypeError(f"tls must be None, True or draftfeed.Tls(...), got {type(tls).__name__}")
    return {"ca_file": os.fspath(tls.ca) if tls.ca is not None else "",
            "cert_file": os.fspath(tls.cert) if tls.cert is not None else "",
            "key_file": os.fspath(tls.key) if tls.key is not None else "",
            "server_name": tls.server_name or ""}


def _native_token(token) -> str:
    if token is None:
        return ""
    if not isinstance(token, str):
        raise TypeError(f"token must be a str, got {type(token).__name__}")
    return token
