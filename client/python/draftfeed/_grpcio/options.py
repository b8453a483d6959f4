"""Feed options as draftfeed.Feed hands them over (the compiled module's FeedOptions by name),
checked as client/src/feed.cc, transports.cc and target_outputs.cc check them."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .channel import INVALID_ARGUMENT, StatusError

UNIMPLEMENTED = 12
MAX_TOP_K = 256
MAX_DRAFT_VOCAB = 65536
ENCODINGS = {"bf16": 1, "fp8_e4m3": 2}

NO_NCCL = ("this is draftfeed's pure-Python client (grpcio), without NCCL: use transport "
           "'grpc', or install draftfeed with its compiled module built with NCCL "
           "(pip install --no-build-isolation ./client/python with DRAFTFEED_CMAKE_ARGS="
           "-DDRAFTFEED_ENABLE_CUDA=ON; see client/python/README.md)")


@dataclass
class Options:
    targets: list = field(default_factory=list)
    layers: list = field(default_factory=list)
    prefetch: int = 8
    prefetch_bytes: int = 1 << 30
    ordered: bool = True
    credits_per_target: int = 4
    connections_per_target: int = 1
    read_handoff: Optional[bool] = None
    expected_fingerprint: str = ""
    verify_checksum: bool = True
    encoding: str = "bf16"
    fp8_raw: bool = False
    argmax: bool = False
    top_k: int = 0
    draft_vocab: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    probs_encoding: str = "bf16"
    connect_timeout_s: float = 30.0
    batch_timeout_s: float = 120.0
    unavailable_timeout_s: float = 60.0
    reconnect_backoff_min_s: float = 0.2
    reconnect_backoff_max_s: float = 5.0
    dns_refresh_s: float = 10.0
    stats_window_s: float = 30.0
    client_name: str = ""
    transport: str = "grpc"
    cuda_device: int = -1
    nccl_timeout_s: float = 120.0
    nccl_setup_timeout_s: float = 60.0
    nccl_across_hosts: bool = False
    nccl_socket_ifname: str = ""
    tls: Optional[dict] = None
    token: str = ""
    # Threads that copy and hash chunks into their batches (read_handoff); 0: by cores.
    copy_threads: int = 0

    def has_outputs(self) -> bool:
        return bool(self.argmax or self.top_k or self.draft_vocab.size)


def _encoding(value, what: str) -> str:
    if value not in ENCODINGS:
        raise ValueError(f"{what} must be 'bf16' or 'fp8_e4m3', got '{value}'")
    return value


def parse(targets, layers, opts: dict) -> Options:
    """Options from the Feed's dict; ValueError for an unknown key or a bad name, as the
    compiled module raises them."""
    o = Options(targets=list(targets), layers=[int(x) for x in layers])
    for key, value in opts.items():
        if not hasattr(o, key) or key in ("targets", "layers"):
            raise ValueError(f"unknown Feed option: {key}")
        if key in ("encoding", "probs_encoding"):
            value = _encoding(value, key)
        elif key == "transport":
            if value not in ("grpc", "nccl", "auto"):
                raise ValueError(f"transport must be 'grpc', 'nccl' or 'auto', got '{value}'")
        elif key == "draft_vocab":
            value = (np.zeros(0, np.int32) if value is None
                     else np.ascontiguousarray(value, dtype=np.int32).reshape(-1))
        elif key == "read_handoff":
            value = None if value is None else bool(value)
        elif key == "tls":
            value = None if value is None else dict(value)
        elif key == "token" and value is None:
            value = ""
        setattr(o, key, value)
    return o


def _check_outputs(o: Options) -> None:
    def bad(why):
        raise StatusError(INVALID_ARGUMENT, f"FeedOptions.target_outputs.{why}")

    if not 0 <= o.top_k <= MAX_TOP_K:
        bad(f"top_k is {o.top_k}: it must be in [0, {MAX_TOP_K}] (at most {MAX_TOP_K} and the "
            f"vocabulary's {2**31 - 1})")
    ids = o.draft_vocab
    if ids.size > MAX_DRAFT_VOCAB:
        bad(f"draft_vocab has {ids.size} ids: at most {MAX_DRAFT_VOCAB} are served")
    if ids.size:
        neg = np.flatnonzero(ids < 0)
        if neg.size:
            j = int(neg[0])
            bad(f"draft_vocab[{j}] is {int(ids[j])}, outside the target's vocabulary [0, "
                f"{2**31 - 1})")
        order = np.argsort(ids, kind="stable")
        s = ids[order]
        dup = np.flatnonzero(s[1:] == s[:-1])
        if dup.size:
            i = int(dup[0])
            bad(f"draft_vocab lists id {int(s[i])} twice (at {int(order[i])} and "
                f"{int(order[i + 1])})")


def check(o: Options) -> None:
    """StatusError for what no target could serve or the options contradict."""
    if not o.targets:
        raise StatusError(INVALID_ARGUMENT, "FeedOptions.targets is empty")
    _check_outputs(o)
    if not o.layers and not o.has_outputs():
        raise StatusError(INVALID_ARGUMENT, "FeedOptions.layers is empty: name the layer ids to "
                                            "capture (or ask for target_outputs)")
    if o.prefetch < 1:
        raise StatusError(INVALID_ARGUMENT, "FeedOptions.prefetch must be >= 1")
    if o.credits_per_target < 1:
        raise StatusError(INVALID_ARGUMENT, "FeedOptions.credits_per_target must be >= 1")
    if not 1 <= o.connections_per_target <= 64:
        raise StatusError(INVALID_ARGUMENT, f"FeedOptions.connections_per_target must be in "
                                            f"[1, 64], got {o.connections_per_target}")
    if not (o.stats_window_s > 0 and math.isfinite(o.stats_window_s)):
        raise StatusError(INVALID_ARGUMENT, f"FeedOptions.stats_window_s must be a number of "
                                            f"seconds > 0, got {o.stats_window_s}")
    if o.fp8_raw and o.encoding != "fp8_e4m3":
        raise StatusError(INVALID_ARGUMENT, f"FeedOptions.fp8_raw asks for the fp8 bytes, but "
                                            f"FeedOptions.encoding is {o.encoding}, not fp8_e4m3")
    for name in ("nccl_timeout_s", "nccl_setup_timeout_s"):
        v = getattr(o, name)
        if not (v > 0 and math.isfinite(v)):
            raise StatusError(INVALID_ARGUMENT, f"FeedOptions.{name} must be a finite number of "
                                                f"seconds > 0, got {v}")
    if o.transport == "grpc":
        if o.nccl_across_hosts:
            raise StatusError(INVALID_ARGUMENT,
                              "FeedOptions.nccl_across_hosts is set but FeedOptions.transport is "
                              "grpc: it lets transport auto use NCCL with targets on other hosts "
                              "(transport nccl crosses hosts unasked)")
        if o.nccl_socket_ifname:
            raise StatusError(INVALID_ARGUMENT,
                              f"FeedOptions.nccl_socket_ifname={o.nccl_socket_ifname} is set but "
                              f"FeedOptions.transport is grpc: it picks NCCL's network interface")
    ifname = o.nccl_socket_ifname
    if any(not (0x21 <= ord(c) <= 0x7E) for c in ifname):  # C's isgraph
        raise StatusError(INVALID_ARGUMENT,
                          f"FeedOptions.nccl_socket_ifname='{ifname}' has whitespace or a control "
                          f"character; NCCL_SOCKET_IFNAME takes interface-name prefixes separated "
                          f"by commas (^ excludes, = matches a name exactly), e.g. eth0 or "
                          f"^docker,lo")
    if o.transport != "grpc":
        raise StatusError(UNIMPLEMENTED, NO_NCCL)
    if o.copy_threads < 0:
        raise StatusError(INVALID_ARGUMENT, f"copy_threads must be >= 0, got {o.copy_threads}")


def copy_threads(o: Options) -> int:
    """Threads that land chunks: 0 (the reader lands them itself) unless read_handoff, which
    defaults on where the machine has 4 or more cores, as the compiled client's."""
    cores = os.cpu_count() or 1
    handoff = o.read_handoff if o.read_handoff is not None else cores >= 4
    if not handoff:
        return 0
    return o.copy_threads or max(1, min(4, cores // 2))
