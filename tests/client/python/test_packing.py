"""draftfeed.packing: budgets, order, boundaries, positions, truncation and dropping."""

import pickle

import numpy as np
import pytest

from draftfeed.packing import (PackedBatch, PackingCollator, pack, pack_sequences,
                               token_budget_batches)


def seqs_of(lengths, start=0):
    """Sequence i holds distinct, recognisable ids: 1000*i + 0, 1, 2, ..."""
    return [list(range(1000 * (start + i), 1000 * (start + i) + n)) for i, n in enumerate(lengths)]


def test_next_fit_in_order_with_exact_batches():
    lengths = [3, 4, 2, 5, 1, 6, 6]
    batches = list(pack_sequences(seqs_of(lengths), token_budget=8))
    # 3+4 (+2 would be 9) | 2+5+1 = 8 exactly full | 6 | 6
    assert [b.seq_lens.tolist() for b in batches] == [[3, 4], [2, 5, 1], [6], [6]]
    assert [b.index for b in batches] == [[0, 1], [2, 3, 4], [5], [6]]
    for b in batches:
        assert isinstance(b, PackedBatch)
        assert b.token_ids.dtype == np.int32 and b.seq_lens.dtype == np.int32
        assert b.position_ids.dtype == np.int32
        assert b.num_tokens == int(b.seq_lens.sum()) == b.token_ids.shape[0] <= 8
        assert b.num_sequences == len(b.index)
    # every token, in the original order, exactly once
    flat = np.concatenate([b.token_ids for b in batches])
    np.testing.assert_array_equal(flat, np.concatenate([np.asarray(s) for s in seqs_of(lengths)]))


def test_position_ids_restart_and_cu_seqlens():
    b = next(pack_sequences(seqs_of([3, 1, 4]), token_budget=100))
    assert b.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert b.cu_seqlens.tolist() == [0, 3, 4, 8] and b.cu_seqlens.dtype == np.int32
    assert b.token_ids.tolist() == [0, 1, 2, 1000, 2000, 2001, 2002, 2003]


def test_budget_is_never_exceeded_on_random_lengths():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 300, size=500).tolist()
    batches = list(pack_sequences(seqs_of(lengths), token_budget=512))
    assert all(b.num_tokens <= 512 for b in batches)
    assert [i for b in batches for i in b.index] == list(range(500))
    assert sum(b.num_tokens for b in batches) == sum(lengths)
    # next-fit: a batch was closed only because the next sequence did not fit
    for b, nxt in zip(batches, batches[1:]):
        assert b.num_tokens + nxt.seq_lens[0] > 512


def test_max_batch_size():
    batches = list(pack_sequences(seqs_of([1] * 10), token_budget=100, max_batch_size=4))
    assert [b.seq_lens.tolist() for b in batches] == [[1] * 4, [1] * 4, [1] * 2]
    assert [b.index for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="max_batch_size"):
        list(pack_sequences(seqs_of([1]), token_budget=4, max_batch_size=0))


def test_longer_than_budget_is_truncated_by_default():
    seqs = seqs_of([2, 10, 3])
    batches = list(pack_sequences(seqs, token_budget=6))
    assert [b.seq_lens.tolist() for b in batches] == [[2], [6], [3]]
    assert [b.index for b in batches] == [[0], [1], [2]]
    # the prefix is kept
    assert batches[1].token_ids.tolist() == list(range(1000, 1006))
    assert batches[1].position_ids.tolist() == list(range(6))


def test_longer_than_budget_is_dropped_with_drop_longer():
    batches = list(pack_sequences(seqs_of([2, 10, 3, 6, 7]), token_budget=6, drop_longer=True))
    assert [b.seq_lens.tolist() for b in batches] == [[2, 3], [6]]
    assert [b.index for b in batches] == [[0, 2], [3]]
    assert batches[0].token_ids.tolist() == [0, 1, 2000, 2001, 2002]


def test_empty_sequences_are_skipped_and_inputs_of_many_kinds():
    try:
        import torch
        seven = torch.tensor([7, 8, 9])
    except ImportError:  # packing itself needs no torch
        seven = np.array([7, 8, 9], dtype=np.uint16)
    seqs = [[], np.array([5, 6], dtype=np.int64), seven,
            {"input_ids": [1, 2], "loss_mask": [0, 1], "source": "chat"}, (3,)]
    (b,) = list(pack_sequences(seqs, token_budget=64))
    assert b.index == [1, 2, 3, 4]
    assert b.token_ids.tolist() == [5, 6, 7, 8, 9, 1, 2, 3]
    assert b.seq_lens.tolist() == [2, 3, 2, 1]
    # extras are kept only when every sequence in the batch has them
    assert b.extras == {}
    with pytest.raises(TypeError, match="integers"):
        list(pack_sequences([[1.5, 2.0]], token_budget=8))
    with pytest.raises(ValueError, match="1-D"):
        list(pack_sequences([np.zeros((2, 3), dtype=np.int32)], token_budget=8))
    with pytest.raises(ValueError, match="token_budget"):
        list(pack_sequences([[1]], token_budget=0))


def test_per_token_extras_are_packed_and_truncated():
    items = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "id": 7},
             {"input_ids": [4, 5], "loss_mask": [1, 1]},
             {"input_ids": list(range(10, 19)), "loss_mask": [0] * 4 + [1] * 5}]
    first, second = list(pack_sequences(items, token_budget=7))
    assert first.token_ids.tolist() == [1, 2, 3, 4, 5] and first.seq_lens.tolist() == [3, 2]
    assert list(first.extras) == ["loss_mask"]  # "id" is not per token
    assert first.extras["loss_mask"].tolist() == [0, 1, 1, 1, 1]
    assert second.token_ids.tolist() == list(range(10, 17))
    assert second.extras["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1, 1]


def test_packed_batch_unpacks_as_token_ids_and_seq_lens():
    b = next(pack_sequences(seqs_of([2, 3]), token_budget=16))
    token_ids, seq_lens = b
    assert token_ids is b.token_ids and seq_lens is b.seq_lens


def test_is_lazy_on_an_endless_stream():
    pulled = []

    def endless():
        i = 0
        while True:
            pulled.append(i)
            yield [i] * (1 + i % 5)  # lengths 1, 2, 3, 4, 5, 1, 2, ...
            i += 1

    gen = pack_sequences(endless(), token_budget=10)
    assert next(gen).index == [0, 1, 2, 3]  # 1+2+3+4 = 10: yielded as soon as it is full
    assert pulled == [0, 1, 2, 3]
    assert [next(gen).index for _ in range(2)] == [[4, 5, 6], [7, 8]]


def test_token_budget_batches_matches_pack_sequences():
    rng = np.random.default_rng(9)
    lengths = rng.integers(0, 90, size=200).tolist()
    lengths[17] = 500  # over the budget
    for drop in (False, True):
        groups = token_budget_batches(lengths, 128, max_batch_size=6, drop_longer=drop)
        packed = list(pack_sequences(seqs_of(lengths), 128, max_batch_size=6, drop_longer=drop))
        assert groups == [b.index for b in packed]
        assert (17 in sum(groups, [])) != drop
        assert 0 not in [lengths[i] for g in groups for i in g]


def test_token_budget_batches_with_indices_shuffles_and_shards():
    lengths = [4, 4, 4, 4, 4, 4]
    order = [5, 3, 1, 0, 2, 4]
    assert token_budget_batches(lengths, 8, indices=order) == [[5, 3], [1, 0], [2, 4]]
    batches = token_budget_batches(lengths, 8)
    assert batches[0::2] == [[0, 1], [4, 5]] and batches[1::2] == [[2, 3]]


def test_collator_packs_one_batch_and_refuses_over_budget():
    collate = pickle.loads(pickle.dumps(PackingCollator(token_budget=8)))  # workers pickle it
    b = collate(seqs_of([0, 20]))
    assert b.seq_lens.tolist() == [8] and b.index == [1]  # truncated to the budget, 0 skipped
    b = collate(seqs_of([3, 0, 4]))
    assert b.seq_lens.tolist() == [3, 4] and b.index == [0, 2]
    assert b.token_ids.tolist() == [0, 1, 2, 2000, 2001, 2002, 2003]
    with pytest.raises(ValueError, match="12 tokens, over the token budget of 8"):
        collate(seqs_of([3, 9, 1]))  # 3 + 8 (truncated) + 1
    b = PackingCollator(token_budget=8, drop_longer=True)(seqs_of([3, 20, 0, 1]))
    assert b.seq_lens.tolist() == [3, 1] and b.index == [0, 3]
    b = PackingCollator()(seqs_of([300, 200]))  # no budget: plain concatenation
    assert b.seq_lens.tolist() == [300, 200] and b.position_ids[300] == 0
    empty = PackingCollator(8, drop_longer=True)(seqs_of([9]))
    assert empty.num_tokens == 0 and empty.num_sequences == 0


def test_dataloader_with_budget_batch_sampler():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    lengths = [5, 9, 2, 7, 7, 1, 3, 8]
    data = [torch.arange(1000 * i, 1000 * i + n) for i, n in enumerate(lengths)]
    sampler = token_budget_batches(lengths, token_budget=12)
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=PackingCollator(12))
    got = list(loader)
    assert [b.seq_lens.tolist() for b in got] == [[5], [9, 2], [7], [7, 1, 3], [8]]
    assert all(b.num_tokens <= 12 for b in got)
    flat = np.concatenate([b.token_ids for b in got])
    np.testing.assert_array_equal(flat, torch.cat(data).numpy())
