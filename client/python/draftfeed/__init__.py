"""draftfeed: hidden states of a frozen target LLM, streamed to drafter trainers.

    import draftfeed
    with draftfeed.Feed(targets=["127.0.0.1:50051"], layers=[1, 3, -1], prefetch=8) as feed:
        for result in feed.map(batches):          # batches: (token_ids, seq_lens) pairs
            h = result.torch()                     # [T, K, H] in the capture's dtype (bf16)
            x = h.view(result.num_tokens, -1)      # the concatenation DFlash's fc takes

Layer ids: i is the raw output of decoder layer i (transformers' hidden_states[i+1]);
-1 is the post-final-norm state (hidden_states[num_layers]).
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator, Optional, Sequence, Tuple

import numpy as np

from . import _draftfeed

__all__ = ["Feed", "Result", "DraftfeedError", "describe_target", "FINAL_LAYER"]

FINAL_LAYER = -1

# google.rpc.Code names, for messages and for `DraftfeedError.code_name`.
_CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class DraftfeedError(RuntimeError):
    """A draftfeed call failed. `code` is the gRPC/absl status code number."""

    def __init__(self, code: int, message: str):
        self.code = code
        self.code_name = _CODE_NAMES.get(code, str(code))
        self.message = message
        super().__init__(f"{self.code_name}: {message}")


# Per capture encoding: the torch dtype it is, and how its bit patterns
# (Result.hidden_bits) widen to float32 losslessly. An encoding missing here
# fails by name (UNIMPLEMENTED) instead of being read as another.
_TORCH_DTYPES = {"bf16": "bfloat16"}
_TO_FLOAT32 = {"bf16": lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)}


def _unsupported(encoding: str) -> "DraftfeedError":
    return DraftfeedError(12, f"this draftfeed client cannot read captures encoded as "
                              f"{encoding!r} (it reads {sorted(_TORCH_DTYPES)})")


def _check(triple):
    code, message, value = triple
    if code != 0:
        raise DraftfeedError(code, message)
    return value


def describe_target(address: str, timeout_s: float = 10.0) -> dict:
    """Model id, fingerprint, layer count, hidden size, ... of one target."""
    return _check(_draftfeed.describe_target(address, timeout_s))


class Result:
    """One batch's hidden states: `hidden` is [T, K, H] (K = layers in the order asked)."""

    __slots__ = ("_r",)

    def __init__(self, r):
        self._r = r

    batch_id = property(lambda self: self._r.batch_id)
    num_tokens = property(lambda self: self._r.num_tokens)
    num_layers = property(lambda self: self._r.num_layers)
    hidden_size = property(lambda self: self._r.hidden_size)
    checksum = property(lambda self: self._r.checksum)
    target = property(lambda self: self._r.target)
    timings = property(lambda self: self._r.timings)
    token_ids = property(lambda self: self._r.token_ids, doc="int32 [T], as submitted")
    seq_lens = property(lambda self: self._r.seq_lens, doc="int32 [num_sequences]")
    hidden_bits = property(lambda self: self._r.hidden_bits,
                           doc="[T, K, H] bit patterns, no copy (uint16 for bf16)")
    encoding = property(lambda self: self._r.encoding,
                        doc='how the capture\'s bytes encode its values: "bf16"')
    bytes_per_token = property(lambda self: self._r.bytes_per_token,
                               doc="capture bytes per token (K * H * 2 for bf16)")

    device = property(lambda self: self._r.device,
                      doc="-1: host memory (gRPC); else the CUDA device holding it (NCCL)")

    @property
    def hidden(self):
        """float32 numpy [T, K, H] for host results; exact (bf16 widens losslessly).

        Results that came by NCCL are already on the GPU: `hidden` is then the
        torch tensor on that device (no copy), as `torch()` returns.
        """
        if self._r.device >= 0:
            return self.torch()
        widen = _TO_FLOAT32.get(self._r.encoding)
        if widen is None:
            raise _unsupported(self._r.encoding)
        return widen(self._r.hidden_bits)

    def __dlpack__(self, stream=None):
        # NCCL results are complete before they are returned (the receive was
        # waited for), so no stream ordering is needed by the consumer.
        return self._r.dlpack_capsule()

    def __dlpack_device__(self):
        d = self._r.device
        return (2, d) if d >= 0 else (1, 0)  # kDLCUDA / kDLCPU

    def torch(self, device=None, non_blocking: bool = True):
        """Torch tensor [T, K, H] in the capture's dtype (bf16: torch.bfloat16)
        through DLPack (no copy on CPU).

        With `device` (e.g. "cuda:0") it is copied there; from pinned memory the
        copy is asynchronous when `non_blocking`.
        """
        import torch

        dtype_name = _TORCH_DTYPES.get(self._r.encoding)
        if dtype_name is None:
            raise _unsupported(self._r.encoding)
        dtype = getattr(torch, dtype_name)
        try:
            t = torch.utils.dlpack.from_dlpack(self)
        except (TypeError, RuntimeError, BufferError):
            if self._r.device >= 0:
                raise
            # Older torch without this dtype's DLPack import: the same bytes,
            # reinterpreted (signed integers of the same width, which torch has).
            bits = self._r.hidden_bits
            t = torch.from_numpy(bits.view(np.dtype(f"i{bits.dtype.itemsize}"))).view(dtype)
        if device is not None:
            t = t.to(device, non_blocking=non_blocking)
        return t

    def __repr__(self):
        return (f"Result(batch_id={self.batch_id}, hidden=[{self.num_tokens}, {self.num_layers}, "
                f"{self.hidden_size}] {self.encoding}, target={self.target!r})")


Batch = Tuple[Sequence[int], Sequence[int]]


class Feed:
    """Sends packed token batches to target servers and yields their hidden states.

    Args:
      targets: addresses ("host:port") of draftfeed-target servers, or
        "dns:///name:port" (every address the name resolves to; re-resolved, so a
        Kubernetes headless service's new pods join).
      layers: layer ids to capture, in output order (-1 = final normed state).
      prefetch: batches in flight before `submit` blocks.
      prefetch_bytes: the same bound in hidden-state bytes.
      ordered: results in submission order (default) or as they complete.
      credits_per_target: batches each target may hold for this feed (per connection).
      connections_per_target: streams, each on its own TCP connection, per target
        address (advanced keyword; default 1).
      read_handoff: each gRPC connection reads on one thread and copies chunks
        into their batches on a second (advanced keyword; default None: on
        where the machine has 4 or more cores).
      expected_fingerprint: refuse targets serving another model; default: the
        first target's fingerprint, which every other target must match.
      verify_checksum: check every batch against the target's checksum.
      batch_timeout_s: a batch without progress this long marks its target hung;
        its batches go to other targets.
      unavailable_timeout_s: with no live target this long, calls raise
        UNAVAILABLE instead of waiting forever.
      progress_every_s: when > 0, `map` prints a progress line this often.
      transport: "grpc" (default; results in host memory), "nccl" (results land
        GPU to GPU in `cuda_device`'s memory; the targets must run on this host,
        each on one GPU other than `cuda_device`) or "auto" (NCCL with the
        targets where it works, gRPC with the others; `stats()` says which and
        why per target).
      cuda_device: the GPU index that receives, for "nccl" and "auto".

    A batch whose target dies, hangs or shuts down is re-sent to another target;
    duplicates are dropped by batch id, so each batch comes back exactly once.
    """

    def __init__(self, targets: Sequence[str], layers: Sequence[int], prefetch: int = 8,
                 prefetch_bytes: int = 1 << 30, ordered: bool = True,
                 credits_per_target: int = 4, expected_fingerprint: str = "",
                 verify_checksum: bool = True, connect_timeout_s: float = 30.0,
                 batch_timeout_s: float = 120.0, unavailable_timeout_s: float = 60.0,
                 client_name: str = "", progress_every_s: float = 0.0,
                 transport: str = "grpc", cuda_device: int = -1, **advanced):
        if isinstance(targets, str):
            targets = [targets]
        opts = dict(prefetch=int(prefetch), prefetch_bytes=int(prefetch_bytes),
                    ordered=bool(ordered), credits_per_target=int(credits_per_target),
                    expected_fingerprint=expected_fingerprint,
                    verify_checksum=bool(verify_checksum),
                    connect_timeout_s=float(connect_timeout_s),
                    batch_timeout_s=float(batch_timeout_s),
                    unavailable_timeout_s=float(unavailable_timeout_s), client_name=client_name,
                    transport=str(transport), cuda_device=int(cuda_device))
        opts.update(advanced)  # reconnect_backoff_min_s, reconnect_backoff_max_s, dns_refresh_s
        self._feed = _check(_draftfeed.Feed.open(list(targets), [int(l) for l in layers], opts))
        self.prefetch = int(prefetch)
        self.layers = [int(l) for l in layers]
        self.progress_every_s = float(progress_every_s)
        self._outstanding = 0
        self._last_progress = 0.0

    @property
    def target(self) -> dict:
        """Description of the first target (model id, fingerprint, sizes)."""
        return self._feed.target()

    def add_target(self, address: str) -> None:
        """Adds a target to the running feed; it receives work once connected."""
        _check(self._feed.add_target(address))

    def submit(self, token_ids, seq_lens) -> int:
        """Queues one packed batch; returns its batch id. Blocks beyond `prefetch`."""
        token_ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        seq_lens = np.ascontiguousarray(seq_lens, dtype=np.int32)
        batch_id = _check(self._feed.submit(token_ids, seq_lens))
        self._outstanding += 1
        return batch_id

    def next(self) -> Result:
        """The next result (submission order unless ordered=False).

        Raises DraftfeedError for a batch the target refused (the feed stays
        usable) or when no target has been reachable for unavailable_timeout_s.
        """
        self._outstanding -= 1
        return Result(_check(self._feed.next()))

    def map(self, batches: Iterable[Batch]) -> Iterator[Result]:
        """Keeps `prefetch` batches in flight; yields their results."""
        it = iter(batches)
        exhausted = False
        while True:
            while not exhausted and self._outstanding < self.prefetch:
                try:
                    token_ids, seq_lens = next(it)
                except StopIteration:
                    exhausted = True
                    break
                self.submit(token_ids, seq_lens)
            if self._outstanding == 0:
                return
            yield self.next()
            if self.progress_every_s > 0:
                now = time.monotonic()
                if now - self._last_progress >= self.progress_every_s:
                    self._last_progress = now
                    print(self.progress_line(), flush=True)

    def stats(self) -> dict:
        """Counters for dashboards (wandb, tensorboard): see README "Feed statistics"."""
        s = self._feed.stats()
        s["tokens_per_s"] = s["tokens_delivered"] / s["elapsed_s"] if s["elapsed_s"] > 0 else 0.0
        s["queue_depth"] = s["outstanding"]
        return s

    def progress_line(self) -> str:
        """One line: delivered batches and tokens, tokens/s, queue, per-target state."""
        s = self.stats()
        per = ", ".join(
            f"{t['address']} {t['state']} {t['outstanding_batches']} out/{t['delivered_batches']} done"
            + (f"/{t['failures']} lost" if t["failures"] else "")
            for t in s["targets"])
        return (f"draftfeed: {s['delivered']} batches, {s['tokens_delivered']} tokens, "
                f"{s['tokens_per_s']:,.0f} tok/s, queue {s['queue_depth']}"
                + (f", resent {s['resent']}" if s["resent"] else "")
                + f" | {per}")

    def close(self) -> None:
        if self._feed is not None:
            feed, self._feed = self._feed, None
            _check(feed.close())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
