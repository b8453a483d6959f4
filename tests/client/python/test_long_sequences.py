"""Sequences longer than one forward, through both Python clients (the compiled one and the
pure-Python grpcio one, an implementation of the wire independent of the C++ client): a target
whose forward takes 128 tokens runs a 1,000-token sequence in chunks and hands back the same
bits and checksum, target outputs included, as a target that runs it in one forward; over
--max_sequence_tokens the error names both numbers and the flag, and the stream goes on."""

import numpy as np
import pytest

import draftfeed
from draftfeed import _client

TRANSPORTS = ["grpcio"] + (["grpc"] if _client.native is not None else [])
LENS = np.array([30, 1000, 7], dtype=np.int32)
TOKENS = np.random.default_rng(3).integers(0, 4096, size=int(LENS.sum()), dtype=np.int32)


@pytest.fixture(scope="module")
def targets():
    from conftest import TargetProcess

    chunking = TargetProcess(extra=("--max_batch_tokens=128", "--max_sequence_tokens=4096"))
    one_pass = TargetProcess(extra=("--max_batch_tokens=4096", "--max_sequence_tokens=4096"))
    yield chunking, one_pass
    chunking.kill()
    one_pass.kill()


def fetch(address, transport):
    with draftfeed.Feed(targets=[address], layers=[0, 2, -1], top_k=4, transport=transport) as f:
        info = f.target_info()
        r = next(iter(f.map([(TOKENS, LENS)])))
        return info, r.hidden_bits.copy(), np.array(r.top_k_ids), r.checksum


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_long_sequence_arrives_whole_and_as_one_pass_computes_it(targets, transport):
    chunking, one_pass = targets
    info, bits, top, ck = fetch(chunking.address, transport)
    assert info["max_batch_tokens"] == 128 and info["max_sequence_tokens"] == 4096
    _, want_bits, want_top, want_ck = fetch(one_pass.address, transport)
    assert bits.shape == (1037, 3, 128)
    np.testing.assert_array_equal(bits, want_bits)
    np.testing.assert_array_equal(top, want_top)
    assert ck == want_ck


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_over_the_limit_names_both_numbers_and_the_stream_goes_on(targets, transport):
    chunking, _ = targets
    long = np.zeros(4097, dtype=np.int32)
    with draftfeed.Feed(targets=[chunking.address], layers=[-1], transport=transport) as f:
        f.submit(long, np.array([4000, 97], dtype=np.int32))
        with pytest.raises(draftfeed.DraftfeedError,
                           match=r"4097 tokens, over this target's 4096 \(--max_sequence_tokens"):
            f.next()
        f.submit(TOKENS[:300], np.array([300], dtype=np.int32))
        assert f.next().hidden_bits.shape == (300, 1, 128)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_batch_queued_behind_slow_ones_is_waiting_not_hung(make_target, transport):
    # Each 150-token batch takes 1.5 s (the target throttled to 100 tokens/s), so the fourth
    # of four sent at once waits 4.5 s for its first chunk, longer than batch_timeout_s: the
    # stream makes progress all along, so no target is declared hung and nothing is re-sent.
    t = make_target(extra=("--throttle_tokens_per_s=100",))
    batches = [(TOKENS[i * 150:(i + 1) * 150], np.array([150], dtype=np.int32)) for i in range(4)]
    with draftfeed.Feed(targets=[t.address], layers=[-1], prefetch=4, batch_timeout_s=2.5,
                        transport=transport) as f:
        got = [r.batch_id for r in f.map(batches)]
        stats = f.stats()
    assert got == [1, 2, 3, 4]
    assert stats["resent"] == 0 and stats["targets"][0]["failures"] == 0, stats
