"""One trainer rank for the multi-target tests: feeds its share of a fixed
synthetic data set through draftfeed and writes a digest of every batch.

    rank_worker.py --targets a,b,c --rank R --world W --batches N --out FILE
"""

import argparse
import hashlib
import json
import sys

import numpy as np

import draftfeed


def dataset(n_batches, seed=1234):
    """The whole data set: batch i is the same on every run."""
    for i in range(n_batches):
        rng = np.random.default_rng(seed + i)
        lens = rng.integers(1, 60, size=int(rng.integers(1, 5))).astype(np.int32)
        yield i, rng.integers(0, 4096, size=int(lens.sum()), dtype=np.int32), lens


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--targets", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--batches", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch-timeout", type=float, default=120.0)
    args = p.parse_args()
    mine = [(i, t, l) for i, t, l in dataset(args.batches) if i % args.world == args.rank]
    digests = {}
    with draftfeed.Feed(targets=args.targets.split(","), layers=[0, 2, -1], prefetch=4,
                        credits_per_target=2, batch_timeout_s=args.batch_timeout,
                        unavailable_timeout_s=30.0) as feed:
        for n, r in enumerate(feed.map((t, l) for _, t, l in mine)):
            i = mine[n][0]
            assert np.array_equal(r.token_ids, mine[n][1])
            digests[i] = hashlib.sha256(r.hidden_bits.tobytes()).hexdigest()
            print(f"rank {args.rank}: batch {i} from {r.target}", flush=True)
        stats = feed.stats()
    json.dump({"digests": digests, "stats": stats}, open(args.out, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
