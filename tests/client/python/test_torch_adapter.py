"""draftfeed.torch.HiddenStateDataset over DataLoaders, against a real target process."""

import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader  # noqa: E402

import draftfeed  # noqa: E402
from conftest import REPO  # noqa: E402
from draftfeed.packing import PackedBatch, PackingCollator, token_budget_batches  # noqa: E402
from draftfeed.torch import HiddenStateDataset  # noqa: E402

LAYERS = [0, 2, -1]
BUDGET = 256


def sequences(n, seed, vocab=4096, max_len=120):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, max_len)), dtype=np.int64).tolist()
            for _ in range(n)]


def packed_loader(seqs, **kw):
    return DataLoader(seqs, batch_sampler=token_budget_batches([len(s) for s in seqs], BUDGET),
                      collate_fn=PackingCollator(BUDGET), **kw)


def reference(feed, batches):
    """What Feed.map gives for the same (token_ids, seq_lens): bf16 bits as int16 tensors."""
    return [torch.from_numpy(r.hidden_bits.view(np.int16).copy())
            for r in feed.map([(np.asarray(t), np.asarray(s)) for t, s in batches])]


def assert_bits_equal(hidden, ref_bits):
    assert hidden.dtype == torch.bfloat16
    assert torch.equal(hidden.contiguous().view(torch.int16), ref_bits)


def test_collated_loader_gives_exactly_what_feed_map_gives(target):
    seqs = sequences(60, seed=1)
    loader = packed_loader(seqs)
    with draftfeed.Feed(targets=[target.address], layers=LAYERS, prefetch=4) as feed:
        ds = HiddenStateDataset(loader, feed)
        assert len(ds) == len(loader) > 5
        out = list(ds)
        packed = list(loader)
        ref = reference(feed, packed)
    assert len(out) == len(packed) == len(ref)
    ids = [b["batch_id"] for b in out]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    for b, p, bits in zip(out, packed, ref):
        T = p.num_tokens
        assert T <= BUDGET
        assert tuple(b["hidden"].shape) == (T, len(LAYERS), 128)
        assert b["hidden"].device.type == "cpu"
        assert_bits_equal(b["hidden"], bits)
        # token ids and boundaries pass through, in the loader's order
        assert b["token_ids"].dtype == torch.int32
        np.testing.assert_array_equal(b["token_ids"].numpy(), p.token_ids)
        np.testing.assert_array_equal(b["seq_lens"].numpy(), p.seq_lens)
        np.testing.assert_array_equal(b["position_ids"].numpy(), p.position_ids)
        np.testing.assert_array_equal(b["cu_seqlens"].numpy(), p.cu_seqlens)
        assert b["index"] == list(range(p.num_sequences))  # positions in the collated list
    np.testing.assert_array_equal(torch.cat([b["token_ids"] for b in out]).numpy(),
                                  np.concatenate([np.asarray(s) for s in seqs]))


def test_tensor_dataset_with_workers_and_a_second_epoch(target):
    seqs = [torch.tensor(s) for s in sequences(40, seed=2)]  # int64 tensors
    loader = packed_loader(seqs, num_workers=2)
    with draftfeed.Feed(targets=[target.address], layers=LAYERS, prefetch=3) as feed:
        ds = HiddenStateDataset(loader, feed, layers_view="t(kh)")
        epochs = [list(ds), list(ds)]
        ref = reference(feed, list(packed_loader(seqs)))
    for out in epochs:
        assert len(out) == len(ref)
        for b, bits in zip(out, ref):
            T = b["token_ids"].shape[0]
            assert tuple(b["hidden"].shape) == (T, len(LAYERS) * 128)  # DFlash's fc input
            assert_bits_equal(b["hidden"], bits.reshape(T, -1))
    assert epochs[0][-1]["batch_id"] < epochs[1][0]["batch_id"]


def test_dict_batches_pass_through_untouched(target):
    seqs = sequences(30, seed=3)
    groups = token_budget_batches([len(s) for s in seqs], BUDGET)

    def collate(items):  # a trainer's own collator: torch tensors, cu_seqlens, extra keys
        ids = torch.cat([torch.tensor(s) for s in items])
        cu = torch.tensor([0] + np.cumsum([len(s) for s in items]).tolist(), dtype=torch.int32)
        return {"input_ids": ids, "cu_seqlens": cu, "loss_mask": torch.ones_like(ids),
                "note": "kept"}

    loader = DataLoader(seqs, batch_sampler=groups, collate_fn=collate)
    with draftfeed.Feed(targets=[target.address], layers=LAYERS, prefetch=4) as feed:
        out = list(HiddenStateDataset(loader, feed))
        ref = reference(feed, [(b["input_ids"], np.diff(b["cu_seqlens"].numpy())) for b in loader])
    assert len(out) == len(groups)
    for b, bits, g in zip(out, ref, groups):
        assert set(b) == {"input_ids", "cu_seqlens", "loss_mask", "note", "hidden", "batch_id"}
        assert b["input_ids"].dtype == torch.int64 and b["note"] == "kept"
        np.testing.assert_array_equal(b["input_ids"].numpy(),
                                      np.concatenate([np.asarray(seqs[i]) for i in g]))
        assert_bits_equal(b["hidden"], bits)


def test_pairs_position_ids_and_empty_batches(target):
    seqs = sequences(12, seed=4)
    lens = [len(s) for s in seqs[:3]], [len(s) for s in seqs[3:7]]
    tok = [np.concatenate(seqs[:3]).astype(np.int32), np.concatenate(seqs[3:7]).astype(np.int32)]
    empty = PackingCollator()([[]])
    assert empty.num_tokens == 0
    pos = torch.cat([torch.arange(n) for n in lens[1]])[None]  # [1, T], as HF's flattening gives
    items = [(tok[0], lens[0]), empty,
             {"input_ids": torch.from_numpy(tok[1])[None], "position_ids": pos}]
    with draftfeed.Feed(targets=[target.address], layers=LAYERS) as feed:
        out = list(HiddenStateDataset(items, feed))
        ref = reference(feed, [(tok[0], lens[0]), (tok[1], lens[1])])
    assert len(out) == 2  # the empty batch is skipped
    assert set(out[0]) == {"token_ids", "seq_lens", "hidden", "batch_id"}
    assert out[0]["seq_lens"].tolist() == lens[0]
    assert out[1]["position_ids"] is pos
    for b, bits in zip(out, ref):
        assert_bits_equal(b["hidden"], bits)


def test_leaving_early_leaves_the_feed_clean(target):
    seqs = sequences(50, seed=5)
    loader = packed_loader(seqs)
    with draftfeed.Feed(targets=[target.address], layers=LAYERS, prefetch=4) as feed:
        ds = HiddenStateDataset(loader, feed)
        for i, _ in enumerate(ds):
            if i == 1:
                break
        assert feed.stats()["outstanding"] == 0
        out = list(ds)
        ref = reference(feed, list(loader))
    assert len(out) == len(ref)
    for b, bits in zip(out, ref):
        assert_bits_equal(b["hidden"], bits)


def test_bad_batch_raises_and_a_shared_feed_is_caught(target):
    good = (np.arange(10, dtype=np.int32), [10])
    bad = (np.array([1, 2, 4096], dtype=np.int32), [3])  # outside the 4096-token vocabulary
    with draftfeed.Feed(targets=[target.address], layers=LAYERS, prefetch=2) as feed:
        with pytest.raises(draftfeed.DraftfeedError) as e:
            list(HiddenStateDataset([good, bad, good, good], feed))
        assert e.value.code_name == "INVALID_ARGUMENT" and "4096" in str(e.value)
        assert feed.stats()["outstanding"] == 0
        # someone else's batch in flight on the same feed is never mistaken for ours
        feed.submit(np.arange(7, dtype=np.int32), [7])
        with pytest.raises(RuntimeError, match="in flight"):
            list(HiddenStateDataset([good], feed))
        assert feed.stats()["outstanding"] == 0
        assert len(list(HiddenStateDataset([good], feed))) == 1


def test_argument_errors(target):
    with draftfeed.Feed(targets=[target.address], layers=[-1]) as feed:
        with pytest.raises(ValueError, match="layers_view"):
            HiddenStateDataset([], feed, layers_view="kth")
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="no CUDA"):
                HiddenStateDataset([], feed, device="cuda:0")
        with pytest.raises(TypeError, match="PackedBatch"):
            list(HiddenStateDataset([np.arange(4)], feed))
        with pytest.raises(KeyError, match="seq_lens"):
            list(HiddenStateDataset([{"input_ids": [1, 2]}], feed))
        with pytest.raises(ValueError, match="1-D"):
            list(HiddenStateDataset([(np.ones((2, 3), dtype=np.int32), [3, 3])], feed))
        with pytest.raises(TypeError):
            len(HiddenStateDataset(iter([]), feed))
        assert feed.stats()["outstanding"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_gets_a_bit_exact_copy(target):
    seqs = sequences(20, seed=6)
    with draftfeed.Feed(targets=[target.address], layers=LAYERS) as feed:
        out = list(HiddenStateDataset(packed_loader(seqs), feed, device="cuda:0"))
        ref = reference(feed, list(packed_loader(seqs)))
    torch.cuda.synchronize()
    for b, bits in zip(out, ref):
        assert b["hidden"].device == torch.device("cuda:0")
        assert_bits_equal(b["hidden"].cpu(), bits)


def test_unordered_feed_over_two_targets_pairs_every_batch(make_target):
    from draftfeed.packing import pack_sequences

    a, b = make_target(), make_target()
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, 4096, size=int(n)).tolist() for n in rng.integers(1, 250, size=60)]
    packed = list(pack_sequences(seqs, BUDGET))  # index: positions in seqs, unique per batch
    try:
        feed = draftfeed.Feed(targets=[a.address, b.address], layers=LAYERS, prefetch=8,
                              ordered=False)
    except TypeError:
        pytest.skip("this Feed has no ordered=False")
    with feed:
        out = list(HiddenStateDataset(packed, feed))
    with draftfeed.Feed(targets=[a.address], layers=LAYERS) as ordered_feed:
        ref = reference(ordered_feed, packed)
    want = {tuple(p.index): bits for p, bits in zip(packed, ref)}
    assert sorted(tuple(b["index"]) for b in out) == sorted(want)
    for b in out:
        by_index = np.concatenate([np.asarray(seqs[i]) for i in b["index"]])
        np.testing.assert_array_equal(b["token_ids"].numpy(), by_index)
        assert_bits_equal(b["hidden"], want[tuple(b["index"])])


def test_train_drafter_example_learns(target):
    cmd = [sys.executable, str(REPO / "client/python/examples/train_drafter.py"),
           "--target", target.address, "--steps", "12", "--log-every", "6", "--device", "cpu"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", run.stdout)]
    assert len(losses) == 3, run.stdout  # steps 1, 6, 12
    assert losses[-1] < losses[0] - 0.5, run.stdout
    assert "done: 12 steps" in run.stdout and "failed 0" in run.stdout
