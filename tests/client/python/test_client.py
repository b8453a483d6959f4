"""The Python client against real target processes on loopback."""

import subprocess
import sys

import numpy as np
import pytest

import draftfeed
from conftest import REPO, TARGET_BIN


def tokens(n, seed, vocab=4096):
    return np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.int32)


def test_describe_target(target):
    info = draftfeed.describe_target(target.address)
    assert info["model_id"] == "tiny-random:0"
    assert info["architecture"] == "qwen3_5"
    assert info["num_layers"] == len(info["layer_types"]) == 4
    assert set(info["layer_types"]) == {"linear_attention", "full_attention"}
    assert len(info["fingerprint"]) >= 16


def test_results_have_shape_order_and_checksum(target):
    layers = [3, 0, -1]
    with draftfeed.Feed(targets=[target.address], layers=layers, prefetch=4) as feed:
        lens = [[5], [1, 2, 3], [64, 65], [200]]
        batches = [(tokens(sum(l), i), np.array(l, dtype=np.int32)) for i, l in enumerate(lens)]
        results = list(feed.map(batches))
    assert [r.batch_id for r in results] == [1, 2, 3, 4]
    for (tok, sl), r in zip(batches, results):
        np.testing.assert_array_equal(r.token_ids, tok)
        np.testing.assert_array_equal(r.seq_lens, sl)
        assert r.encoding == "bf16" and r.bytes_per_token == 3 * 128 * 2
        assert r.hidden_bits.shape == (len(tok), 3, 128) and r.hidden_bits.dtype == np.uint16
        assert r.hidden.dtype == np.float32 and r.hidden.shape == (len(tok), 3, 128)
        # float32 view is the exact widening of the bf16 bits
        np.testing.assert_array_equal(r.hidden.view(np.uint32) >> 16, r.hidden_bits)
        assert np.isfinite(r.hidden).all()
        assert r.hidden.std() > 0.01


@pytest.mark.parametrize("read_handoff", [False, True])
def test_both_receive_paths_give_the_same_bits(target, read_handoff):
    lens = [3, 70, 1, 150]
    batches = [(tokens(n, 40 + i), [n]) for i, n in enumerate(lens)]
    with draftfeed.Feed(targets=[target.address], layers=[2, -1], prefetch=4) as feed:
        want = [r.hidden_bits.copy() for r in feed.map(batches)]
    with draftfeed.Feed(targets=[target.address], layers=[2, -1], prefetch=4,
                        read_handoff=read_handoff) as feed:
        got = [r.hidden_bits for r in feed.map(batches)]
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)


def test_same_input_gives_identical_states_and_packing_does_not_leak(target):
    lens = [7, 64, 1, 30]
    tok = tokens(sum(lens), 11)
    with draftfeed.Feed(targets=[target.address], layers=[1, 2, -1]) as feed:
        packed = list(feed.map([(tok, lens)]))[0].hidden_bits.copy()
        again = list(feed.map([(tok, lens)]))[0].hidden_bits
        np.testing.assert_array_equal(packed, again)
        off = 0
        for n in lens:
            alone = list(feed.map([(tok[off:off + n], [n])]))[0].hidden_bits
            np.testing.assert_array_equal(packed[off:off + n], alone)
            off += n


def test_torch_tensor_through_dlpack(target):
    torch = pytest.importorskip("torch")
    with draftfeed.Feed(targets=[target.address], layers=[0, -1]) as feed:
        r = list(feed.map([(tokens(33, 2), [33])]))[0]
        t = r.torch()
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == (33, 2, 128)
        np.testing.assert_array_equal(t.float().numpy(), r.hidden)
        # DFlash's fc input is the [T, K*H] view of the same memory
        assert tuple(t.reshape(33, -1).shape) == (33, 256)


def test_bad_batch_raises_and_feed_keeps_working(target):
    with draftfeed.Feed(targets=[target.address], layers=[-1]) as feed:
        bad = tokens(10, 1)
        bad[4] = 4096
        feed.submit(bad, [10])
        with pytest.raises(draftfeed.DraftfeedError) as e:
            feed.next()
        assert e.value.code_name == "INVALID_ARGUMENT"
        assert "4096" in str(e.value) and "vocab" in str(e.value)
        feed.submit(tokens(10, 1), [6, 5])
        with pytest.raises(draftfeed.DraftfeedError, match="11"):
            feed.next()
        good = list(feed.map([(tokens(10, 1), [10])]))
        assert good[0].num_tokens == 10


def test_wrong_fingerprint_is_refused(target):
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], expected_fingerprint="deadbeef")
    assert e.value.code_name == "FAILED_PRECONDITION"
    assert "deadbeef" in str(e.value)


def test_unknown_layer_is_refused_at_open(target):
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0, 9])
    assert e.value.code_name == "INVALID_ARGUMENT"
    assert "9" in str(e.value)


def test_transport_is_checked_before_anything_connects(target):
    with pytest.raises(ValueError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], transport="carrier-pigeon")
    assert "grpc" in str(e.value) and "nccl" in str(e.value)
    # NCCL needs the receiving GPU; without it (or without a GPU) the error says so.
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[target.address], layers=[0], transport="nccl")
    assert e.value.code_name in ("INVALID_ARGUMENT", "UNIMPLEMENTED")
    assert "cuda_device" in str(e.value) or "without NCCL" in str(e.value)


def test_grpc_results_say_they_are_in_host_memory(target):
    with draftfeed.Feed(targets=[target.address], layers=[0], transport="grpc") as feed:
        feed.submit(tokens(9, 1), [9])
        r = feed.next()
        assert r.device == -1
        assert r.__dlpack_device__() == (1, 0)
        s = feed.stats()["targets"][0]
        assert s["transport"] == "grpc" and s["transport_note"] == ""


def test_unreachable_target_errors_quickly():
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=["127.0.0.1:1"], layers=[0], connect_timeout_s=1.0)
    assert e.value.code_name in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_sigterm_finishes_accepted_batches_and_exits_zero(target):
    feed = draftfeed.Feed(targets=[target.address], layers=[0, 1, 2, 3, -1], prefetch=4,
                          unavailable_timeout_s=2.0)
    for i in range(4):
        feed.submit(tokens(512, i), [512])
    import time
    time.sleep(0.3)
    target.proc.send_signal(15)
    got = []
    for _ in range(4):
        try:
            got.append(feed.next().batch_id)
        except draftfeed.DraftfeedError as e:
            assert e.code_name == "UNAVAILABLE", e
    assert target.proc.wait(60) == 0
    # Every batch the target accepted before the signal came back whole.
    assert got == list(range(1, len(got) + 1)) and len(got) >= 1
    assert "SIGTERM received" in target.output()


def test_two_targets_share_the_work(make_target):
    a, b = make_target(), make_target()
    with draftfeed.Feed(targets=[a.address, b.address], layers=[-1], prefetch=8) as feed:
        results = list(feed.map([(tokens(50, i), [50]) for i in range(20)]))
    assert [r.batch_id for r in results] == list(range(1, 21))
    assert {r.target for r in results} == {a.address, b.address}


def test_target_with_another_model_is_refused(make_target):
    # The first target fixes the model; the other is left out and the feed runs on a.
    a, b = make_target(model="tiny-random:0"), make_target(model="tiny-random:5")
    with draftfeed.Feed(targets=[a.address, b.address], layers=[0]) as feed:
        per = {t["address"]: t for t in feed.stats()["targets"]}
        assert per[b.address]["state"] == "refused" and per[a.address]["state"] == "live"
        assert "tiny-random:5" in per[b.address]["last_error"]
        assert "tiny-random:0" in per[b.address]["last_error"]
        results = list(feed.map([(tokens(12, i), [12]) for i in range(4)]))
    assert {r.target for r in results} == {a.address}
    # Only when no target serves the model does the feed fail, naming each.
    with pytest.raises(draftfeed.DraftfeedError) as e:
        draftfeed.Feed(targets=[b.address], layers=[0],
                       expected_fingerprint=draftfeed.describe_target(a.address)["fingerprint"])
    assert e.value.code_name == "FAILED_PRECONDITION"
    assert b.address in str(e.value) and "tiny-random:5" in str(e.value)


def test_cli_help_and_bad_flags():
    out = subprocess.run([str(TARGET_BIN), "--help"], capture_output=True, text=True)
    text = out.stdout + out.stderr
    for flag in ("--model", "--listen", "--device", "--max_batch_tokens", "--chunk_bytes"):
        assert flag in text, flag
    assert "Checkpoint directory" in text
    bad = subprocess.run([str(TARGET_BIN), "--model=/nonexistent/ckpt", "--listen=127.0.0.1:0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "/nonexistent/ckpt" in bad.stderr
    bad = subprocess.run([str(TARGET_BIN), "--device=tpu:0"], capture_output=True, text=True)
    assert bad.returncode != 0 and "tpu:0" in bad.stderr


def test_synthetic_trainer_is_deterministic(target):
    cmd = [sys.executable, str(REPO / "client/python/examples/synthetic_trainer.py"),
           "--target", target.address, "--batches", "6", "--token-budget", "256",
           "--progress-every", "3"]
    runs = [subprocess.run(cmd, capture_output=True, text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
        assert "6/6 batches" in r.stdout
    checksum = [r.stdout.strip().split("checksum ")[-1] for r in runs]
    assert checksum[0] == checksum[1] and len(checksum[0]) == 16


class _OtherEncoding:
    """A compiled result whose capture is in an encoding the Python layer lacks."""
    encoding = "int4_blocked"
    device = -1
    hidden_bits = np.zeros((1, 1, 4), dtype=np.uint8)


def test_an_unknown_encoding_fails_by_name():
    r = draftfeed.Result(_OtherEncoding())
    with pytest.raises(draftfeed.DraftfeedError, match="int4_blocked") as e:
        r.hidden
    assert e.value.code_name == "UNIMPLEMENTED"
    pytest.importorskip("torch")
    with pytest.raises(draftfeed.DraftfeedError,
                       match="cannot read captures encoded as 'int4_blocked'"):
        r.torch()


def test_moe_target_streams_the_same_states_on_every_run(make_target):
    # Two target processes serving tiny-random-moe (8 experts, top 2, a shared
    # expert) give the same bits for the same packed batches: routing and the
    # experts' sums do not depend on the run, the thread count or the packing.
    lens = [[5, 60], [1, 2, 3], [200]]
    batches = [(tokens(sum(l), 70 + i), np.array(l, dtype=np.int32)) for i, l in enumerate(lens)]
    layers = [0, 3, -1]
    runs = []
    for threads in ("1", "2"):
        t = make_target(model="tiny-random-moe", extra=[f"--threads={threads}"])
        info = draftfeed.describe_target(t.address)
        assert info["model_id"] == "tiny-random-moe:0"
        assert info["architecture"] == "qwen3_5_moe"
        with draftfeed.Feed(targets=[t.address], layers=layers, prefetch=2) as feed:
            results = list(feed.map(batches))
        for (tok, _), r in zip(batches, results):
            assert r.hidden_bits.shape == (len(tok), 3, 128)
            assert np.isfinite(r.hidden).all() and r.hidden.std() > 0.01
        runs.append([r.hidden_bits.copy() for r in results])
        t.kill()
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
