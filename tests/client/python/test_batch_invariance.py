"""TargetInfo.batch_invariant, through both Python clients: a CPU target says its rows ignore
their batch, and they do: one sequence alone, then first, in the middle and last among others
(target outputs included), gives the same bits and the same per-sequence values every time."""

import numpy as np
import pytest

import draftfeed
from draftfeed import _client

TRANSPORTS = ["grpcio"] + (["grpc"] if _client.native is not None else [])
RNG = np.random.default_rng(11)
SEQ = RNG.integers(0, 4096, size=157, dtype=np.int32)
OTHERS = [RNG.integers(0, 4096, size=n, dtype=np.int32) for n in (64, 301, 9)]


@pytest.fixture(scope="module")
def target():
    from conftest import TargetProcess

    t = TargetProcess(extra=("--max_batch_tokens=1024",))
    yield t
    t.kill()


def placements():
    yield "alone", [SEQ], 0
    yield "first", [SEQ, OTHERS[0], OTHERS[1]], 0
    yield "middle", [OTHERS[1], SEQ, OTHERS[2]], 1
    yield "last", [OTHERS[0], OTHERS[2], SEQ], 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_batch_invariant_target_gives_a_sequence_the_same_bits_in_any_batch(target, transport):
    with draftfeed.Feed(targets=[target.address], layers=[0, -1], top_k=4,
                        transport=transport) as f:
        info = f.target_info()
        assert info["batch_invariant"] is True and info["numerics"] == "cpu fp32"
        got = {}
        for name, seqs, index in placements():
            lens = np.array([len(s) for s in seqs], dtype=np.int32)
            r = next(iter(f.map([(np.concatenate(seqs), lens)])))
            begin = int(lens[:index].sum())
            rows = slice(begin, begin + len(SEQ))
            got[name] = (r.hidden_bits[rows].copy(), np.array(r.top_k_ids)[rows].copy(),
                         np.array(r.top_k_logprobs)[rows].copy())
    alone = got.pop("alone")
    for name, (bits, ids, logprobs) in got.items():
        np.testing.assert_array_equal(bits, alone[0], err_msg=name)
        np.testing.assert_array_equal(ids, alone[1], err_msg=name)
        assert logprobs.tobytes() == alone[2].tobytes(), name
