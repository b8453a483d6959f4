"""How the pure-Python client reaches targets with the grpcio package: channels (TLS, the
options the C++ client sets), the bearer token, GetTargetInfo, dns:/// expansion, and failed
calls explained in words a trainer acts on (client/src/credentials.cc, target_info.cc).
"""

from __future__ import annotations

import socket
from typing import List, Optional, Tuple

try:
    import grpc
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "draftfeed's pure-Python client needs the grpcio package (pip install grpcio; "
        f"Debian: apt install python3-grpcio): {e}") from None

from . import proto


class StatusError(Exception):
    """A failed step, as (google.rpc code, message): the Feed layer raises DraftfeedError."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


INVALID_ARGUMENT, FAILED_PRECONDITION, UNAVAILABLE, UNAUTHENTICATED = 3, 9, 14, 16
_MAX_TOKEN_BYTES = 256  # what a target's token file accepts (server/service/auth_tokens.h)
_MAX_PEM_BYTES = 1 << 20


def _read_pem(option: str, path: str, label: str) -> bytes:
    try:
        with open(path, "rb") as f:
            pem = f.read(_MAX_PEM_BYTES + 1)
    except OSError:
        raise StatusError(INVALID_ARGUMENT, f"{option} {path}: cannot open") from None
    if len(pem) > _MAX_PEM_BYTES:
        raise StatusError(INVALID_ARGUMENT, f"{option} {path}: {len(pem)} bytes is too large "
                                            f"for a PEM file")
    text = pem.decode("latin-1")
    at = text.find("-----BEGIN ")
    while at >= 0:
        start = at + len("-----BEGIN ")
        end = text.find("-----", start)
        if end < 0:
            break
        if text[start:end].endswith(label):
            return pem
        at = text.find("-----BEGIN ", at + 1)
    raise StatusError(INVALID_ARGUMENT,
                      f"{option} {path}: no PEM '-----BEGIN ...{label}-----' block in it")


class Credentials:
    """TLS and the token of every channel and call of one feed (ClientCredentials)."""

    def __init__(self, tls: Optional[dict], token: str):
        self.metadata: Tuple[Tuple[str, str], ...] = ()
        if token:
            if len(token) > _MAX_TOKEN_BYTES:
                raise StatusError(INVALID_ARGUMENT, f"token: {len(token)} characters; a target "
                                                    f"accepts at most {_MAX_TOKEN_BYTES}")
            if any(c <= " " or c > "~" for c in token):
                raise StatusError(INVALID_ARGUMENT,
                                  "token: holds a space or a character that is not printable "
                                  "ASCII (a header cannot carry it)")
            self.metadata = (("authorization", f"Bearer {token}"),)
        self.tls = tls is not None
        self.ca_given = bool(tls and tls.get("ca_file"))
        self.has_client_cert = bool(tls and tls.get("cert_file"))
        self.server_name = (tls or {}).get("server_name", "")
        self.channel_credentials = None
        if not self.tls:
            return
        cert, key = tls.get("cert_file", ""), tls.get("key_file", "")
        if bool(cert) != bool(key):
            raise StatusError(INVALID_ARGUMENT,
                              "tls: a key without its certificate (give both cert and key, for "
                              "mutual TLS)" if not cert else
                              "tls: a certificate without its key (give both cert and key, for "
                              "mutual TLS)")
        roots = _read_pem("tls ca_file", tls["ca_file"], "CERTIFICATE") if self.ca_given else None
        chain = _read_pem("tls cert_file", cert, "CERTIFICATE") if cert else None
        private = _read_pem("tls key_file", key, "PRIVATE KEY") if cert else None
        # No roots: gRPC's default trust store (the system's, or grpcio's bundled roots).
        self.channel_credentials = grpc.ssl_channel_credentials(
            root_certificates=roots, private_key=private, certificate_chain=chain)

    def channel(self, address: str, dns_name: str = "") -> "grpc.Channel":
        options = [
            ("grpc.max_receive_message_length", -1),
            ("grpc.max_send_message_length", -1),
            # Each stream gets its own connection even when two share an address.
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
            # 16 MiB HTTP/2 frames: a 4 MiB chunk arrives as one frame, not 256.
            ("grpc.http2.max_frame_size", (1 << 24) - 1),
        ]
        if not self.tls:
            return grpc.insecure_channel(address, options=options)
        name = self.server_name or dns_name
        if name:
            options.append(("grpc.ssl_target_name_override", name))
        return grpc.secure_channel(address, self.channel_credentials, options=options)

    def explain(self, code: int, message: str) -> Tuple[int, str]:
        """What a TLS failure in a failed call means and which option fixes it, ahead of
        gRPC's own words; other failures as they are."""
        closed = any(s in message for s in ("Socket closed", "Connection reset", "Broken pipe"))
        why = ""
        if "wrong version number" in message:
            why = ("TLS handshake failed: the target does not speak TLS (it was started without "
                   "--tls_cert); connect without tls")
        elif "certificate verify failed" in message or "CERTIFICATE_VERIFY_FAILED" in message:
            why = ("TLS: the target's certificate was refused: it does not chain to "
                   + ("the CA of tls ca_file" if self.ca_given else
                      "a CA of the system's trust store (give tls ca_file)")
                   + ", or it has expired or is not yet valid")
        elif "not in peer certificate" in message:
            why = ("TLS: the target's certificate does not name the host connected to (give tls "
                   "server_name: the name it carries)")
        elif closed and self.tls:
            why = ("the target closed the connection in the TLS handshake: it refused this "
                   "client's certificate (not signed by its --tls_client_ca, or expired)"
                   if self.has_client_cert else
                   "the target closed the connection in the TLS handshake: it requires a client "
                   "certificate (mutual TLS: give tls cert_file and key_file)")
        elif closed:
            why = ("the target closed the connection: it may serve TLS only (started with "
                   "--tls_cert); connect with tls")
        return (code, f"{why} [{message}]") if why else (code, message)


def rpc_status(e: "grpc.RpcError") -> Tuple[int, str]:
    """(code number, details) of a failed grpcio call."""
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return (code.value[0] if code is not None else 2), details or ""


def explain_call_failure(code: int, message: str, address: str, call: str,
                         timeout_s: float) -> Tuple[int, str]:
    why = ""
    if "Connection refused" in message:
        why = ("connection refused (nothing listens there: is draftfeed-target running, on that "
               "port?)")
    elif any(s in message for s in ("DNS resolution failed", "Domain name not found",
                                    "Name or service not known")):
        why = "name not resolved (no such host)"
    elif "No route to host" in message or "Network is unreachable" in message:
        why = "host unreachable (no route to it)"
    elif code == 4:
        why = (f"no answer within {timeout_s:g}s (the host is down, firewalled, or too busy to "
               f"answer)")
    if not why:
        return code, f"target {address}: {call}: {message}"
    return code, f"target {address}: {why} [{call}: {message}]"


def _wire_name(names: dict, number: int, prefix: str) -> str:
    name = names.get(number)
    if name is None:
        return str(number)  # a number this client's proto lacks stays a number
    return (name[len(prefix):] if name.startswith(prefix) else name).lower()


def describe(address: str, info) -> dict:
    """A TargetInfo message as describe_target's dict (the native client's keys)."""
    encodings = proto.ENCODING_NAMES
    offer = None
    if info.HasField("target_outputs"):
        o = info.target_outputs
        offer = {"max_top_k": o.max_top_k, "max_draft_vocab": o.max_draft_vocab,
                 "draft_probs_encodings": [_wire_name(encodings, e, "ENCODING_")
                                           for e in o.draft_probs_encodings]}
        if o.max_draft_vocab <= 0:
            offer = None
    layout = {"tp": 1, "moe_parallel": "", "rank_weight_bytes": 0}
    if info.HasField("layout"):
        layout = {"tp": max(1, info.layout.tp), "moe_parallel": info.layout.moe_parallel,
                  "rank_weight_bytes": info.layout.rank_weight_bytes}
    return {
        "address": address, "model_id": info.model_id, "architecture": info.architecture,
        "fingerprint": info.fingerprint, "server_version": info.server_version,
        "num_layers": info.num_layers, "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size, "max_batch_tokens": info.max_batch_tokens,
        "max_sequence_tokens": info.max_sequence_tokens or info.max_batch_tokens,
        "batch_invariant": info.batch_invariant, "numerics": info.numerics,
        "devices": list(info.devices), "layer_types": list(info.layer_types),
        "dtype": info.dtype,
        "transports": [_wire_name(proto.TRANSPORT_NAMES, t, "TRANSPORT_")
                       for t in info.transports],
        "encodings": [_wire_name(encodings, e, "ENCODING_") for e in info.encodings],
        "nccl_across_hosts": info.nccl_across_hosts, "max_credits": info.max_credits,
        "max_capture_layers": info.max_capture_layers, "target_outputs": offer,
        "layout": layout,
    }


def query_info(channel, address: str, timeout_s: float, creds: Credentials) -> dict:
    """GetTargetInfo, failing as soon as the connection does (wait_for_ready off), with the
    reason in words; StatusError otherwise."""
    call = channel.unary_unary(proto.INFO_METHOD,
                               request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=proto.TargetInfo.FromString)
    try:
        info = call(proto.GetTargetInfoRequest(), timeout=timeout_s, metadata=creds.metadata,
                    wait_for_ready=False)
    except grpc.RpcError as e:
        code, message = rpc_status(e)
        code, message = explain_call_failure(code, message, address, "GetTargetInfo", timeout_s)
        raise StatusError(*creds.explain(code, message)) from None
    return describe(address, info)


def dns_name_of(target: str) -> str:
    """"dns:///name:port" -> "name" (what its addresses' certificates must carry), else ""."""
    if not target.startswith("dns:///"):
        return ""
    rest = target[len("dns:///"):]
    return rest[:rest.rfind(":")] if ":" in rest else rest


def expand_target(target: str) -> List[str]:
    """"dns:///name:port" -> every address the name resolves to; anything else as it is."""
    if not target.startswith("dns:///"):
        return [target]
    rest = target[len("dns:///"):]
    if ":" not in rest:
        raise StatusError(INVALID_ARGUMENT, f"target {target} has no :port")
    host, port = rest[:rest.rfind(":")], rest[rest.rfind(":") + 1:]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise StatusError(UNAVAILABLE, f"target {target}: name not resolved ({e})") from None
    out = set()
    for family, _, _, _, addr in infos:
        if family == socket.AF_INET:
            out.add(f"{addr[0]}:{port}")
        elif family == socket.AF_INET6:
            out.add(f"[{addr[0]}]:{port}")
    return sorted(out)


def describe_target(address: str, timeout_s: float, tls: Optional[dict], token: str):
    """The compiled module's describe_target: (code, message, dict)."""
    try:
        creds = Credentials(tls, token)
        channel = creds.channel(address)
        try:
            return 0, "", query_info(channel, address, timeout_s, creds)
        finally:
            channel.close()
    except StatusError as e:
        return e.code, e.message, None
