#!/usr/bin/env python3
"""Data-parallel drafter training with draftfeed: one Feed per rank, DDP over the ranks.

    build/bin/draftfeed-target --model tiny-random --listen 127.0.0.1:50051 &
    PYTHONPATH=build/python torchrun --standalone --nproc_per_node 2 \\
        client/python/examples/ddp_trainer.py --target 127.0.0.1:50051 --steps 20

What changes for torch.distributed: each rank opens its own Feed after
init_process_group (every rank is given every target: each feed sends to the
target that would finish soonest, so the ranks spread themselves over them),
and each rank packs only its share of the data set, the same number of steps on
every rank (DDP waits for all ranks at every backward). draftfeed computes what
a rank gives it; the gradients are averaged by DDP as without draftfeed.

Debian 12's torchrun (torch 1.13 on Python 3.11) fails before it starts a rank
(its Std flag enum loses the zero member); start each rank with the environment
torchrun would give it instead:

    for r in 0 1; do RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 \
        MASTER_PORT=29500 PYTHONPATH=build/python python3 \
        client/python/examples/ddp_trainer.py --target 127.0.0.1:50051 & done; wait

Without RANK/WORLD_SIZE it runs as a single rank. It prints,
per rank, the batches it trained on and the loss, and at the end checks that
every rank holds the same parameters (what DDP guarantees) and exits 1 if not.
Backend: gloo on the CPU (--device cpu), nccl with --device cuda (rank r takes
cuda:r).
"""

import argparse
import gc
import hashlib
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

import draftfeed
from draftfeed.packing import PackingCollator, token_budget_batches
from draftfeed.torch import HiddenStateDataset


class Sequences(Dataset):
    """Item i: a fixed token sequence (the same on every rank and run)."""

    def __init__(self, n, vocab, seed=0):
        rng = np.random.default_rng(seed)
        self.lengths = rng.integers(8, 96, size=n).tolist()
        self.vocab, self.seed = vocab, seed

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        rng = np.random.default_rng((self.seed, i))
        return torch.from_numpy(rng.integers(self.vocab, size=self.lengths[i]))


class Drafter(nn.Module):
    """fc over the K captured layers [T, K*H] -> D (DFlash's and EAGLE-3's fusion), an MLP
    and a head over the next token."""

    def __init__(self, k, hidden, dim, vocab):
        super().__init__()
        self.fc = nn.Linear(k * hidden, dim, bias=False)
        self.mlp = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim), nn.SiLU())
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, hidden):
        x = self.fc(hidden.reshape(hidden.shape[0], -1).float())
        return self.head(x + self.mlp(x))


def rank_and_world():
    """torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); one rank without it."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


def rank_batches(batches, rank, world):
    """This rank's share, the same count on every rank (DDP steps in lockstep)."""
    per_rank = len(batches) // world
    return batches[rank::world][:per_rank]


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", required=True, help="host:port (repeatable)")
    p.add_argument("--steps", type=int, default=20, help="steps per rank (at most its batches)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (rank r trains on cuda:r)")
    p.add_argument("--token-budget", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256, help="token ids the data uses")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    rank, world, local_rank = rank_and_world()
    cuda = args.device.startswith("cuda")
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    distributed = world > 1
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)

    info = draftfeed.describe_target(args.target[0])
    L = info["num_layers"]
    layers = sorted({1 % L, L // 2, L - 1}) + [-1]  # low, middle, high and the final state
    data = Sequences(n=64 * world * max(1, args.steps // 8 + 1), vocab=args.vocab,
                     seed=args.seed)
    batches = token_budget_batches(data.lengths, args.token_budget)
    mine = rank_batches(batches, rank, world)[:args.steps]
    loader = DataLoader(data, batch_sampler=mine, collate_fn=PackingCollator(args.token_budget))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = Drafter(len(layers), info["hidden_size"], args.dim, args.vocab).to(device)
    if distributed:
        model = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    losses = []
    feed = draftfeed.Feed(targets=args.target, layers=layers, prefetch=4,
                          client_name=f"ddp-rank{rank}")
    with feed:
        for batch in HiddenStateDataset(loader, feed, device=device if cuda else None):
            tokens = torch.as_tensor(batch["token_ids"]).long().to(device)
            lens = torch.as_tensor(batch["seq_lens"]).long()
            labels = torch.full_like(tokens, -100)
            labels[:-1] = tokens[1:]
            labels[torch.cumsum(lens, 0).to(device) - 1] = -100  # no target past a sequence
            loss = F.cross_entropy(model(batch["hidden"]), labels, ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        stats = feed.stats()

    params = torch.cat([q.detach().reshape(-1).cpu() for q in model.parameters()])
    digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]
    print(f"rank {rank}/{world}: {len(losses)} steps on batches "
          f"{[batches.index(b) for b in mine]}, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"{stats['tokens_delivered']} tokens from {len(stats['targets'])} target(s), "
          f"params {digest}", flush=True)
    same = True
    if distributed:
        gathered = [None] * world
        dist.all_gather_object(gathered, digest)
        same = len(set(gathered)) == 1
        if rank == 0:
            print(f"params on every rank: {'equal' if same else 'DIFFERENT'} ({gathered})",
                  flush=True)
        # The DDP reducer and the optimiser hold gloo work on the group: let
        # them go, and every rank reach this point, before the group does.
        # Torn down in the other order, the group's destructor can join a
        # gloo thread that waits for the GIL the destructor's caller holds
        # (a hang at exit seen with torch 1.13's gloo).
        del model, opt
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return 0 if same and len(losses) == len(mine) else 1


if __name__ == "__main__":
    sys.exit(main())
