#!/usr/bin/env python3
"""An EAGLE-3 drafter trained on what a draftfeed target sends: hidden states of three layers
and, per token, the target's own next-token distribution over the draft vocabulary.

EAGLE-3 trains against the target's distribution, softmax(lm_head(final_norm(h))) restricted to
a draft vocabulary. Computed in the trainer, that takes the target's lm_head ([V, H]: 2.5 GB in
bf16 for a 248k-vocabulary, 5120-wide Qwen) and a [T, V] fp32 logits tensor per batch. Here the
target computes it (`Feed(..., draft_vocab=ids, argmax=True)`) and sends [T, Vd] probabilities
(bf16, or fp8_e4m3 with --probs-encoding) and its full-vocabulary argmax. --compare-lm-head
also trains the same drafter the old way (layer -1 from the feed, lm_head in the trainer) and
prints what each way holds.

Drafter (after SafeAILab/EAGLE's eagle3 cnets.py and SpecForge's llama3_eagle.py, plain torch):
fc: Linear(3H -> D) fusing the low/mid/high states (draftfeed.layers.eagle3); one decoder layer
whose attention reads [embed(token); hidden] (2D wide), then an MLP; its own (trained) embedding
of the target vocabulary; a head Linear(D -> Vd). D defaults to H, as in EAGLE-3.
Training-time test (TTT, --ttt-steps, default 3): step 0 pairs the target's features at t with
token t+1 and predicts the target's distribution at t+1; step j > 0 feeds the drafter's own
output of step j-1 in place of the features and looks one token further (t+1+j), as drafting
several tokens in a row will. Every shift stays inside its packed sequence.

Data: synthetic sequences from a fixed random Markov chain over a few token ids, packed by
draftfeed.packing; the draft vocabulary is built with draftfeed.vocab from their counts.

    build/bin/draftfeed-target --model tiny-random --listen 127.0.0.1:50051 &
    PYTHONPATH=build/python python3 client/python/examples/train_eagle3.py \\
        --targets 127.0.0.1:50051 --steps 200 --device cuda:0 [--compare-lm-head]

On a CPU with a slow BLAS (Debian's torch), a narrower, shorter run learns in ~20 s (the
test's): --dim 64 --token-budget 128 --lr 1e-2 --steps 50 --device cpu.
"""

import argparse
import collections
import json
import math
import os
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import draftfeed
import draftfeed.vocab
from draftfeed.packing import PackingCollator, token_budget_batches


# --------------------------------------------------------------------------------------- data
class MarkovSequences(Dataset):
    """Sequence i is fixed by (seed, i): a walk on a random chain over `states` token ids, where
    the next state is succ[state] with probability `follow`, else any state. A low-entropy
    chain keeps the contexts few, so the target's distribution along them is a function the
    drafter can learn in a short run. The first `prompt` tokens get loss_mask 0, as a chat
    template's prompt would: the mask travels through packing (PackingCollator packs it into
    PackedBatch.extras) into the position mask and the draft-vocabulary counts."""

    def __init__(self, n, target_vocab, states=32, follow=0.9, min_len=24, max_len=96,
                 prompt=4, seed=0):
        rng = np.random.default_rng(seed)
        self.ids = rng.choice(target_vocab, size=states, replace=False)  # state -> token id
        self.succ = rng.permutation(states)
        self.lengths = rng.integers(min_len, max_len + 1, size=n).tolist()
        self.states, self.follow, self.prompt, self.seed = states, follow, prompt, seed

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        rng = np.random.default_rng((self.seed, i))
        n = self.lengths[i]
        jump, anywhere = rng.random(n) >= self.follow, rng.integers(self.states, size=n)
        s = np.empty(n, dtype=np.int64)
        s[0] = anywhere[0]
        for t in range(1, n):
            s[t] = anywhere[t] if jump[t] else self.succ[s[t - 1]]
        loss_mask = np.ones(n, dtype=np.int32)
        loss_mask[:self.prompt] = 0
        return {"input_ids": self.ids[s], "loss_mask": loss_mask}


# ------------------------------------------------------------------------------------ drafter
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, pos, theta=10000.0):
    """Rotary embedding of x [T, heads, d] at positions pos [T] (restarting per sequence)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None, :]  # [T, d/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class Eagle3Drafter(nn.Module):
    def __init__(self, target_hidden, hidden, vocab, draft_vocab, heads=4, mlp_mult=3):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.embed = nn.Embedding(vocab, hidden)
        self.input_norm, self.hidden_norm = RMSNorm(hidden), RMSNorm(hidden)
        # EAGLE-3's attention takes the token embedding and the hidden side by side: 2D wide.
        self.q = nn.Linear(2 * hidden, hidden, bias=False)
        self.k = nn.Linear(2 * hidden, hidden, bias=False)
        self.v = nn.Linear(2 * hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.post_norm, self.norm = RMSNorm(hidden), RMSNorm(hidden)
        self.gate = nn.Linear(hidden, mlp_mult * hidden, bias=False)
        self.up = nn.Linear(hidden, mlp_mult * hidden, bias=False)
        self.down = nn.Linear(mlp_mult * hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, draft_vocab, bias=False)

    def fuse(self, features):
        """[T, 3, H] target states (bf16) -> [T, D]."""
        return self.fc(features.reshape(features.shape[0], -1).to(self.fc.weight.dtype))

    def step(self, hidden, tokens, pos, causal, cache):
        """One TTT step. hidden [T, D]: fused target features (step 0) or this drafter's previous
        output; tokens [T]: the token each position embeds at this step. `cache` collects every
        step's (k, v): a query attends step 0's keys causally within its sequence (the target's
        real features, all known when drafting) and, for steps 1..j, only its own position's key
        (the diagonal: the tokens it drafted itself on the way). Returns (hidden out, logits)."""
        T, h, d = hidden.shape[0], self.heads, self.head_dim
        x = torch.cat([self.input_norm(self.embed(tokens)), self.hidden_norm(hidden)], -1)
        q = rope(self.q(x).view(T, h, d), pos)
        k = rope(self.k(x).view(T, h, d), pos)
        cache.append((k, self.v(x).view(T, h, d)))
        k0, v0 = cache[0]
        scores = torch.einsum("thd,shd->hts", q, k0).masked_fill(~causal, float("-inf"))
        diag = [(q * ki).sum(-1).t()[..., None] for ki, _ in cache[1:]]  # each [h, T, 1]
        attn = (torch.cat([scores, *diag], -1) / math.sqrt(d)).softmax(-1)  # [h, T, T + j]
        out = torch.einsum("hts,shd->thd", attn[..., :T], v0)
        for i, (_, vi) in enumerate(cache[1:]):
            out = out + attn[..., T + i].t()[..., None] * vi
        hidden = hidden + self.o(out.reshape(T, -1))  # EAGLE-3's residual is the hidden input
        y = self.post_norm(hidden)
        hidden = hidden + self.down(F.silu(self.gate(y)) * self.up(y))  # SwiGLU MLP
        return hidden, self.head(self.norm(hidden))


def ttt_loss(model, features, tokens, seq_lens, probs, loss_mask, pmask, steps):
    """EAGLE-3's losses and accuracies over `steps` TTT steps for one packed batch.

    features [T, 3, H]; tokens [T] (long); probs [T, Vd]: the target's distribution at each
    position over the draft vocabulary (it predicts the token after that position);
    loss_mask [T] float; pmask [T] float = vocab.position_mask(argmax, loss_mask): 1 where the
    position is trained on and the target's full-vocabulary argmax is in the draft vocabulary
    (a drafter can only propose draft-vocabulary tokens). Step j at position t embeds token
    t+1+j and is scored against probs[t+1+j], inside t's own sequence only.
    """
    T, dev = tokens.shape[0], tokens.device
    seq_id = torch.repeat_interleave(torch.arange(len(seq_lens), device=dev), seq_lens)
    ends = torch.cumsum(seq_lens, 0)[seq_id]  # exclusive end of each token's sequence
    t = torch.arange(T, device=dev)
    pos = t - (ends - seq_lens[seq_id])  # position in its sequence, for RoPE
    causal = (seq_id[:, None] == seq_id[None, :]) & (t[None, :] <= t[:, None])
    hidden, cache, losses, accs = model.fuse(features), [], [], []
    for j in range(steps):
        src = t + 1 + j
        valid = src < ends  # t+1+j is still in t's sequence: never read the next one
        src = src.clamp(max=T - 1)
        step_tokens = torch.where(valid, tokens[src], torch.zeros_like(tokens))
        p, m = probs[src].float(), pmask[src] * valid
        n = (loss_mask[src] * valid).sum().clamp(min=1)  # positions trained on at this step
        hidden, logits = model.step(hidden, step_tokens, pos, causal, cache)
        logp = F.log_softmax(logits.float(), -1)
        losses.append(-(m[:, None] * p * logp).sum() / n)
        # EAGLE-3's accuracy: positions whose target argmax lies outside the draft vocabulary
        # are misses (m = 0 there), as they would be when drafting.
        accs.append(float(((logits.argmax(-1) == p.argmax(-1)).float() * m).sum() / n))
    return losses, accs


# ------------------------------------------------------------------- the lm_head baseline
def read_lm_head(path):
    """lm_head.weight (or, for tied embeddings, embed_tokens.weight) of a checkpoint directory
    or .safetensors file, sharded or not, as a torch tensor; draftfeed.vocab's safetensors
    reader returns bf16 as raw bits, which a view turns back into torch.bfloat16."""
    files = [path]
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            shards = sorted(set(json.load(open(index))["weight_map"].values()))
            files = [os.path.join(path, f) for f in shards]
        else:
            files = [os.path.join(path, "model.safetensors")]
    for suffix in ("lm_head.weight", "embed_tokens.weight"):
        for f in files:
            header, _ = draftfeed.vocab.safetensors_header(f)
            names = [n for n in header if n.endswith(suffix)]
            if names:
                a = draftfeed.vocab.read_safetensors(f, names[:1])[names[0]]
                bf16 = header[names[0]]["dtype"] == "BF16"
                t = torch.from_numpy(a.view(np.int16) if bf16 else a)
                return t.view(torch.bfloat16) if bf16 else t
    raise KeyError(f"{path}: no lm_head.weight or embed_tokens.weight")


def load_lm_head(info, path, dtype, device, seed):
    """The target's lm_head [V, H]: from `path`, or the target's own checkpoint directory when
    this machine can read it; else (the built-in random models) a random head of the same shape
    and init (std 1/sqrt(H)), which costs the trainer exactly as much memory."""
    path = path or info.get("model_id", "")
    if path and os.path.exists(path):
        w = read_lm_head(path)
        return w.to(device, dtype), f"{list(w.shape)} lm_head.weight from {path}"
    g = torch.Generator().manual_seed(seed + 1)
    V, H = info["vocab_size"], info["hidden_size"]
    w = torch.randn(V, H, generator=g) / math.sqrt(H)
    return w.to(device, dtype), (f"a random [{V}, {H}] head (the target {info['model_id']} has no "
                                 f"checkpoint here: memory as the real one, other distributions)")


# ---------------------------------------------------------------------------------- training
def batches_forever(data, token_budget, seed):
    """Packed batches (PackedBatch with extras["loss_mask"]), a new shuffle every epoch."""
    for epoch in range(1 << 30):
        order = np.random.default_rng((seed, epoch)).permutation(len(data))
        batches = token_budget_batches(data.lengths, token_budget, indices=order)
        yield from DataLoader(data, batch_sampler=batches, collate_fn=PackingCollator(token_budget))


def train(args, info, layers, vocab, data, use_lm_head):
    """One training run; returns per-step loss and accuracies and the bytes its targets held."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)  # the same drafter init for both paths
    H = info["hidden_size"]
    model = Eagle3Drafter(H, args.dim or H, info["vocab_size"], len(vocab.ids)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    ids = torch.from_numpy(vocab.ids.astype(np.int64)).to(device)  # the draft columns
    if use_lm_head:
        # The baseline: the final-norm state comes with the features (layer -1) and the trainer
        # holds the lm_head; the feed sends hidden states only.
        head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        lm_head, what = load_lm_head(info, args.lm_head, head_dtype, device, args.seed)
        print(f"baseline: lm_head on the trainer: {what}", flush=True)
        feed = draftfeed.Feed(targets=args.targets, layers=layers + [-1], prefetch=args.prefetch)
    else:
        feed = draftfeed.Feed(targets=args.targets, layers=layers, prefetch=args.prefetch,
                              draft_vocab=vocab.ids, argmax=True,
                              probs_encoding=args.probs_encoding)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    held, rows = (0, 0), collections.defaultdict(list)  # (bytes, T) of the largest batch
    pending = collections.deque()  # an ordered feed returns results in submission order

    def submissions():
        for packed in batches_forever(data, args.token_budget, args.seed):
            pending.append(packed)
            yield packed.token_ids, packed.seq_lens

    t0, tokens = time.perf_counter(), 0
    with feed:
        for step, r in enumerate(feed.map(submissions()), start=1):
            packed = pending.popleft()  # the batch this result was computed from
            assert r.num_tokens == packed.num_tokens
            hidden = r.torch(device)  # bf16 [T, K, H]
            lm = torch.as_tensor(packed.extras["loss_mask"], dtype=torch.float32, device=device)
            if use_lm_head:
                # What the target's outputs replace: [T, V] logits from the final-norm state.
                logits = (hidden[:, 3].to(lm_head.dtype) @ lm_head.t()).float()
                argmax = logits.argmax(-1)
                probs = logits[:, ids].softmax(-1)  # EAGLE-3: softmax over the draft columns
                held = max(held, (lm_head.numel() * lm_head.element_size() + logits.numel() * 4
                                  + probs.numel() * 4 + argmax.numel() * argmax.element_size(),
                                  r.num_tokens))
                del logits
            else:
                probs = r.draft_probs_torch(device)  # float32 [T, Vd], widened on `device`
                argmax = r.argmax_torch(device)  # int32 [T], full vocabulary
                held = max(held, (probs.numel() * 4 + argmax.numel() * 4, r.num_tokens))
            pmask = vocab.position_mask(argmax, lm)  # t2d[argmax] * loss_mask, float [T]
            tok = torch.as_tensor(packed.token_ids, dtype=torch.long, device=device)
            lens = torch.as_tensor(packed.seq_lens, dtype=torch.long, device=device)
            losses, accs = ttt_loss(model, hidden[:, :3], tok, lens, probs, lm, pmask,
                                    args.ttt_steps)
            # EAGLE-3 weights step j by 0.8^j: the later steps start from the drafter's own,
            # noisier features and matter less for the acceptance length.
            loss = sum(0.8 ** j * l for j, l in enumerate(losses))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tokens += r.num_tokens
            rows["loss"].append(loss.item())
            rows["covered"].append(float(pmask.sum() / lm.sum().clamp(min=1)))
            for j, a in enumerate(accs):
                rows[f"acc{j}"].append(a)
            if step % args.log_every == 0 or step == 1 or step == args.steps:
                print(f"{'lm_head ' if use_lm_head else ''}step {step:4d}  loss {loss.item():.4f}  "
                      + "  ".join(f"acc{j} {a:.3f}" for j, a in enumerate(accs))
                      + f"  ({tokens / (time.perf_counter() - t0):,.0f} tok/s)", flush=True)
            if step == args.steps:
                break
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return rows, held, peak


def first_last(values):
    """Means over the first and the last 10% of the steps (at least one step each)."""
    n = max(1, len(values) // 10)
    return sum(values[:n]) / n, sum(values[-n:]) / n


def report(rows, label, ttt_steps):
    for j in range(ttt_steps):
        a, b = first_last(rows[f"acc{j}"])
        print(f"{label}accuracy step{j}: first {a:.3f} -> last {b:.3f}", flush=True)
    a, b = first_last(rows["loss"])
    print(f"{label}loss: first {a:.4f} -> last {b:.4f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", required=True,
                   help="host:port[,host:port...] of running targets (this script starts none)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ttt-steps", type=int, default=3, help="TTT steps (EAGLE-3 uses 7)")
    p.add_argument("--token-budget", type=int, default=512, help="tokens per packed batch")
    p.add_argument("--dim", type=int, default=0,
                   help="drafter width (default: the target's hidden size, as EAGLE-3 has it)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="draft vocabulary size (default min(32000, target vocab))")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (where the drafter trains)")
    p.add_argument("--probs-encoding", default="bf16", choices=["bf16", "fp8_e4m3"],
                   help="how the target sends the draft probabilities")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-lm-head", action="store_true",
                   help="also train with the trainer computing p from lm_head, print both memories")
    p.add_argument("--lm-head", default="",
                   help="checkpoint (dir or .safetensors) for --compare-lm-head; default: the "
                        "target's model directory if readable here, else a random head")
    p.add_argument("--sequences", type=int, default=4096, help="sequences in the synthetic data")
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()
    args.targets = [a for a in args.targets.split(",") if a]
    if args.ttt_steps < 1:
        p.error("--ttt-steps must be >= 1")

    info = draftfeed.describe_target(args.targets[0])
    L, V = info["num_layers"], info["vocab_size"]
    # EAGLE-3's low/mid/high states. Its 4th id, -1 (the final-norm state), is what the target's
    # outputs replace. eagle3() wants >= 7 layers; the 3- and 4-layer built-ins take 0, 1, 2.
    layers = draftfeed.layers.eagle3(L)[:3] if L >= 7 else [0, 1, 2]
    data = MarkovSequences(args.sequences, V, seed=args.seed)
    # The draft vocabulary: the most frequent loss-masked token ids of the training data
    # (EAGLE-3's recipe). Fewer distinct ids than its size: the lowest unseen ids fill it.
    counts = draftfeed.vocab.count_tokens(data, V)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # that fill's warning; the line below says it
        size = args.draft_vocab_size or min(32000, V)
        vocab = draftfeed.vocab.DraftVocab.from_counts(counts, size)
    print(f"train_eagle3: target {info['model_id']} ({L} layers, hidden {info['hidden_size']}, "
          f"vocab {V}), layers {layers}, draft vocab {len(vocab)} ({np.count_nonzero(counts)} "
          f"ids seen in the data), {args.ttt_steps} TTT steps, {args.steps} steps of "
          f"{args.token_budget} tokens on {args.device}, probs {args.probs_encoding}", flush=True)

    runs = [("", False)] + ([("lm_head ", True)] if args.compare_lm_head else [])
    results = []
    for label, use_lm_head in runs:
        rows, held, peak = train(args, info, layers, vocab, data, use_lm_head)
        results.append((label, held, peak))
        print(f"{label}the draft vocabulary holds the target's argmax at "
              f"{np.mean(rows['covered']):.1%} of the trained positions (the rest: misses)")
        report(rows, label, args.ttt_steps)
    for label, held, peak in results if args.compare_lm_head else []:
        what = ("lm_head weights + [T, V] fp32 logits + [T, Vd] fp32 probs + argmax" if label
                else "[T, Vd] fp32 draft probs + int32 argmax, as the target sent them")
        line = (f"memory, {'lm_head in the trainer' if label else 'target outputs'}: "
                f"{held[0] / 2**20:.3f} MiB of target-distribution tensors at the largest batch, "
                f"T={held[1]} ({what})")
        if peak is not None:
            line += f"; torch.cuda.max_memory_allocated {peak / 2**20:.1f} MiB over the run"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
