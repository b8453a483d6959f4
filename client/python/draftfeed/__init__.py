"""draftfeed: hidden states of a frozen target LLM, streamed to drafter trainers.

    import draftfeed
    with draftfeed.Feed(targets=["127.0.0.1:50051"], layers=[1, 3, -1], prefetch=8) as feed:
        for result in feed.map(batches):          # batches: (token_ids, seq_lens) pairs
            h = result.torch()                     # [T, K, H] in the capture's dtype (bf16)
            x = h.view(result.num_tokens, -1)      # the concatenation DFlash's fc takes

Layer ids: i is the raw output of decoder layer i (transformers' hidden_states[i+1]);
-1 is the post-final-norm state (hidden_states[num_layers]).

FP8 on the wire: `Feed(..., encoding="fp8_e4m3")` halves the bytes per token (K*H + 4K: e4m3
codes and one fp32 scale per token and layer). Results still read as bf16 (`torch()`), dequantized
on the way in for gRPC and on the receiving GPU for NCCL; with `fp8_raw=True` they keep the codes
and scales (`Result.values`, `Result.scales`, `Result.fp8()`).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Iterable, Iterator, Optional, Sequence, Tuple

import numpy as np

# The compiled client where it loads, else the pure-Python one (grpcio): _client.py.
from ._client import client_for as _client_for, native_import_error  # noqa: E402,F401

from . import accounting as _acct  # noqa: E402
from .fp8 import E4M3_VALUES, _fp8_torch, dequantize_fp8  # noqa: E402,F401
from . import feed_map as _feed_map  # noqa: E402
from . import layers  # noqa: E402  draftfeed.layers.dflash(L), .eagle3(L)
from . import outputs as _outputs  # noqa: E402
from .stats import ProgressBar, flatten as _flatten_stats  # noqa: E402
from .tls import Tls, _native_tls, _native_token  # noqa: E402
from .tls import python_option_names as _python_option_names  # noqa: E402

__all__ = ["Feed", "Result", "DraftfeedError", "describe_target", "FINAL_LAYER", "Tls",
           "dequantize_fp8", "E4M3_VALUES"]

FINAL_LAYER = -1

# google.rpc.Code names, for messages and for `DraftfeedError.code_name`.
_CODE_NAMES = {
    0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
    13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
}


class DraftfeedError(RuntimeError):
    """A draftfeed call failed. `code` is the gRPC/absl status code number.

    From `Feed.next()`: `consumed_batch` says whether the error took a batch (a batch the
    target refused: it will not come back) and `batch_id` is that batch's id where the feed
    knows it (ordered feeds), else None."""

    def __init__(self, code: int, message: str):
        message = _python_option_names(message)
        self.code = code
        self.code_name = _CODE_NAMES.get(code, str(code))
        self.message = message
        self.batch_id: Optional[int] = None
        self.batch = None  # what Feed.map was given for that batch
        self.consumed_batch = False
        super().__init__(f"{self.code_name}: {message}")


# Per capture encoding: the torch dtype it is, and how its bit patterns
# (Result.hidden_bits) widen to float32 losslessly. An encoding missing here
# fails by name (UNIMPLEMENTED) instead of being read as another.
_TORCH_DTYPES = {"bf16": "bfloat16"}
_TO_FLOAT32 = {"bf16": lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)}
FP8 = "fp8_e4m3"
_READABLE = sorted([*_TORCH_DTYPES, FP8])


def _unsupported(encoding: str) -> "DraftfeedError":
    return DraftfeedError(12, f"this draftfeed client cannot read captures encoded as "
                              f"{encoding!r} (it reads {_READABLE})")


def _check(triple):
    code, message, value = triple
    if code != 0:
        raise DraftfeedError(code, message)
    return value


def describe_target(address: str, timeout_s: float = 10.0, tls=None, token=None,
                    transport: Optional[str] = None) -> dict:
    """Model id, fingerprint, layer count, hidden size, ... of one target.

    `tls`, `token` and `transport` (which client asks; "grpcio": the pure-Python one) as for
    `Feed`.
    """
    module = _client_for("grpc" if transport in ("nccl", "auto") else transport)[0]
    return _check(module.describe_target(address, timeout_s, _native_tls(tls),
                                         _native_token(token)))


class Result:
    """One batch's hidden states: `hidden` is [T, K, H] (K = layers in the order asked)."""

    __slots__ = ("_r", "_batch")

    def __init__(self, r, batch=None):
        self._r = r
        self._batch = batch

    batch = property(lambda self: self._batch,
                     doc="what Feed.map was given for this result (a PackedBatch, a pair, ...); "
                         "None for batches queued by submit()")
    indices = property(lambda self: getattr(self._batch, "indices", None),
                       doc="the dataset index of each sequence, where map was given a PackedBatch "
                           "that knows them (PackedBatch.indices), else None")

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
                           doc="[T, K, H] bit patterns, no copy (uint16 for bf16; the uint8 "
                               "e4m3 codes for fp8_e4m3, as `values`)")
    encoding = property(lambda self: self._r.encoding,
                        doc='how the result\'s bytes encode its values: "bf16", or "fp8_e4m3" '
                            'for fp8 results kept raw (fp8_raw=True) or received by NCCL')
    bytes_per_token = property(lambda self: self._r.bytes_per_token,
                               doc="result bytes per token (K*H*2 for bf16, K*H + 4K for fp8_e4m3)")

    device = property(lambda self: self._r.device,
                      doc="-1: host memory (gRPC); else the CUDA device holding it (NCCL)")

    # Target outputs (Feed(argmax=True, top_k=k, draft_vocab=ids)): numpy for host results,
    # torch tensors on the GPU for NCCL ones.
    argmax = property(lambda self: _outputs.argmax(self._r),
                      doc="int32 [T]: the target's full-vocabulary argmax (ties: lowest id)")
    top_k_ids = property(lambda self: _outputs.top_k(self._r)[0],
                         doc="int32 [T, k]: the target's top-k ids over its vocabulary, best "
                             "first")
    top_k_logprobs = property(lambda self: _outputs.top_k(self._r)[1],
                              doc="float32 [T, k]: their log-probabilities (log_softmax over "
                                  "the full vocabulary)")

    @property
    def draft_probs(self):
        """float32 [T, Vd]: the target's softmax over the draft vocabulary (columns in the
        order of Feed(draft_vocab=...)); numpy for host results, torch on the GPU for NCCL
        ones. For a torch tensor on a device, `draft_probs_torch(device)` moves the encoded
        bytes and widens them there."""
        if self._r.device >= 0:
            return self.draft_probs_torch()
        return _outputs.draft_probs_numpy(self._r, E4M3_VALUES)

    def draft_probs_torch(self, device=None, non_blocking: bool = True, dtype=None):
        """draft_probs as a torch tensor (float32 unless `dtype`) on `device` (default: where
        the result is)."""
        return _outputs.draft_probs_torch(self._r, E4M3_VALUES, device, non_blocking, dtype)

    def argmax_torch(self, device=None, non_blocking: bool = True):
        """argmax as a torch int32 tensor [T] on `device` (default: where the result is)."""
        import torch

        t = self.argmax
        t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
        return t if device is None else t.to(device, non_blocking=non_blocking)

    def top_k_torch(self, device=None, non_blocking: bool = True):
        """(ids int32 [T, k], logprobs float32 [T, k]) as torch tensors on `device`."""
        import torch

        out = []
        for t in _outputs.top_k(self._r):
            t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
            out.append(t if device is None else t.to(device, non_blocking=non_blocking))
        return tuple(out)

    @property
    def hidden(self):
        """float32 numpy [T, K, H] for host results; exact (bf16 widens losslessly; fp8_e4m3
        gives code * scale, one fp32 multiply).

        Results that came by NCCL are already on the GPU: `hidden` is then the
        torch tensor on that device (no copy), as `torch()` returns.
        """
        if self._r.device >= 0:
            return self.torch()
        if self._r.encoding == FP8:
            # float32(code) * scale: exact widening, one fp32 multiply.
            return E4M3_VALUES[self._r.hidden_bits] * self._r.fp8_scales[:, :, None]
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

    def _fp8_check(self, what: str) -> None:
        if self._r.encoding != FP8:
            raise DraftfeedError(9, f"Result.{what} reads fp8_e4m3 codes and scales; this result "
                                    f"is {self._r.encoding} (ask for them with "
                                    f"Feed(encoding='fp8_e4m3', fp8_raw=True))")

    @property
    def values(self):
        """fp8_e4m3 results: the e4m3 codes [T, K, H], no copy; numpy uint8 for host results,
        a torch tensor (torch.float8_e4m3fn where torch has it, else uint8) for NCCL ones.
        A value is E4M3_VALUES[code] * scales[t, k]."""
        self._fp8_check("values")
        if self._r.device >= 0:
            return self.fp8()[0]
        return self._r.hidden_bits

    @property
    def scales(self):
        """fp8_e4m3 results: the float32 scale of each token and layer [T, K], no copy
        (numpy for host results, torch for NCCL ones)."""
        self._fp8_check("scales")
        if self._r.device >= 0:
            return self.fp8()[1]
        return self._r.fp8_scales

    def fp8(self, device=None, non_blocking: bool = True):
        """fp8_e4m3 results: (codes [T, K, H], scales [T, K] float32) as torch tensors, views of
        the result's memory (codes torch.float8_e4m3fn where torch has it, else uint8); copied
        to `device` when given."""
        import torch

        self._fp8_check("fp8()")
        raw = torch.utils.dlpack.from_dlpack(self)
        codes, scales = _fp8_torch(raw, self._r.num_layers, self._r.hidden_size)
        if device is not None:
            codes = codes.to(device, non_blocking=non_blocking)
            scales = scales.to(device, non_blocking=non_blocking)
        return codes, scales

    def torch(self, device=None, non_blocking: bool = True):
        """Torch tensor [T, K, H] in the capture's dtype (bf16: torch.bfloat16)
        through DLPack (no copy on CPU).

        An fp8_e4m3 result is dequantized to bf16 (dequantize_fp8) where it is: on its GPU
        for NCCL results (then copied to `device`, if another), on `device` for host ones.
        With `device` (e.g. "cuda:0") it is copied there; from pinned memory the
        copy is asynchronous when `non_blocking`.
        """
        import torch

        if self._r.encoding == FP8:
            codes, scales = self.fp8(device if self._r.device < 0 else None, non_blocking)
            t = dequantize_fp8(codes, scales)
            return t if device is None else t.to(device, non_blocking=non_blocking)
        dtype_name = _TORCH_DTYPES.get(self._r.encoding)
        if dtype_name is None:
            raise _unsupported(self._r.encoding)
        dtype = getattr(torch, dtype_name)
        try:
            t = torch.utils.dlpack.from_dlpack(self)
            if t.dtype == torch.uint8:  # rows with target outputs: the hidden bytes, viewed
                k, h = self._r.num_layers, self._r.hidden_size
                hidden = t[:, :_outputs.hidden_bytes(self._r)]
                if t.shape[1] % 2:
                    hidden = hidden.contiguous()
                t = hidden.view(dtype).unflatten(1, (k, h))
        except (TypeError, RuntimeError, BufferError):
            if self._r.device >= 0:
                raise
            # Older torch without this dtype's DLPack import: the same bytes,
            # reinterpreted (signed integers of the same width, which torch has).
            bits = np.ascontiguousarray(self._r.hidden_bits)
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
      batch_timeout_s: a batch without progress, on a stream without any, this long marks its
        target hung;
        its batches go to other targets.
      unavailable_timeout_s: with no live target this long, calls raise
        UNAVAILABLE instead of waiting forever.
      progress_every_s: when > 0, `map` prints a progress line this often.
      progress: show a tqdm progress bar (batches, tokens/s over `stats_window_s`, queue)
        while results come back; without tqdm installed, `map` prints a progress line every
        10 s instead (unless progress_every_s says otherwise).
      stats_window_s: the recent window of `stats()`' window_* rates, seconds.
      transport: "grpc" (default, or the DRAFTFEED_TRANSPORT environment variable; results
        in host memory; the compiled client's gRPC where it is installed, else grpcio's),
        "grpcio" (gRPC through the pip grpcio and protobuf packages, pure Python, no compiled
        module needed; `Feed.client` says which client runs), "nccl" (results land
        GPU to GPU in `cuda_device`'s memory; each target on one GPU other than
        `cuda_device`, on this host or, by NCCL's network transport, another)
        or "auto" (NCCL with the targets where it works, gRPC with the others;
        `stats()` says which and why per target).
      cuda_device: the GPU index that receives, for "nccl" and "auto".
      nccl_across_hosts: with transport="auto", use NCCL with targets on other hosts
        too (InfiniBand/RoCE, else sockets); without it auto takes NCCL on this host
        only. Advanced keywords: nccl_socket_ifname (NCCL's interface, as
        NCCL_SOCKET_IFNAME), nccl_setup_timeout_s (set-up and handshake, default 60),
        nccl_timeout_s (each batch's receive, default 120).
      encoding: what the targets send: "bf16" (default, exact) or "fp8_e4m3" (K*H + 4K bytes a
        token instead of 2*K*H: e4m3 codes with one fp32 scale per token and layer,
        scale = max|x| / 448). fp8 results are bf16 to the trainer: dequantized on the way in
        for gRPC, on the receiving GPU by `torch()` for NCCL.
      tls: TLS to targets started with --tls_cert: True (the system's trust store) or
        draftfeed.Tls(ca=..., cert=..., key=...) (cert and key: mutual TLS). None: plaintext.
      token: bearer token for targets started with --auth_tokens_file, sent on every call.
      draft_vocab: target token ids (<= 65,536, distinct, any order; or a
        draftfeed.vocab.DraftVocab): the targets also send, per token, the softmax of their
        logits at these ids (EAGLE-3's target distribution), `Result.draft_probs` [T, Vd].
      top_k: the targets also send their top-k ids and log-probs over the full vocabulary
        (k <= 256): `Result.top_k_ids`, `Result.top_k_logprobs` [T, k].
      argmax: the targets also send their full-vocabulary argmax (`Result.argmax` [T]; with
        draft_vocab, EAGLE-3's position mask is vocab.position_mask(argmax, loss_mask)).
      probs_encoding: the draft probabilities on the wire: "bf16" (default) or "fp8_e4m3"
        (one float32 scale per token). With any of these, `layers` may be empty.
      fp8_raw: with encoding="fp8_e4m3", keep results as sent: `Result.encoding` is then
        "fp8_e4m3" and `Result.values` / `Result.scales` / `Result.fp8()` give the codes and
        scales (`torch()` still dequantizes on request).

    A batch whose target dies, hangs or shuts down is re-sent to another target;
    duplicates are dropped by batch id, so each batch comes back exactly once. Each such
    target failure is logged once (logger "draftfeed") and counted in `stats()`.
    """

    def __init__(self, targets: Sequence[str], layers: Sequence[int], prefetch: int = 8,
                 prefetch_bytes: int = 1 << 30, ordered: bool = True,
                 credits_per_target: int = 4, expected_fingerprint: str = "",
                 verify_checksum: bool = True, connect_timeout_s: float = 30.0,
                 batch_timeout_s: float = 120.0, unavailable_timeout_s: float = 60.0,
                 client_name: str = "", progress_every_s: float = 0.0,
                 transport: Optional[str] = None, cuda_device: int = -1,
                 encoding: str = "bf16",
                 fp8_raw: bool = False, tls=None, token: Optional[str] = None,
                 progress: bool = False, stats_window_s: float = 30.0,
                 nccl_across_hosts: bool = False, draft_vocab=None, top_k: int = 0,
                 argmax: bool = False, probs_encoding: str = "bf16", **advanced):
        if isinstance(targets, str):
            targets = [targets]
        module, transport, self.client = _client_for(transport)  # "native" or "grpcio"
        opts = dict(prefetch=int(prefetch), prefetch_bytes=int(prefetch_bytes),
                    ordered=bool(ordered), credits_per_target=int(credits_per_target),
                    expected_fingerprint=expected_fingerprint,
                    verify_checksum=bool(verify_checksum),
                    connect_timeout_s=float(connect_timeout_s),
                    batch_timeout_s=float(batch_timeout_s),
                    unavailable_timeout_s=float(unavailable_timeout_s), client_name=client_name,
                    transport=str(transport), cuda_device=int(cuda_device),
                    nccl_across_hosts=bool(nccl_across_hosts),
                    encoding=str(encoding), fp8_raw=bool(fp8_raw), tls=_native_tls(tls),
                    token=_native_token(token), stats_window_s=float(stats_window_s),
                    argmax=bool(argmax), top_k=int(top_k), probs_encoding=str(probs_encoding))
        if draft_vocab is not None:
            ids = np.asarray(getattr(draft_vocab, "ids", draft_vocab))  # a vocab.DraftVocab too
            if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
                raise ValueError(f"draft_vocab must be a 1-D sequence of token ids, got shape "
                                 f"{ids.shape} of {ids.dtype}")
            opts["draft_vocab"] = np.ascontiguousarray(ids, dtype=np.int32)
        # reconnect_backoff_min_s, reconnect_backoff_max_s, dns_refresh_s, nccl_socket_ifname,
        # nccl_setup_timeout_s, nccl_timeout_s
        opts.update(advanced)
        try:
            self._feed = _check(module.Feed.open(list(targets), [int(l) for l in layers], opts))
        except DraftfeedError as e:
            if self.client == "grpcio" and transport != "grpc" and native_import_error:
                raise DraftfeedError(e.code, f"{e.message} (the compiled module: "
                                             f"{native_import_error})") from None
            raise
        self.prefetch = int(prefetch)
        self.encoding = str(encoding)
        self.fp8_raw = bool(fp8_raw)
        self.layers = [int(l) for l in layers]
        self.progress_every_s = float(progress_every_s)
        self._outstanding = 0
        # Ids submitted and not yet returned or cancelled, in submission order: an ordered
        # feed's error is the first of them. Values: what map() was given for the batch.
        self._ids: "OrderedDict[int, object]" = OrderedDict()
        self._ordered = bool(ordered)
        self._counters = _acct.new_counters()
        self._watch = _acct.TargetWatch()
        self._last_progress = 0.0
        self._final = None  # the native stats close() left
        self._bar = ProgressBar.make() if progress else None
        if progress and self._bar is None and self.progress_every_s <= 0:
            self.progress_every_s = 10.0

    def _live(self, what: str):
        """The native feed, or FAILED_PRECONDITION naming the call once close() has run."""
        if self._feed is None:
            raise DraftfeedError(9, f"Feed.{what}: this feed is closed")
        return self._feed

    @property
    def target(self) -> dict:
        """Description of the first target (model id, fingerprint, sizes)."""
        return self._live("target").target()

    def target_info(self) -> dict:
        """The first target's description, as `target` (max_batch_tokens, max_sequence_tokens:
        the longest batch it takes, running one over max_batch_tokens in chunks)."""
        return self.target

    def pack_sequences(self, sequences, token_budget: Optional[int] = None, **kw):
        """draftfeed.packing.pack_sequences with the target's limits: `token_budget` defaults to
        its max_batch_tokens and `max_sequence_tokens` to its own, so a sequence up to that is
        sent whole (not truncated) and a longer one is an error naming both numbers (or as
        `truncate=True` / `drop_longer=True` say)."""
        from .packing import pack_sequences

        info = self.target
        kw.setdefault("max_sequence_tokens", int(info["max_sequence_tokens"]))
        budget = int(info["max_batch_tokens"]) if token_budget is None else token_budget
        return pack_sequences(sequences, budget, **kw)

    def add_target(self, address: str) -> None:
        """Adds a target to the running feed; it receives work once connected."""
        _check(self._live("add_target").add_target(address))

    def submit(self, token_ids, seq_lens) -> int:
        """Queues one packed batch; returns its batch id. Blocks beyond `prefetch`."""
        feed = self._live("submit")
        token_ids = np.ascontiguousarray(token_ids, dtype=np.int32)
        seq_lens = np.ascontiguousarray(seq_lens, dtype=np.int32)
        batch_id = _check(feed.submit(token_ids, seq_lens))
        self._outstanding += 1
        self._ids[batch_id] = None
        return batch_id

    def next(self) -> Result:
        """The next result (submission order unless ordered=False).

        Raises DraftfeedError for a batch the target refused (the feed stays
        usable) or when no target has been reachable for unavailable_timeout_s.
        """
        feed = self._live("next")
        before = self._outstanding
        try:
            r = _check(feed.next())
        except DraftfeedError as e:
            self._took_error(e, before)
            raise
        else:
            r = Result(r, self._ids.pop(r.batch_id, None))
        finally:
            # The native feed's count, not a guess: a next() refused for want of a
            # submission (or a feed closing) took no batch, a refused batch did.
            stats = feed.stats()
            self._outstanding = int(stats["outstanding"])
            self._watch.observe(stats)
        if self._bar is not None:
            feed = self._feed
            self._bar.update(self._outstanding, lambda: feed.stats()["window_tokens_per_s"])
        return r

    def _took_error(self, e: DraftfeedError, before: int) -> None:
        """Marks the batch an error from next() took: which one (ordered feeds: the oldest
        outstanding, as the native feed returns them) and that it is gone."""
        feed = self._feed
        after = int(feed.stats()["outstanding"]) if feed is not None else before
        e.consumed_batch = after < before
        if e.consumed_batch and self._ordered and self._ids:
            e.batch_id, e.batch = self._ids.popitem(last=False)

    def map(self, batches: Iterable[Batch], on_error: str = "raise", max_skipped: int = 100,
            on_skip=None) -> Iterator[Result]:
        """Keeps `prefetch` batches in flight; yields their results (`Result.batch` is the item
        of `batches` it was computed from, `Result.indices` its dataset indices).

        A batch that fails (the target refused it, DATA_LOSS, ...): with on_error="raise"
        (default) its DraftfeedError ends the loop, and the batches still in flight stay
        outstanding, not cancelled: `next()` or the next `map` returns them. With
        on_error="skip" it is counted (`stats()["skipped_batches"]`), logged as a warning
        (logger "draftfeed") with its reason, passed to `on_skip(error, item)` when given, and
        the loop goes on; more than `max_skipped` skips in one pass raise. Errors that are not
        one batch's (UNAVAILABLE: no target reachable) always raise.

        Leaving the loop early (break, an exception, the generator closed or
        collected) cancels the batches it still has in flight: the targets
        skip those they have not started, and none is returned later.

        `PackedBatch`es' packing counts (truncated, left out) go to `stats()`, and a pass whose
        batches were truncated by a packer that does not warn itself (the collator) warns once
        at its end.
        """
        _acct.check_on_error(on_error, max_skipped)  # now, not at the first result
        return _feed_map.run(self, batches, _acct.Pass(self._counters, on_error, max_skipped,
                                                       on_skip))

    def cancel(self, batch_ids: Optional[Sequence[int]] = None) -> int:
        """Drops outstanding batches (all of them by default) so `next()` never returns
        them; returns how many. Targets skip those they have not started (each stream
        holding one is cancelled and reconnects; its other batches are sent again)."""
        ids = [] if batch_ids is None else [int(b) for b in batch_ids]
        if batch_ids is not None and not ids:
            return 0
        feed = self._live("cancel")
        n = int(feed.cancel(ids))
        self._outstanding = int(feed.stats()["outstanding"])
        if batch_ids is None:
            self._ids.clear()
        for b in ids:
            self._ids.pop(b, None)
        return n

    def stats(self, flat: bool = False) -> dict:
        """Counters for dashboards (wandb, tensorboard): see README "Feed statistics".

        Since start: tokens_per_s, batches_per_s (of results returned by next()/map()),
        bytes_per_s (received). Over the last stats_window_s seconds: window_tokens_per_s,
        window_batches_per_s, window_bytes_per_s, and window_s (the seconds they span); per
        target the same of its delivered batches and tokens, since it joined. After
        close(), the numbers close() left (closed: True). flat=True: one level of numeric
        keys ("tokens_per_s", "target.<address>.delivered_batches", ...).
        """
        s = self._feed.stats() if self._feed is not None else copy.deepcopy(self._final)
        s["queue_depth"] = s["outstanding"]
        self._watch.observe(s)
        self._watch.add_to(s)
        s.update(self._counters)
        return _flatten_stats(s) if flat else s

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
            feed = self._feed
            try:
                _check(feed.close())
            finally:
                # stats() after close() returns these final numbers.
                self._final = feed.stats()
                self._feed = None
                if self._bar is not None:
                    self._bar.close()
                    self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
