"""draftfeed.sampler.DistributedTokenBudgetSampler: disjoint equal shares per rank, a seeded
order per epoch, and a mid-epoch resume that repeats and skips nothing."""

import numpy as np
import pytest

from draftfeed.sampler import DistributedTokenBudgetSampler

BUDGET = 64


def lengths_of(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(1, 50, size=n).tolist()


def flat(batches):
    return [i for b in batches for i in b]


def test_ranks_are_disjoint_equal_and_cover_the_epoch_with_drop_last():
    lengths = lengths_of(500)
    world = 3
    ranks = [list(DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=world, rank=r,
                                                seed=7, drop_last=True)) for r in range(world)]
    assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) > 10  # DDP steps together
    seen = [set(flat(r)) for r in ranks]
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    # what is left out is the last few batches of the epoch's list, no more than world - 1
    one = DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=1, rank=0, seed=7)
    everything = list(one)
    dropped = len(everything) - world * len(ranks[0])
    assert 0 <= dropped < world
    assert set().union(*seen) == set(flat(everything[:len(everything) - dropped]))
    for b in flat(ranks):
        assert sum(lengths[i] for i in b) <= BUDGET


def test_padding_repeats_the_first_batches_as_distributed_sampler_does():
    lengths = [10] * 35  # 6 per batch of 64: 6 batches, 5 full and one of 5 items
    s = [DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=4, rank=r, shuffle=False)
         for r in range(4)]
    got = [list(x) for x in s]
    assert [len(g) for g in got] == [2, 2, 2, 2]  # 6 batches padded to 8
    everything = list(DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=1, rank=0,
                                                    shuffle=False))
    assert len(everything) == 6
    # rank r takes r, r+4 of [b0..b5, b0, b1]
    assert got[2] == [everything[2], everything[0]] and got[3] == [everything[3], everything[1]]
    assert sorted(flat(flat(got))) == sorted(flat(everything) + flat(everything[:2]))


def test_each_epoch_is_a_new_seeded_order_the_same_on_every_rank():
    lengths = lengths_of(300, seed=1)
    a = DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=2, rank=0, seed=3)
    b = DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=2, rank=0, seed=3)
    e0 = list(a)
    assert list(a) == e0  # no set_epoch: the same epoch again
    a.set_epoch(1)
    e1 = list(a)
    assert e1 != e0 and sorted(flat(e1)) != [] and len(flat(e1)) > 100
    b.set_epoch(1)
    assert list(b) == e1
    unshuffled = DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=1, rank=0,
                                               shuffle=False)
    assert flat(list(unshuffled)) == list(range(300))


@pytest.mark.parametrize("stop", [0, 1, 7, 19])
def test_resume_mid_epoch_repeats_and_skips_nothing(stop):
    lengths = lengths_of(400, seed=2)
    kw = dict(num_replicas=2, seed=11)
    for rank in (0, 1):
        whole = DistributedTokenBudgetSampler(lengths, BUDGET, rank=rank, **kw)
        whole.set_epoch(4)
        uninterrupted = list(whole)
        first = DistributedTokenBudgetSampler(lengths, BUDGET, rank=rank, **kw)
        first.set_epoch(4)
        done = []
        for step, batch in enumerate(first):
            if step == stop:
                break
            done.append(batch)
        state = first.state_dict(consumed=stop)
        fresh = DistributedTokenBudgetSampler(lengths, BUDGET, rank=rank, **kw)
        fresh.load_state_dict(state)
        fresh.set_epoch(4)  # a training loop sets it again on resuming: the position stays
        assert len(fresh) == len(uninterrupted) - stop
        rest = list(fresh)
        assert done + rest == uninterrupted
        # a second resume inside the resumed epoch counts from where it resumed
        again = DistributedTokenBudgetSampler(lengths, BUDGET, rank=rank, **kw)
        again.load_state_dict(fresh.state_dict(consumed=2) if rest else fresh.state_dict())
        assert done + rest[:2] + list(again) == uninterrupted
        fresh.set_epoch(5)  # the next epoch is whole again
        assert len(flat(list(fresh))) > 100


def test_a_state_of_another_sampler_is_refused_by_name():
    lengths = lengths_of(100)
    s = DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=2, rank=0, seed=1)
    state = s.state_dict()
    other = DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=4, rank=0, seed=1)
    with pytest.raises(ValueError, match="num_replicas: saved 2, here 4"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="num_items: saved 100, here 99"):
        DistributedTokenBudgetSampler(lengths[:99], BUDGET, num_replicas=2, rank=0,
                                      seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="rank 2 of num_replicas 2"):
        DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="consumed=999"):
        s.state_dict(consumed=999)


def test_with_torch_dataloader_workers_and_resume():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from draftfeed.packing import PackingCollator, with_indices

    lengths = lengths_of(200, seed=5)
    data = [torch.arange(n) + 1000 * i for i, n in enumerate(lengths)]
    sampler = DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=2, rank=1, seed=9)
    loader = DataLoader(with_indices(data), batch_sampler=sampler,
                        collate_fn=PackingCollator(BUDGET), num_workers=2)
    assert len(loader) == len(sampler)
    epoch = list(loader)
    assert [b.indices for b in epoch] == list(sampler)
    for b in epoch:
        np.testing.assert_array_equal(b.token_ids,
                                      torch.cat([data[i] for i in b.indices]).numpy())
    # stop after 5 batches; the workers drew more from the sampler than that
    it = iter(loader)
    done = [next(it).indices for _ in range(5)]
    state = sampler.state_dict(consumed=5)
    del it
    resumed = DistributedTokenBudgetSampler(lengths, BUDGET, num_replicas=2, rank=1, seed=9)
    resumed.load_state_dict(state)
    loader2 = DataLoader(with_indices(data), batch_sampler=resumed,
                         collate_fn=PackingCollator(BUDGET), num_workers=2)
    assert done + [b.indices for b in loader2] == [b.indices for b in epoch]
