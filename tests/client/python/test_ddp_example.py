"""client/python/examples/ddp_trainer.py as two DDP ranks on the CPU (gloo).

The ranks are started as plain processes with the environment torchrun gives
each (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): Debian's
torchrun (torch 1.13) fails on Python 3.11 before starting any rank (its
Std flag enum loses the zero member), and the example reads only that
environment, so this is the run torchrun would make.
"""

import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import REPO

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

EXAMPLE = REPO / "client/python/examples/ddp_trainer.py"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="this torch has no gloo backend")
def test_two_ranks_train_in_lockstep_on_disjoint_shares(target):
    steps, world, port = 5, 2, free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--target", target.address, "--steps", str(steps)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    shares, digests = [], []
    for rank, out in enumerate(outs):
        m = re.search(rf"rank {rank}/{world}: {steps} steps on batches \[([\d, ]+)\].*"
                      r"params ([0-9a-f]{16})", out)
        assert m, out
        shares.append([int(x) for x in m.group(1).split(",")])
        digests.append(m.group(2))
    # Rank r trains on batches r, r + world, ...: disjoint, together the first world*steps.
    assert shares == [list(range(r, world * steps, world)) for r in range(world)]
    # DDP kept every rank's parameters identical, bit for bit.
    assert digests[0] == digests[1]
    assert "params on every rank: equal" in outs[0]
