"""Feed.map's and HiddenStateDataset's data path against real CPU targets: a refused batch
raises or is skipped (counted, logged) without cancelling the others, long sequences reach the
trainer whole, truncation is counted and warned, dataset indices come back with the results, and
a lost target is logged once and counted."""

import logging
import re
import time

import numpy as np
import pytest

import draftfeed
from draftfeed.packing import PackingCollator, TruncationWarning, pack_sequences, with_indices
from target_limits import OVER, refuse_over

BUDGET = 64


def seq(n, i):
    return (np.arange(n, dtype=np.int32) * 7 + 13 * i) % 4096


def pair(n, i):
    return seq(n, i), np.array([n], dtype=np.int32)


def over_budget(i):
    return pair(BUDGET + 10, i)


def bad_vocab(i):
    t, lens = pair(8, i)
    t[3] = 5000
    return t, lens


@pytest.fixture
def small_target(make_target):
    return make_target(extra=refuse_over(BUDGET))


def test_skip_counts_and_logs_each_failed_batch_and_cancels_nothing(small_target, caplog):
    items = [pair(10, 0), over_budget(1), pair(12, 2), bad_vocab(3), pair(14, 4)]
    with draftfeed.Feed(targets=[small_target.address], layers=[-1], prefetch=4) as feed:
        with caplog.at_level(logging.WARNING, logger="draftfeed"):
            results = list(feed.map(items, on_error="skip"))
        s = feed.stats()
    assert [r.num_tokens for r in results] == [10, 12, 14]
    assert [r.batch for r in results] == [items[0], items[2], items[4]]
    assert s["skipped_batches"] == 2 and s["skipped_tokens"] == BUDGET + 10 + 8
    assert s["cancelled"] == 0 and s["delivered"] == 3
    logged = [r.getMessage() for r in caplog.records if r.name == "draftfeed"]
    assert len(logged) == 2
    assert "skipped batch 2 (74 tokens in 1 sequences)" in logged[0]
    assert re.search(f"74 tokens, {OVER} 64", logged[0])
    assert "skipped batch 4" in logged[1] and "outside the vocabulary" in logged[1]


def test_raise_leaves_the_other_batches_in_flight_for_next(small_target):
    items = [pair(10, 0), over_budget(1), pair(12, 2), pair(14, 3)]
    with draftfeed.Feed(targets=[small_target.address], layers=[-1], prefetch=4) as feed:
        got = []
        with pytest.raises(draftfeed.DraftfeedError, match=f"74 tokens, {OVER} 64") as e:
            for r in feed.map(items):
                got.append(r.num_tokens)
        assert got == [10]
        assert e.value.batch_id == 2 and e.value.consumed_batch and e.value.batch is items[1]
        s = feed.stats()
        assert s["outstanding"] == 2 and s["cancelled"] == 0
        later = [feed.next(), feed.next()]
        assert [r.batch_id for r in later] == [3, 4]
        assert [r.batch for r in later] == [items[2], items[3]]  # still known by the feed
        # the next map starts clean
        assert [r.num_tokens for r in feed.map([pair(5, 9)])] == [5]


def test_max_skipped_caps_a_pass(small_target):
    items = [over_budget(i) if i % 2 else pair(9, i) for i in range(8)]
    with draftfeed.Feed(targets=[small_target.address], layers=[-1], prefetch=2) as feed:
        with pytest.raises(draftfeed.DraftfeedError,
                           match=r"3 batches failed in this pass, over max_skipped=2"):
            list(feed.map(items, on_error="skip", max_skipped=2))
        assert feed.stats()["skipped_batches"] == 2
        with pytest.raises(ValueError, match="on_error must be one of"):
            feed.map(items, on_error="ignore")


def test_feed_pack_sequences_uses_the_targets_limits(small_target):
    with draftfeed.Feed(targets=[small_target.address], layers=[-1]) as feed:
        info = feed.target_info()
        assert info["max_batch_tokens"] == BUDGET
        assert info["max_sequence_tokens"] == BUDGET  # refuse_over: no chunks
        got = list(feed.map(feed.pack_sequences([seq(30, 0), seq(40, 1), seq(20, 2)])))
        assert [r.seq_lens.tolist() for r in got] == [[30], [40, 20]]
        assert [r.indices for r in got] == [[0], [1, 2]]
        with pytest.raises(ValueError, match=r"sequence 0 holds 100 tokens, over the token "
                                             r"budget of 64 \(max_sequence_tokens=64"):
            list(feed.pack_sequences([seq(100, 0)]))


def test_long_sequences_reach_the_trainer_whole(make_target):
    target = make_target(extra=("--max_batch_tokens=512",))
    seqs = [seq(20, 0), seq(300, 1), seq(30, 2), seq(25, 3)]
    with draftfeed.Feed(targets=[target.address], layers=[0, -1]) as feed:
        # the caller's budget is 64; the target takes 512 in one batch
        results = list(feed.map(pack_sequences(seqs, token_budget=64, max_sequence_tokens=512)))
        alone = feed.submit(seqs[1], [300])
        ref = feed.next()
        assert ref.batch_id == alone
    assert [r.seq_lens.tolist() for r in results] == [[20], [300], [30, 25]]
    assert [r.indices for r in results] == [[0], [1], [2, 3]]
    np.testing.assert_array_equal(results[1].token_ids, seqs[1])
    np.testing.assert_array_equal(results[1].hidden_bits, ref.hidden_bits)


def test_dataset_gets_long_sequences_whole_and_skips_what_the_target_refuses(make_target):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from draftfeed.packing import token_budget_batches
    from draftfeed.torch import HiddenStateDataset

    target = make_target(extra=refuse_over(256))
    lengths = [20, 300, 30, 200, 25, 30]
    data = [torch.from_numpy(seq(n, i).astype(np.int64)) for i, n in enumerate(lengths)]
    groups = token_budget_batches(lengths, 64, max_sequence_tokens=1024)
    assert groups == [[0], [1], [2], [3], [4, 5]]
    loader = DataLoader(with_indices(data), batch_sampler=groups, collate_fn=PackingCollator(64))
    with draftfeed.Feed(targets=[target.address], layers=[-1], prefetch=3) as feed:
        # "auto" would give the collator the target's max_sequence_tokens (256); an explicit 1024
        # lets the 300 through to be refused by the target and skipped
        ds = HiddenStateDataset(loader, feed, on_error="skip", max_sequence_tokens=1024)
        assert loader.collate_fn.max_sequence_tokens == 1024
        out = list(ds)
        stats = ds.stats()
        fs = feed.stats()
    assert [b["indices"] for b in out] == [[0], [2], [3], [4, 5]]
    assert [tuple(b["hidden"].shape) for b in out] == [(20, 1, 128), (30, 1, 128),
                                                      (200, 1, 128), (55, 1, 128)]
    assert stats["skipped_batches"] == 1 and stats["skipped_tokens"] == 300
    assert stats["batches"] == 4 and stats["batches_done"] == 5
    assert stats["long_sequences"] == 2 and stats["truncated_sequences"] == 0
    assert fs["skipped_batches"] == 1 and fs["long_sequences"] == 2

    loader2 = DataLoader(data, batch_sampler=groups, collate_fn=PackingCollator(64))
    with draftfeed.Feed(targets=[target.address], layers=[-1]) as feed:
        assert feed.target_info()["max_sequence_tokens"] == 256
        ds = HiddenStateDataset(loader2, feed)
        assert loader2.collate_fn.max_sequence_tokens == 256  # auto: the target's
        # the collator refuses the 300, naming both numbers, before anything is lost
        with pytest.raises(ValueError, match=r"300 tokens, over max_sequence_tokens=256 "
                                             r"\(the token budget is 64\)"):
            list(ds)
        assert feed.stats()["outstanding"] == 0


def test_collator_truncation_is_counted_in_feed_stats_and_warned_once_per_pass(small_target):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    lengths = [20, 100, 30, 90, 10]
    data = [torch.from_numpy(seq(n, i).astype(np.int64)) for i, n in enumerate(lengths)]
    loader = DataLoader(data, batch_sampler=[[0], [1], [2], [3], [4]],
                        collate_fn=PackingCollator(BUDGET))
    with draftfeed.Feed(targets=[small_target.address], layers=[-1]) as feed:
        for _ in range(2):
            with pytest.warns(TruncationWarning) as caught:
                got = [r.num_tokens for r in feed.map(loader)]
            assert got == [20, 64, 30, 64, 10]
            caught = [w for w in caught if w.category is TruncationWarning]
            assert len(caught) == 1
            assert "packing truncated 2 of 5 sequences" in str(caught[0].message)
            assert "cutting off 62 tokens" in str(caught[0].message)
        s = feed.stats()
    assert s["truncated_sequences"] == 4 and s["truncated_tokens"] == 124
    assert s["skipped_batches"] == 0


def test_a_lost_target_is_logged_once_and_counted(make_target, caplog):
    a, b = make_target(), make_target()
    with draftfeed.Feed(targets=[a.address, b.address], layers=[-1], prefetch=4,
                        reconnect_backoff_min_s=5, reconnect_backoff_max_s=5) as feed:
        list(feed.map([pair(30, i) for i in range(8)]))
        assert feed.stats()["target_failures"] == 0
        with caplog.at_level(logging.WARNING, logger="draftfeed"):
            b.kill()
            deadline = time.time() + 30
            while feed.stats()["target_failures"] == 0 and time.time() < deadline:
                time.sleep(0.05)
            results = list(feed.map([pair(30, i) for i in range(8, 24)]))
            s = feed.stats()
    assert [r.batch_id for r in results] == list(range(9, 25))  # nothing lost
    per = {t["address"]: t for t in s["targets"]}
    assert per[b.address]["failures"] >= 1
    assert s["target_failures"] == per[b.address]["failures"] + per[a.address]["failures"]
    lost = [r.getMessage() for r in caplog.records
            if r.name == "draftfeed" and "lost" in r.getMessage()]
    # one line per event (the backoff keeps a second one out of this run), none repeated
    assert len(lost) == s["failover_warnings"] == per[b.address]["failures"]
    assert f"target {b.address} lost 1 stream" in lost[0]
    assert "re-sent to other targets" in lost[0]
