#!/usr/bin/env python3
"""One trainer process of the split benchmark (bench/splits.py starts these).

Opens its own draftfeed.Feed over every target of the split (the feed balances), sends packed
batches of synthetic tokens (draftfeed.packing.pack_sequences) and runs one drafter step per
batch:

- `none`: no drafter work (used to measure a target's rate alone, and the link's: --stream says
  what it receives),
- `synthetic`: a matmul chain costing about --flops-per-token FLOPs per token (forward only),
- `dflash`: the small DFlash-style drafter of client/python/examples/train_drafter.py
  (fc over the K concatenated layers, one transformer block, loss, backward, AdamW step),
- `dflash-full`: a DFlash-style drafter at the target's width, the GPU modes' realistic load:
  fc [K*H -> H], --drafter-layers Qwen-style decoder layers (GQA attention inside 16-token
  draft blocks, SwiGLU MLP of ~3.4 H), a norm and an lm head over --draft-vocab ids, bf16
  autocast over fp32 weights, cross-entropy, backward, AdamW step.
- `eagle3`: an EAGLE-3-style drafter at the target's width trained on the target's own
  distribution, which the target computes and streams: the Feed asks for 3 EAGLE-3 layers
  (draftfeed.layers.eagle3(L)[:3]; 3 evenly spaced ones on targets under its 7 layers, such
  as the 4-layer tiny-random) with `draft_vocab=ids, argmax=True`, so each batch brings
  hidden [T, 3, H], `Result.draft_probs` [T, Vd] and `Result.argmax` [T]. The model: fc
  [3H -> H], the target's token embedding (frozen, bf16, [V, H]), one decoder block whose
  attention reads [embed(next token); hidden] (2H wide; causal inside 256-token blocks, the
  cost shape, not EAGLE-3's exact masking) and a SwiGLU MLP, a norm and a head Linear(H -> Vd);
  --ttt-steps feeds the block its own output again (EAGLE-3's training-time test, one token
  further each step). Loss = -sum(position_mask * target_p * log_softmax(draft_logits)) over
  the positions in the draft sequence, position_mask = t2d[argmax] (draftfeed.vocab), bf16
  autocast over fp32 weights, backward, AdamW step. No lm_head in the trainer.
- `eagle3-lmhead`: the same drafter the old way: the Feed asks for the 3 layers and -1 (the
  final-norm state) and no target outputs; the trainer holds a random lm_head [V, H] (bf16,
  the drafter's compute dtype) and each step computes logits = h_final @ lm_head.T [T, V],
  argmax over them and target_p = softmax(logits[:, draft_ids]) itself, then the same step.

Draft vocabulary of both eagle3 kinds: --draft-vocab-size ids (default min(32000, V)), the
first N of a permutation of the target's V ids seeded with 0, ascending (draftfeed.vocab
.DraftVocab), the same in every trainer.

Transport (--transport, GPU modes): with `nccl` the feed hands each batch over as a CUDA tensor
on --cuda-device (used as is, no host copy); with `grpc` the host buffer goes to the drafter's
device with a non-blocking copy, timed as part of the step (the trainer waits for it before the
step can run); `auto` takes whatever each result holds. Without --transport the Feed is opened
as before (gRPC into host memory), so older client builds still run the CPU mode.

`--drafter-rate R` (optional) pads every step to at least tokens/R seconds, as the targets'
--throttle_tokens_per_s does, to emulate a drafter device of a given speed on a small CPU box.

Protocol with the orchestrator: warm-up (--warmup-tokens), then create --ready-file, wait for
--go-file, run --tokens measured tokens, print ONE JSON line on stdout (the report).

`--calibrate` instead times drafter steps on random inputs of the target's shape (no feed; only
--hidden-size/--num-layers, and for the eagle3 kinds --target-vocab-size, needed: eagle3 gets
random hidden [T, 3, H], probabilities [T, Vd] and argmax; eagle3-lmhead random hidden
[T, 4, H] and runs its lm_head GEMM) and prints {"drafter_tokens_per_s": ...}, with the
host-to-device copy of one batch of what the stream carries timed separately (`h2d_ms`; 0 on
the CPU) and the drafter's memory: `trainer_bytes` is torch.cuda.max_memory_allocated on a GPU
and, on the CPU (no allocator peak), the bytes of the tensors the path holds (`held_bytes`:
weights, grads, AdamW state, inputs, lm_head, the target-distribution stage, autograd-saved
activations), `trainer_bytes_kind` says which.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import resource
import sys
import threading
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def load_example_drafter():
    path = REPO / "client" / "python" / "examples" / "train_drafter.py"
    spec = importlib.util.spec_from_file_location("draftfeed_example_train_drafter", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def attention_heads(hidden_size):
    """(head_dim, heads, kv_heads) of the `dflash-full` drafter at width H: 128-wide heads and
    about one KV head per 5 query heads (Qwen3.6-27B's 40 / 8), rounded down to a divisor of
    the head count so that K and V repeat evenly: 16 heads at the 35B-A3B's 2,048 get 2."""
    head_dim = min(128, hidden_size)
    heads = max(1, hidden_size // head_dim)
    kv_heads = max(1, heads // 5)
    while heads % kv_heads:
        kv_heads -= 1
    return head_dim, heads, kv_heads


def full_drafter(num_layers, hidden_size, draft_vocab, n_layers, block=16):
    """The `dflash-full` model: a DFlash-style drafter as wide as the target (see the module
    docstring). Attention runs inside fixed 16-token blocks, the cost shape of DFlash's draft
    blocks; sequence boundaries are not masked (the bench trains on random tokens, so only the
    cost has to be right, not what is learnt)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    RMSNorm = load_example_drafter().RMSNorm  # torch.nn.RMSNorm is newer than CI's torch

    def attention(q, k, v):
        if hasattr(F, "scaled_dot_product_attention"):
            return F.scaled_dot_product_attention(q, k, v)
        return (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1) @ v

    H = hidden_size
    head_dim, heads, kv_heads = attention_heads(H)
    inter = 256 * max(1, round(3.4 * H / 256))

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = RMSNorm(H), RMSNorm(H)
            self.q = nn.Linear(H, heads * head_dim, bias=False)
            self.kv = nn.Linear(H, 2 * kv_heads * head_dim, bias=False)
            self.o = nn.Linear(heads * head_dim, H, bias=False)
            self.gate_up = nn.Linear(H, 2 * inter, bias=False)
            self.down = nn.Linear(inter, H, bias=False)

        def forward(self, x):  # x: [blocks, block, H]
            B, S, _ = x.shape
            h = self.norm1(x)
            q = self.q(h).view(B, S, heads, head_dim).transpose(1, 2)
            k, v = self.kv(h).view(B, S, 2, kv_heads, head_dim).unbind(2)
            k = k.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
            v = v.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
            a = attention(q, k, v)  # bidirectional inside a draft block
            x = x + self.o(a.transpose(1, 2).reshape(B, S, heads * head_dim))
            g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(g) * u)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(num_layers * H, H, bias=False)
            self.layers = nn.ModuleList(Layer() for _ in range(n_layers))
            self.norm = RMSNorm(H)
            self.lm_head = nn.Linear(H, draft_vocab, bias=False)

        def forward(self, hidden):  # [T, K, H] -> logits [T, draft_vocab]
            T = hidden.shape[0]
            x = self.fc(hidden.reshape(T, -1))
            pad = -T % block
            x = F.pad(x, (0, 0, 0, pad)).view(-1, block, H)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x.reshape(-1, H)[:T]))

    return Model()


# ---------------------------------------------------------------------------- EAGLE-3

EAGLE3_KINDS = ("eagle3", "eagle3-lmhead")
STREAMS = ("hidden",) + EAGLE3_KINDS


def draftfeed_module(name):
    """draftfeed.<name> (pure-Python `layers`, `vocab`): the installed package's, else the
    source tree's file on its own, so --calibrate needs no compiled client."""
    try:
        return importlib.import_module(f"draftfeed.{name}")
    except ImportError:
        path = REPO / "client" / "python" / "draftfeed" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"draftfeed_{name}_for_splits", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
        return mod


def eagle3_layers(num_layers):
    """EAGLE-3's three feature layers, draftfeed.layers.eagle3(L)[:3] (its -1 is the final
    state, which only eagle3-lmhead asks for). The recipe needs 7 layers; a shallower target
    (the CI's 4-layer tiny-random) gets 3 evenly spaced distinct ones, 0, L/2 and L-1."""
    try:
        return draftfeed_module("layers").eagle3(int(num_layers))[:3]
    except ValueError:
        if num_layers < 3:
            raise ValueError(f"eagle3: a target of {num_layers} layers has no 3 distinct "
                             f"feature layers") from None
        return sorted({int(round(i * (num_layers - 1) / 2)) for i in range(3)})


def default_draft_vocab_size(target_vocab, size=0):
    """--draft-vocab-size: `size`, or min(32000, V); at most the 65,536 a target serves."""
    size = int(size) or min(32000, int(target_vocab))
    if not 0 < size <= min(65536, int(target_vocab)):
        raise SystemExit(f"--draft-vocab-size {size}: needs 1..min(65536, target vocab "
                         f"{target_vocab})")
    return size


def draft_vocabulary(target_vocab, size=0):
    """The eagle3 kinds' DraftVocab: the first N ids of a permutation of the V target ids
    seeded with 0, ascending; the same in every trainer of a split (not the trainer's seed)."""
    size = default_draft_vocab_size(target_vocab, size)
    perm = np.random.default_rng(0).permutation(int(target_vocab))
    return draftfeed_module("vocab").DraftVocab(np.sort(perm[:size]), int(target_vocab))


def probs_bytes_per_token(draft_vocab_size, probs_encoding="bf16"):
    """Target-output bytes per token of a draft_vocab + argmax stream: bf16 probs Vd*2 (fp8_e4m3:
    Vd codes + a float32 scale), then the int32 argmax."""
    vd = int(draft_vocab_size)
    return (vd + 4 if probs_encoding == "fp8_e4m3" else 2 * vd) + 4


def stream_spec(stream, layers, num_layers, hidden_size, target_vocab, draft_vocab_size=0,
                probs_encoding="bf16"):
    """What the Feed asks for: {"layers", "outputs" (Feed keywords), "vocab" (DraftVocab or
    None), "bytes_per_token"}. `layers`: ids, or "eagle3" (the eagle3 kinds' 3 feature
    layers of this target); stream "hidden": the layers as given, bf16; "eagle3": the 3
    feature layers + draft probs and argmax; "eagle3-lmhead": the 3 feature layers and -1."""
    if stream not in STREAMS:
        raise ValueError(f"stream {stream!r} is not one of {', '.join(STREAMS)}")
    if isinstance(layers, str):
        layers = (eagle3_layers(num_layers) if layers == "eagle3"
                  else [int(x) for x in layers.split(",") if x.strip()])
    layers = [int(x) for x in layers]
    H = int(hidden_size)
    if stream == "hidden":
        return {"layers": layers, "outputs": {}, "vocab": None,
                "bytes_per_token": 2 * len(layers) * H}
    if len(layers) != 3 or -1 in layers:
        raise SystemExit(f"--layers {','.join(map(str, layers))}: the {stream} drafter takes 3 "
                         f"feature layers (not -1; 'eagle3' picks EAGLE-3's)")
    vocab = draft_vocabulary(target_vocab, draft_vocab_size)
    if stream == "eagle3":
        return {"layers": layers, "vocab": vocab,
                "outputs": {"draft_vocab": vocab.ids, "argmax": True,
                            "probs_encoding": probs_encoding},
                "bytes_per_token": 2 * 3 * H + probs_bytes_per_token(vocab.size, probs_encoding)}
    return {"layers": layers + [-1], "outputs": {}, "vocab": vocab,
            "bytes_per_token": 2 * 4 * H}


def tensor_bytes(tensors):
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))


def eagle3_drafter(hidden_size, target_vocab, draft_vocab, block=256):
    """The eagle3 kinds' model at the target's width (see the module docstring):
    `forward(features [T, 3, H], next_tokens [T], hidden=None) -> (hidden [T, H], logits
    [T, Vd])`; `hidden` given (a TTT step after the first) replaces the fused features."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class RMSNorm(nn.Module):  # the examples' (torch.nn.RMSNorm is newer than CI's torch),
        def __init__(self, dim, eps=1e-6):  # here so that --calibrate needs no draftfeed
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    H = hidden_size
    head_dim, heads, kv_heads = attention_heads(H)
    inter = 256 * max(1, round(3.4 * H / 256))

    def attention(q, k, v):  # causal inside each block
        if hasattr(F, "scaled_dot_product_attention"):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        S = q.shape[-2]
        causal = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        s = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(causal, float("-inf"))
        return s.softmax(-1) @ v

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3 * H, H, bias=False)
            # EAGLE-3 embeds the next token with the target's embedding, frozen: a bf16
            # buffer (random here), not a parameter.
            self.register_buffer("embed", (torch.randn(target_vocab, H) * 0.02).to(
                torch.bfloat16))
            self.input_norm, self.hidden_norm = RMSNorm(H), RMSNorm(H)
            self.q = nn.Linear(2 * H, heads * head_dim, bias=False)
            self.kv = nn.Linear(2 * H, 2 * kv_heads * head_dim, bias=False)
            self.o = nn.Linear(heads * head_dim, H, bias=False)
            self.post_norm, self.norm = RMSNorm(H), RMSNorm(H)
            self.gate_up = nn.Linear(H, 2 * inter, bias=False)
            self.down = nn.Linear(inter, H, bias=False)
            self.head = nn.Linear(H, draft_vocab, bias=False)

        def forward(self, features, next_tokens, hidden=None):
            T = next_tokens.shape[0]
            x = self.fc(features.reshape(T, -1)) if hidden is None else hidden
            e = self.embed[next_tokens]
            z = torch.cat([self.input_norm(e), self.hidden_norm(x)], -1)  # [T, 2H]
            pad = -T % block
            z = F.pad(z, (0, 0, 0, pad))
            B, S = z.shape[0] // block, block
            q = self.q(z).view(B, S, heads, head_dim).transpose(1, 2)
            k, v = self.kv(z).view(B, S, 2, kv_heads, head_dim).unbind(2)
            k = k.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
            v = v.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
            a = attention(q, k, v).transpose(1, 2).reshape(B * S, heads * head_dim)[:T]
            x = x + self.o(a)  # EAGLE-3's residual is the hidden input
            g, u = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
            x = x + self.down(F.silu(g) * u)
            return x, self.head(self.norm(x))

    return Model()


class SavedBytes:
    """Bytes autograd saves for backward inside the `with` (the activations a step holds),
    each tensor once, the ones in `exclude` (weights, inputs: counted elsewhere) left out."""

    def __init__(self, torch_mod, exclude=()):
        self.torch, self.exclude, self.seen, self.bytes = torch_mod, set(exclude), set(), 0

    def pack(self, t):
        key = (t.data_ptr(), t.numel(), t.dtype)
        if t.data_ptr() not in self.exclude and key not in self.seen:
            self.seen.add(key)
            self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self):
        self.ctx = self.torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


class Drafter:
    """A drafter step: `step(hidden [T,K,H] bf16 torch, token_ids int32 np, seq_lens int32 np,
    outputs=None)`; the eagle3 kind takes `outputs` = (draft probs float32 [T, Vd], argmax [T])
    on its device. The eagle3 kinds need `spec` (stream_spec's: the draft vocabulary)."""

    def __init__(self, kind, num_layers, hidden_size, flops_per_token, device, vocab, seed,
                 drafter_layers=1, draft_vocab=32768, spec=None, ttt_steps=1):
        self.kind = kind
        self.flops_per_token = 0.0
        self.held = {}
        self.lm_head = None
        if kind == "none":
            return
        import torch
        torch.manual_seed(seed)
        self.torch = torch
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        kh = num_layers * hidden_size
        if kind == "synthetic":
            # fc [K*H, d] then n square [d, d] matmuls: 2*(K*H*d + n*d*d) FLOPs per token.
            f = float(flops_per_token)
            d = 256
            while d > 8 and 2.0 * kh * d > f:
                d //= 2
            n = max(0, int(round((f - 2.0 * kh * d) / (2.0 * d * d))))
            self.fc = torch.randn(kh, d, device=self.device) / kh ** 0.5
            self.ws = [torch.randn(d, d, device=self.device) / d ** 0.5 for _ in range(n)]
            self.flops_per_token = 2.0 * (kh * d + n * d * d)
        elif kind == "dflash":
            ex = load_example_drafter()
            self.ex = ex
            self.vocab = vocab
            dim = 128
            self.model = ex.Drafter(num_layers, hidden_size, dim, vocab).to(self.device)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-3, weight_decay=0.0)
            # Forward + backward ~ 6 FLOPs per parameter per token (attention left out).
            self.flops_per_token = 6.0 * sum(p.numel() for p in self.model.parameters())
        elif kind == "dflash-full":
            self.vocab = min(vocab, draft_vocab)
            # Made on the device where torch can (2.x): 2B fp32 weights initialised on the
            # host would take tens of seconds per trainer.
            where = self.device if hasattr(self.device, "__enter__") else contextlib.nullcontext()
            with where:
                self.model = full_drafter(num_layers, hidden_size, self.vocab, drafter_layers)
            self.model.to(self.device)
            extra = {"fused": True} if self.device.type == "cuda" else {}
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.0,
                                         **extra)
            self.flops_per_token = 6.0 * sum(p.numel() for p in self.model.parameters())
        elif kind in EAGLE3_KINDS:
            dv = spec["vocab"]
            self.dvocab, self.ttt_steps = dv, max(1, int(ttt_steps))
            V, H = dv.target_vocab_size, hidden_size
            where = self.device if hasattr(self.device, "__enter__") else contextlib.nullcontext()
            with where:
                self.model = eagle3_drafter(H, V, dv.size)
                if kind == "eagle3-lmhead":
                    # The target's lm_head, in the drafter's compute dtype (bf16), frozen.
                    self.lm_head = torch.randn(V, H, device=self.device,
                                               dtype=torch.bfloat16).mul_(H ** -0.5)
            self.model.to(self.device)
            self.draft_ids = torch.from_numpy(dv.ids.astype(np.int64)).to(self.device)
            extra = {"fused": True} if self.device.type == "cuda" else {}
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.0,
                                         **extra)
            # 6 FLOPs per trained parameter per token and TTT step (fc once), plus the lm_head
            # GEMM's 2*V*H (forward only) for eagle3-lmhead.
            n = sum(p.numel() for p in self.model.parameters())
            fc = self.model.fc.weight.numel()
            self.flops_per_token = 6.0 * (fc + self.ttt_steps * (n - fc)) + (
                2.0 * V * H if self.lm_head is not None else 0.0)
        else:
            raise ValueError(f"unknown drafter {kind!r}")

    def held_total(self):
        """Bytes the path holds at its peak, from the `held` tally (CPU: what is reported as
        the trainer's memory): the persistent tensors (weights and frozen buffers, lm_head,
        grads, AdamW state), the batch's inputs, and the larger of its two stages: the target
        distribution made from the lm_head (logits [T, V] + probs + argmax; 0 for eagle3, whose
        probs are inputs) and the training step (autograd-saved activations + probs/mask)."""
        h = self.held
        if not h:
            return None
        return (h["weights"] + h["lm_head"] + h["grads"] + h["optimizer"] + h["inputs"]
                + max(h["target_stage"], h["train_stage"]))

    def eagle3_step(self, hidden, token_ids, seq_lens, outputs):
        torch = self.torch
        F = torch.nn.functional
        dev = self.device
        T = hidden.shape[0]
        held = {}
        if self.kind == "eagle3":
            probs, argmax = outputs  # the target's: [T, Vd] float32, [T] int32
            features = hidden
            held["inputs"] = tensor_bytes([hidden, probs, argmax])
            target_stage = 0
        else:
            features = hidden[:, :3]
            with torch.no_grad():  # what the target would have sent, made here
                logits = hidden[:, 3].to(self.lm_head.dtype) @ self.lm_head.t()  # [T, V]
                argmax = logits.argmax(-1)
                probs = logits.index_select(1, self.draft_ids).float().softmax(-1)
            held["inputs"] = tensor_bytes([hidden])
            target_stage = tensor_bytes([logits, probs, argmax])
            del logits
        pmask = self.dvocab.position_mask(argmax).float()  # t2d[argmax]
        tok = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(dev)
        sl = torch.from_numpy(np.asarray(seq_lens, dtype=np.int64)).to(dev)
        seq = torch.repeat_interleave(torch.arange(len(sl), device=dev), sl)
        ends = torch.cumsum(sl, 0)[seq]  # exclusive end of each token's sequence
        t = torch.arange(T, device=dev)
        exclude = {x.data_ptr() for x in list(self.model.parameters())
                   + list(self.model.buffers()) + [hidden, probs]}
        loss, x = 0.0, None
        with SavedBytes(torch, exclude) as saved, torch.autocast(dev.type, dtype=torch.bfloat16):
            for j in range(self.ttt_steps):
                # Position t embeds token t+1+j and learns the target's distribution there,
                # inside t's own sequence only.
                src = t + 1 + j
                valid = src < ends
                src = src.clamp(max=T - 1)
                nxt = torch.where(valid, tok[src], torch.zeros_like(tok))
                x, draft_logits = self.model(features, nxt, x)
                logp = F.log_softmax(draft_logits.float(), -1)
                m = pmask[src] * valid
                loss = loss - (m[:, None] * probs[src] * logp).sum() / valid.sum().clamp(min=1)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        loss.item()  # synchronise: the step's time is its GPU time
        held["weights"] = tensor_bytes(list(self.model.parameters()) + list(self.model.buffers()))
        held["lm_head"] = tensor_bytes([self.lm_head])
        held["grads"] = tensor_bytes([p.grad for p in self.model.parameters()])
        held["optimizer"] = tensor_bytes([v for st in self.opt.state.values()
                                          for v in st.values() if torch.is_tensor(v)])
        held["target_stage"] = target_stage
        held["activations"] = saved.bytes
        held["train_stage"] = saved.bytes + tensor_bytes(
            [pmask] + ([probs, argmax] if self.kind == "eagle3-lmhead" else []))
        for k, v in held.items():
            self.held[k] = max(v, self.held.get(k, 0))

    def step(self, hidden, token_ids, seq_lens, outputs=None):
        if self.kind == "none":
            return
        if self.kind in EAGLE3_KINDS:
            return self.eagle3_step(hidden, token_ids, seq_lens, outputs)
        torch = self.torch
        T = hidden.shape[0]
        if self.kind == "synthetic":
            with torch.no_grad():
                x = hidden.reshape(T, -1).to(self.device).float() @ self.fc
                for w in self.ws:
                    x = torch.tanh(x @ w)
                x.sum().item()  # synchronise (matters on GPU)
            return
        if self.kind == "dflash-full":
            tok = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(self.device)
            sl = torch.from_numpy(np.asarray(seq_lens, dtype=np.int64)).to(self.device)
            labels = next_token_labels(torch, tok, sl, self.vocab)
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                logits = self.model(hidden)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            loss.item()  # synchronise: the step's time is its GPU time
            return
        ex = self.ex
        tok = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(self.device)
        sl = torch.from_numpy(np.asarray(seq_lens, dtype=np.int64)).to(self.device)
        seq_ids = torch.repeat_interleave(torch.arange(len(sl), device=self.device), sl)
        logits = self.model(hidden.to(self.device), seq_ids)
        loss = torch.nn.functional.cross_entropy(
            logits.float(), ex.next_token_targets(tok, sl, self.vocab), ignore_index=-100)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        loss.item()


def next_token_labels(torch, token_ids, seq_lens, vocab):
    """labels[t] = token_ids[t + 1] inside a sequence; -100 at sequence ends and outside the
    draft vocabulary (as the example drafter's next_token_targets)."""
    labels = torch.full_like(token_ids, -100)
    labels[:-1] = token_ids[1:]
    labels[torch.cumsum(seq_lens, 0) - 1] = -100
    labels[labels >= vocab] = -100
    return labels


def to_drafter(result, transport, device, device_side):
    """The batch's hidden states as a bf16 [T, K, H] tensor on the drafter's device.

    nccl: the feed already put them there (`result.hidden` is a CUDA tensor): used as is.
    grpc: the host buffer (DLPack, no copy) goes over with a non-blocking copy.
    auto: whichever each result holds: `result.device` (-1: host memory) says so; a client
    without it is probed once per target (cached in `device_side`), since `.hidden` of a host
    result is a float32 copy.
    """
    import torch
    on_device = transport == "nccl"
    if transport == "auto":
        held = getattr(result, "device", None)
        if held is not None:
            on_device = held >= 0
        else:
            on_device = device_side.get(result.target)
            if on_device is None:
                on_device = device_side[result.target] = isinstance(result.hidden, torch.Tensor)
    if on_device:
        h = result.hidden
        if not isinstance(h, torch.Tensor) or h.device != device:
            raise RuntimeError(f"transport {transport}: expected the hidden states as a tensor "
                               f"on {device}, got {type(h).__name__} on "
                               f"{getattr(h, 'device', 'host')}")
        return h
    h = result.torch()
    return h if device.type == "cpu" else h.to(device, non_blocking=True)


def open_feed(draftfeed, targets, layers, prefetch, prefetch_bytes, credits, transport,
              cuda_device, outputs=None):
    """`outputs`: the target-output keywords (draft_vocab=, argmax=, probs_encoding=)."""
    kwargs = dict(targets=targets, layers=layers, prefetch=prefetch,
                  prefetch_bytes=prefetch_bytes, ordered=False, credits_per_target=credits,
                  **(outputs or {}))
    if transport:
        import inspect
        if "transport" not in inspect.signature(draftfeed.Feed.__init__).parameters:
            if transport == "grpc":  # what a Feed without the keyword does anyway
                return draftfeed.Feed(**kwargs)
            raise SystemExit(f"split_trainer: --transport {transport} needs a draftfeed client "
                             f"whose Feed takes transport=/cuda_device= (this one, "
                             f"{draftfeed.__file__}, does not); rebuild the Python package")
        kwargs.update(transport=transport, cuda_device=cuda_device)
    return draftfeed.Feed(**kwargs)


def synthetic_batches(rng, total_tokens, budget, vocab, max_len=256):
    """Packed batches of random sequences (16..max_len tokens) adding up to >= total_tokens."""
    from draftfeed.packing import pack_sequences

    def seqs():
        made = 0
        while made < total_tokens:
            n = int(min(rng.integers(16, max(16, max_len) + 1), budget))
            made += n
            yield rng.integers(0, vocab, size=n, dtype=np.int32)

    return pack_sequences(seqs(), token_budget=budget)


def cuda_peak_bytes(torch_mod, device):
    if torch_mod is not None and device.type == "cuda":
        return int(torch_mod.cuda.max_memory_allocated(device))
    return None


def calibrate(args):
    import torch
    torch.set_num_threads(args.torch_threads)
    dev = torch.device(args.device)
    T, H = args.batch_tokens, args.hidden_size
    spec = None
    if args.drafter in EAGLE3_KINDS:
        V = args.target_vocab_size or args.vocab
        # The layer ids do not matter here, only how many the stream carries (3, or 4 with -1).
        spec = stream_spec(args.drafter, [0, 1, 2], 3, H, V, args.draft_vocab_size,
                           args.probs_encoding)
        k = len(spec["layers"])
    else:
        k = args.num_layers
        spec = stream_spec("hidden", list(range(k)), k, H, args.vocab)
    d = Drafter(args.drafter, k, H, args.flops_per_token, args.device, args.vocab, args.seed,
                args.drafter_layers, args.draft_vocab, spec=spec, ttt_steps=args.ttt_steps)
    rng = np.random.default_rng(args.seed)
    # Made where the drafter runs: a [49152, 5, 5120] batch is 2.5 GB, too slow to randn on
    # the host.
    hidden = torch.randn(T, k, H, device=dev).to(torch.bfloat16)
    outputs = None
    if args.drafter == "eagle3":
        # What the target streams: its softmax over the draft ids (bf16 on the wire, float32
        # once received) and its argmax, drawn from the draft vocabulary (as a frequency-chosen
        # one mostly holds it).
        vd = spec["vocab"].size
        probs = torch.randn(T, vd, device=dev).softmax(-1).to(torch.bfloat16).float()
        ids = torch.from_numpy(spec["vocab"].ids.astype(np.int64)).to(dev)
        argmax = ids[torch.randint(0, vd, (T,), device=dev)]
        outputs = (probs, argmax)
    tokens = rng.integers(0, args.vocab, size=T, dtype=np.int32)
    seq_lens = np.array([T // 2, T - T // 2], dtype=np.int32)
    if dev.type == "cuda":  # the peak from here on: the drafter and its inputs, no randn temps
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    for _ in range(3):
        d.step(hidden, tokens, seq_lens, outputs)
    steps, compute_s, t0 = 0, 0.0, time.perf_counter()
    while steps < 3 or time.perf_counter() - t0 < args.calibrate_s:
        s0 = time.perf_counter()
        d.step(hidden, tokens, seq_lens, outputs)
        compute_s += time.perf_counter() - s0
        pad(s0, T, args.drafter_rate)
        steps += 1
    dt = time.perf_counter() - t0
    cuda_peak = cuda_peak_bytes(torch, dev)
    # What gRPC adds to every step on a GPU: the batch's copy from (pageable) host memory,
    # done in the trainer's thread before the step can start: every byte the stream carries
    # per token (hidden states, and the eagle3 kind's probabilities and argmax).
    h2d_ms = 0.0
    if dev.type == "cuda":
        host = torch.zeros(T, spec["bytes_per_token"], dtype=torch.uint8)
        host.to(dev, non_blocking=True)
        torch.cuda.synchronize(dev)
        reps, c0 = 3, time.perf_counter()
        for _ in range(reps):
            host.to(dev, non_blocking=True)
        torch.cuda.synchronize(dev)
        h2d_ms = 1000 * (time.perf_counter() - c0) / reps
    held = d.held_total()
    if cuda_peak is not None:
        trainer_bytes, kind = cuda_peak, "torch.cuda.max_memory_allocated"
    elif held is not None:
        trainer_bytes, kind = held, ("tensor bytes the path holds (CPU: no allocator peak; "
                                     "held_bytes has the parts)")
    else:
        trainer_bytes, kind = None, None
    print(json.dumps({"drafter": args.drafter, "drafter_tokens_per_s": steps * T / dt,
                      "steps": steps,
                      "compute_tokens_per_s": steps * T / compute_s,
                      "step_ms": 1000 * dt / steps, "h2d_ms": h2d_ms,
                      "flops_per_token": d.flops_per_token,
                      "gflops_per_s": steps * T * d.flops_per_token / dt / 1e9,
                      "peak_rss_bytes": peak_rss_bytes(),
                      "cuda_peak_allocated_bytes": cuda_peak,
                      "trainer_bytes": trainer_bytes, "trainer_bytes_kind": kind,
                      "held_bytes": d.held or None,
                      "lm_head_bytes": tensor_bytes([d.lm_head]),
                      "layers_streamed": k, "bytes_per_token": spec["bytes_per_token"],
                      "draft_vocab_size": spec["vocab"].size if spec["vocab"] else None,
                      "target_vocab_size": spec["vocab"].target_vocab_size
                      if spec["vocab"] else None,
                      "ttt_steps": args.ttt_steps if args.drafter in EAGLE3_KINDS else None}),
          flush=True)
    return 0


def pad(s0, tokens, rate):
    if rate and rate > 0:
        left = s0 + tokens / rate - time.perf_counter()
        if left > 0:
            time.sleep(left)


def run(args):
    import draftfeed
    torch = None
    if args.drafter != "none":
        import torch
        torch.set_num_threads(args.torch_threads)
    targets = args.targets.split(",")
    info = draftfeed.describe_target(targets[0])
    # What the feed asks for: the drafter's own stream for the eagle3 kinds, else --stream
    # (a `none` receiver measuring the link of an eagle3 stream) or the hidden states alone.
    stream = args.drafter if args.drafter in EAGLE3_KINDS else args.stream
    spec = stream_spec(stream, args.layers, int(info["num_layers"]), int(info["hidden_size"]),
                       int(info["vocab_size"]), args.draft_vocab_size, args.probs_encoding)
    layers = spec["layers"]
    vocab = min(args.vocab, int(info["vocab_size"]))
    drafter = Drafter(args.drafter, len(layers), int(info["hidden_size"]), args.flops_per_token,
                      args.device, vocab, args.seed, args.drafter_layers, args.draft_vocab,
                      spec=spec, ttt_steps=args.ttt_steps)
    device = torch.device(args.device) if torch is not None else None
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    rng = np.random.default_rng(args.seed)
    submitted = {"batches": 0, "tokens": 0}
    delivered = {"batches": 0, "tokens": 0}
    device_side = {}

    def counted(batches):
        for b in batches:
            submitted["batches"] += 1
            submitted["tokens"] += b.num_tokens
            yield b

    def inputs_of(r):
        """(hidden, outputs) on the drafter's device; outputs: the eagle3 kind's (draft probs
        float32 [T, Vd], argmax [T]), which move as their encoded bytes and widen there."""
        if drafter.kind == "none":  # a receiver only: the link's rate, not a copy's
            return None, None
        h = to_drafter(r, args.transport or "grpc", device, device_side)
        if drafter.kind != "eagle3":
            return h, None
        return h, (r.draft_probs_torch(device), r.argmax_torch(device))

    # Unordered: a drafter trains on whichever batch is ready (no head-of-line wait), and
    # the window grows with the number of targets so each has work from every trainer.
    prefetch = args.prefetch or max(8, 2 * len(targets))
    # The byte bound must hold the window: the default 1 GiB would keep one 2.5 GB batch
    # (49,152 tokens x 5 x 5120 bf16) in flight and idle the target during every step.
    batch_bytes = args.batch_tokens * spec["bytes_per_token"]
    prefetch_bytes = max(1 << 30, prefetch * batch_bytes)
    feed = open_feed(draftfeed, targets, layers, prefetch, prefetch_bytes,
                     args.credits_per_target, args.transport, args.cuda_device, spec["outputs"])
    try:
        # Warm-up: connections, the feed's rate estimates, torch's first-call costs.
        for r in feed.map(counted(synthetic_batches(rng, args.warmup_tokens, args.batch_tokens,
                                                    vocab, args.max_seq_len))):
            delivered["batches"] += 1
            delivered["tokens"] += r.num_tokens
            h, outs = inputs_of(r)
            drafter.step(h, r.token_ids, r.seq_lens, outs)
        if args.ready_file:
            open(args.ready_file, "w").close()
        if args.go_file:
            deadline = time.time() + 300
            while not os.path.exists(args.go_file):
                if time.time() > deadline:
                    raise RuntimeError("no go signal within 300 s")
                time.sleep(0.005)

        bytes0 = feed.stats()["bytes_received"]
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        forward_ms, send_ms, target_tokens = {}, {}, {}
        drafter_s, copy_s, tokens, steps = 0.0, 0.0, 0, 0
        queue, deliveries = [], []
        stop = threading.Event()
        t0 = time.time()

        def sample():  # Feed.stats() takes the feed's lock: safe beside next()/submit()
            while True:
                queue.append((round(time.time() - t0, 3), feed.stats()["queue_depth"]))
                if stop.wait(args.sample_every_s):
                    return

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for r in feed.map(counted(synthetic_batches(rng, args.tokens, args.batch_tokens, vocab,
                                                    args.max_seq_len))):
            deliveries.append((time.time(), r.num_tokens))
            delivered["batches"] += 1
            delivered["tokens"] += r.num_tokens
            tokens += r.num_tokens
            tm = r.timings
            forward_ms[r.target] = forward_ms.get(r.target, 0.0) + float(tm["forward_ms"])
            send_ms[r.target] = send_ms.get(r.target, 0.0) + float(tm["send_ms"])
            target_tokens[r.target] = target_tokens.get(r.target, 0) + r.num_tokens
            s0 = time.perf_counter()
            h, outs = inputs_of(r)
            copy_s += time.perf_counter() - s0  # grpc: pageable host -> GPU, synchronous
            drafter.step(h, r.token_ids, r.seq_lens, outs)
            pad(s0, r.num_tokens, args.drafter_rate)
            drafter_s += time.perf_counter() - s0
            steps += 1
        t1 = time.time()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        stop.set()
        sampler.join()
        queue.append((round(t1 - t0, 3), feed.stats()["queue_depth"]))
        stats = feed.stats()
    finally:
        feed.close()
    wall = t1 - t0
    print(json.dumps({
        "trainer": args.name, "start": t0, "end": t1, "wall_s": wall,
        "tokens": tokens, "steps": steps, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "drafter_s": drafter_s, "drafter_busy": drafter_s / wall if wall > 0 else 0.0,
        "copy_s": copy_s,
        "drafter_tokens_per_s": tokens / drafter_s if drafter_s > 0 else None,
        "flops_per_token": drafter.flops_per_token,
        "bytes_received": stats["bytes_received"] - bytes0,
        "forward_ms_by_target": forward_ms, "send_ms_by_target": send_ms,
        "tokens_by_target": target_tokens, "deliveries": deliveries,
        "tokens_submitted": submitted["tokens"], "tokens_delivered": delivered["tokens"],
        "batches_submitted": submitted["batches"], "batches_delivered": delivered["batches"],
        "feed_tokens_delivered": stats["tokens_delivered"], "feed_failed": stats["failed"],
        "feed_resent": stats["resent"], "queue_depth": queue,
        "cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
        "peak_rss_bytes": peak_rss_bytes(),
        "cuda_peak_allocated_bytes": cuda_peak_bytes(torch, device) if device else None,
        "held_bytes": drafter.held or None, "held_total_bytes": drafter.held_total(),
        "transport": args.transport or "grpc",
        "drafter": args.drafter, "stream": stream, "layers": layers,
        "bytes_per_token": spec["bytes_per_token"],
        "draft_vocab_size": spec["vocab"].size if spec["vocab"] else None,
    }), flush=True)
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="trainer")
    p.add_argument("--targets", default="", help="comma-separated host:port")
    p.add_argument("--layers", default="1,2,3",
                   help="layer ids; eagle3 kinds: 3 feature ids or 'eagle3' (EAGLE-3's of the "
                        "target's depth; eagle3-lmhead adds -1)")
    p.add_argument("--tokens", type=int, default=20000, help="measured tokens")
    p.add_argument("--warmup-tokens", type=int, default=2000)
    p.add_argument("--batch-tokens", type=int, default=512, help="packing token budget")
    p.add_argument("--vocab", type=int, default=4096, help="token ids drawn from [0, vocab)")
    p.add_argument("--drafter", choices=["none", "synthetic", "dflash", "dflash-full",
                                         *EAGLE3_KINDS], default="synthetic")
    p.add_argument("--drafter-layers", type=int, default=1, help="dflash-full: decoder layers")
    p.add_argument("--draft-vocab", type=int, default=32768, help="dflash-full: lm head size")
    p.add_argument("--stream", choices=STREAMS, default="hidden",
                   help="drafter none: receive what this kind's Feed asks for (the eagle3 "
                        "kinds always ask for their own)")
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="eagle3 kinds: draft vocabulary size (0: min(32000, target vocab))")
    p.add_argument("--probs-encoding", default="bf16", choices=["bf16", "fp8_e4m3"],
                   help="eagle3: the draft probabilities on the wire")
    p.add_argument("--ttt-steps", type=int, default=1,
                   help="eagle3 kinds: training-time-test steps per batch (EAGLE-3 uses ~7)")
    p.add_argument("--target-vocab-size", type=int, default=0,
                   help="--calibrate, eagle3 kinds: the target's vocabulary (0: --vocab)")
    p.add_argument("--max-seq-len", type=int, default=256,
                   help="synthetic sequences are 16..this many tokens")
    p.add_argument("--transport", default="", choices=["", "grpc", "nccl", "auto"],
                   help="passed to draftfeed.Feed (empty: the Feed's default, no keyword)")
    p.add_argument("--cuda-device", type=int, default=0,
                   help="with --transport: the GPU the feed delivers to (the drafter's)")
    p.add_argument("--flops-per-token", type=float, default=2e6)
    p.add_argument("--drafter-rate", type=float, default=0.0,
                   help="tokens/s cap of the drafter (emulated device speed); 0: none")
    p.add_argument("--device", default="cpu")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--prefetch", type=int, default=0, help="0: max(8, 2 x targets)")
    p.add_argument("--credits-per-target", type=int, default=4)
    p.add_argument("--sample-every-s", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-file", default="")
    p.add_argument("--go-file", default="")
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--calibrate-s", type=float, default=1.5)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=3)
    args = p.parse_args()
    return calibrate(args) if args.calibrate else run(args)


if __name__ == "__main__":
    sys.exit(main())
