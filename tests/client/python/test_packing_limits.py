"""draftfeed.packing never cuts or leaves out a sequence silently: truncations are counted and
warned once a pass, long sequences go whole under max_sequence_tokens, dataset indices are
carried."""

import pickle
import warnings

import numpy as np
import pytest

from draftfeed.packing import (Indexed, PackingCollator, PackingStats, TruncationWarning, pack,
                               pack_sequences, token_budget_batches, with_indices)


def seqs_of(lengths):
    """Sequence i holds 1000*i + 0, 1, 2, ...: every token says where it came from."""
    return [list(range(1000 * i, 1000 * i + n)) for i, n in enumerate(lengths)]


def test_truncation_is_counted_and_warned_once_per_pass_with_the_numbers():
    lengths = [3, 20, 4, 9, 30]  # 20, 9 and 30 exceed the budget of 8
    with pytest.warns(TruncationWarning) as caught:
        packing = pack_sequences(seqs_of(lengths), token_budget=8)
        batches = list(packing)
    assert len(caught) == 1
    text = str(caught[0].message)
    # 3 of 5 sequences cut to 8, losing 12 + 1 + 22 = 35 of their 59 tokens
    assert "truncated 3 of 5 sequences to 8 tokens" in text and "35 of the 59 tokens" in text
    assert "max_sequence_tokens" in text and "drop_longer" in text  # how to avoid it
    s = packing.stats
    assert (s.truncated_sequences, s.truncated_tokens, s.sequences) == (3, 35, 5)
    assert s.tokens == sum(b.num_tokens for b in batches) == 3 + 8 + 4 + 8 + 8
    # every batch carries its own share
    per_batch = PackingStats()
    for b in batches:
        per_batch.add(b.packing_stats)
    assert per_batch == s
    assert all(b.packer_warns for b in batches)


def test_a_pass_without_truncation_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(pack_sequences(seqs_of([3, 5, 8]), token_budget=8))) == 2


def test_long_sequences_go_whole_in_a_batch_of_their_own():
    lengths = [3, 20, 4, 5, 12, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is truncated, so nothing warns
        packing = pack_sequences(seqs_of(lengths), token_budget=8, max_sequence_tokens=24)
        batches = list(packing)
    # next-fit with the long ones alone: 3 | 20 | 4 (+5 > 8) | 5 | 12 | 2
    assert [b.seq_lens.tolist() for b in batches] == [[3], [20], [4], [5], [12], [2]]
    assert batches[1].token_ids.tolist() == list(range(1000, 1020))  # whole, in order
    assert batches[1].position_ids.tolist() == list(range(20))
    assert packing.stats.long_sequences == 2 and packing.stats.truncated_sequences == 0
    assert sum(b.num_tokens for b in batches) == sum(lengths)


def test_over_max_sequence_tokens_is_an_error_naming_both_numbers_or_as_asked():
    seqs = seqs_of([3, 40, 5])
    with pytest.raises(ValueError, match=r"sequence 1 holds 40 tokens, over "
                                         r"max_sequence_tokens=24 \(the token budget is 8\)"):
        list(pack_sequences(seqs, token_budget=8, max_sequence_tokens=24))
    # truncate=True: its first 24 tokens, counted and warned
    with pytest.warns(TruncationWarning, match="truncated 1 of 3 sequences to 24 tokens"):
        got = list(pack_sequences(seqs, token_budget=8, max_sequence_tokens=24, truncate=True))
    assert [b.seq_lens.tolist() for b in got] == [[3], [24], [5]]
    assert got[1].packing_stats.truncated_tokens == 16
    # drop_longer: left out, counted
    p = pack_sequences(seqs, token_budget=8, max_sequence_tokens=24, drop_longer=True)
    assert [b.index for b in p] == [[0, 2]]
    assert (p.stats.dropped_sequences, p.stats.dropped_tokens) == (1, 40)
    # without max_sequence_tokens, truncate=False refuses what would be truncated
    with pytest.raises(ValueError, match="40 tokens, over the token budget of 8"):
        list(pack_sequences(seqs, token_budget=8, truncate=False))


def test_token_budget_batches_and_the_collator_agree_on_long_sequences():
    lengths = [3, 20, 4, 5, 12, 2, 40]
    seqs = seqs_of(lengths)
    stats = PackingStats()
    groups = token_budget_batches(lengths, 8, max_sequence_tokens=24, drop_longer=True,
                                  stats=stats)
    assert groups == [[0], [1], [2], [3], [4], [5]]
    assert (stats.long_sequences, stats.dropped_sequences, stats.dropped_tokens) == (2, 1, 40)
    collate = pickle.loads(pickle.dumps(PackingCollator(8, max_sequence_tokens=24)))
    packed = [collate([seqs[i] for i in g]) for g in groups]
    assert [b.num_tokens for b in packed] == [3, 20, 4, 5, 12, 2]
    assert collate.stats.long_sequences == 2
    # a long sequence is whole only alone: with company the budget holds
    with pytest.raises(ValueError, match="over the token budget of 8"):
        collate([seqs[0], seqs[1]])
    with pytest.raises(ValueError, match="over max_sequence_tokens=24"):
        token_budget_batches(lengths, 8, max_sequence_tokens=24)
    with pytest.raises(ValueError, match="dataset index 6"):
        collate([Indexed(6, seqs[6])])


def test_collator_counts_truncation_per_batch():
    b = PackingCollator(8)(seqs_of([0, 20]))
    assert b.seq_lens.tolist() == [8]
    s = b.packing_stats
    assert (s.truncated_sequences, s.truncated_tokens, s.empty_sequences) == (1, 12, 1)
    assert not b.packer_warns  # the collator leaves the warning to Feed.map / the dataset
    b = pack(seqs_of([30]), token_budget=8, drop_longer=True)
    assert b.num_tokens == 0 and b.packing_stats.dropped_tokens == 30


def test_indices_are_dataset_indices_not_positions():
    data = seqs_of([3, 4, 2, 5, 1, 6])
    indexed = with_indices(data)
    assert len(indexed) == 6 and indexed[4] == Indexed(4, data[4])
    # a shuffled batch sampler hands the collator dataset items 5, 3, 0
    b = PackingCollator(16)([indexed[i] for i in (5, 3, 0)])
    assert b.index == [0, 1, 2]                # positions in the collated list, as before
    assert b.indices == [5, 3, 0]              # what a trainer joins its records on
    assert b.token_ids[:6].tolist() == data[5]
    assert PackingCollator(16)([data[1], data[2]]).indices is None  # not told
    # pack_sequences: the stream position, or the indices given, or Indexed items
    order = [4, 1, 5, 0]
    got = list(pack_sequences([data[i] for i in order], token_budget=8, indices=order))
    assert [b.indices for b in got] == [[4, 1], [5], [0]]
    assert [b.index for b in got] == [[0, 1], [2], [3]]
    got = list(pack_sequences([Indexed(i, data[i]) for i in order], token_budget=8))
    assert [b.indices for b in got] == [[4, 1], [5], [0]]
    assert [b.indices for b in pack_sequences(data, token_budget=8)] == \
        [b.index for b in pack_sequences(data, token_budget=8)]
