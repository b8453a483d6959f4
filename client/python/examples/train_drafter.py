#!/usr/bin/env python3
"""A tiny DFlash-style drafter trained on hidden states streamed from a draftfeed target.

Data: synthetic token sequences from a fixed "bigram" rule (the next token follows a fixed
permutation of the current one most of the time), so there is something to learn. They are
packed under a token budget by draftfeed.packing (token_budget_batches as the DataLoader's
batch_sampler, PackingCollator as its collate_fn) and HiddenStateDataset adds the target's
hidden states of K layers to every batch.

Drafter: fc over the K concatenated layers [T, K*H] -> D, one pre-norm transformer block
(causal attention that stays inside each packed sequence, then an MLP), a norm and a small
lm head over a reduced draft vocabulary (as EAGLE-3 does; here simply the first N ids, where a
real run maps the N most frequent ones), trained with cross-entropy against the next token of
the same sequence.

    build/bin/draftfeed-target --model tiny-random --listen 127.0.0.1:50051 &
    PYTHONPATH=build/python python3 client/python/examples/train_drafter.py \
        --target 127.0.0.1:50051 --steps 30 --device cpu
"""

import argparse
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import draftfeed
from draftfeed.packing import PackingCollator, token_budget_batches
from draftfeed.torch import HiddenStateDataset


class SyntheticSequences(Dataset):
    """Sequence i is fixed by (seed, i): x[t+1] = rule[x[t]] with probability `p`, else random."""

    def __init__(self, n, vocab, min_len, max_len, p=0.8, seed=0):
        rng = np.random.default_rng(seed)
        self.rule = rng.permutation(vocab)
        self.lengths = rng.integers(min_len, max_len + 1, size=n).tolist()
        self.vocab, self.p, self.seed = vocab, p, seed

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        rng = np.random.default_rng((self.seed, i))
        n = self.lengths[i]
        x = np.empty(n, dtype=np.int64)
        x[0] = rng.integers(self.vocab)
        follow = rng.random(n) < self.p
        noise = rng.integers(self.vocab, size=n)
        for t in range(1, n):
            x[t] = self.rule[x[t - 1]] if follow[t] else noise[t]
        return torch.from_numpy(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Drafter(nn.Module):
    def __init__(self, num_layers, hidden_size, dim, vocab, heads=4):
        super().__init__()
        self.fc = nn.Linear(num_layers * hidden_size, dim, bias=False)  # DFlash's fc
        self.norm1, self.norm2, self.norm_out = RMSNorm(dim), RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.SiLU(),
                                 nn.Linear(4 * dim, dim, bias=False))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.heads = heads

    def forward(self, hidden, seq_ids):
        """hidden: [T, K, H] (any float dtype); seq_ids: [T], which packed sequence a token is in."""
        T = hidden.shape[0]
        x = self.fc(hidden.reshape(T, -1).to(self.fc.weight.dtype))
        q, k, v = self.qkv(self.norm1(x)).view(T, 3, self.heads, -1).unbind(1)  # [T, h, d] each
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
        pos = torch.arange(T, device=x.device)
        allowed = (seq_ids[:, None] == seq_ids[None, :]) & (pos[None, :] <= pos[:, None])
        attn = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        x = x + self.proj(torch.einsum("hts,shd->thd", attn, v).reshape(T, -1))
        x = x + self.mlp(self.norm2(x))
        return self.lm_head(self.norm_out(x))  # [T, vocab]


def next_token_targets(token_ids, seq_lens, draft_vocab):
    """labels[t] = token_ids[t + 1] inside a sequence; -100 (ignored) at each sequence's end
    and where the next token is outside the draft vocabulary."""
    labels = torch.full_like(token_ids, -100)
    labels[:-1] = token_ids[1:]
    ends = torch.cumsum(seq_lens.long(), 0) - 1
    labels[ends] = -100
    labels[labels >= draft_vocab] = -100
    return labels


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", required=True, help="host:port (repeatable)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (where the drafter trains)")
    p.add_argument("--layers", default="", help="comma-separated layer ids; default low, mid, high")
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--synthetic-vocab", type=int, default=256, help="token ids the data uses")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="lm head size (default: the synthetic vocabulary)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--prefetch", type=int, default=8)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    info = draftfeed.describe_target(args.target[0])
    L = info["num_layers"]
    layers = ([int(x) for x in args.layers.split(",")] if args.layers
              else sorted({1 % L, L // 2, L - 1}))  # EAGLE-3 / DFlash take low, mid, high
    vocab = min(args.synthetic_vocab, info["vocab_size"])
    draft_vocab = min(args.draft_vocab or vocab, info["vocab_size"])

    # The data pipeline, as it would be without draftfeed: a map-style dataset, packed batches.
    data = SyntheticSequences(n=4096, vocab=vocab, min_len=16, max_len=200, seed=args.seed)
    batches = token_budget_batches(data.lengths, args.token_budget,
                                   indices=np.random.default_rng(args.seed).permutation(len(data)))
    loader = DataLoader(data, batch_sampler=batches, collate_fn=PackingCollator(args.token_budget),
                        num_workers=1)

    model = Drafter(len(layers), info["hidden_size"], args.dim, draft_vocab).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    print(f"train_drafter: target {info['model_id']} (hidden {info['hidden_size']}, vocab "
          f"{info['vocab_size']}), layers {layers}, {args.steps} steps of {args.token_budget} "
          f"tokens on {device}; drafter {sum(p.numel() for p in model.parameters()):,} params, "
          f"draft vocab {draft_vocab}",
          flush=True)

    with draftfeed.Feed(targets=args.target, layers=layers, prefetch=args.prefetch) as feed:
        step, tokens, t0, window = 0, 0, time.perf_counter(), []
        while step < args.steps:  # epochs
            for batch in HiddenStateDataset(loader, feed, device=device):
                token_ids = batch["token_ids"].to(device, non_blocking=True).long()
                seq_lens = batch["seq_lens"].to(device, non_blocking=True)
                seq_ids = torch.repeat_interleave(torch.arange(len(seq_lens), device=device),
                                                  seq_lens.long())
                logits = model(batch["hidden"], seq_ids)  # hidden: bf16 [T, K, H] on device
                loss = F.cross_entropy(logits.float(), next_token_targets(token_ids, seq_lens, draft_vocab),
                                       ignore_index=-100)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
                tokens += int(token_ids.shape[0])
                window.append(loss.item())
                if step % args.log_every == 0 or step == args.steps or step == 1:
                    dt = time.perf_counter() - t0
                    print(f"step {step:4d}  loss {sum(window) / len(window):.4f}  "
                          f"({tokens / dt:,.0f} tokens/s, batch {batch['batch_id']})", flush=True)
                    window = []
                if step == args.steps:
                    break
        stats = feed.stats()
    print(f"train_drafter: done: {step} steps, {tokens} tokens, feed delivered "
          f"{stats['delivered']} batches, failed {stats['failed']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
