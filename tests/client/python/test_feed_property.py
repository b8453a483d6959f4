"""Random call sequences (submit / next / map / cancel / close, seeded) against a real CPU
target, checked against a model of the feed: no result is lost or duplicated, every batch ends
exactly once (a result, its error, cancelled, or dropped by close), the outstanding count always
matches, and every error is a DraftfeedError with a message that says what happened."""

import random

import numpy as np
import pytest

import draftfeed
from target_limits import refuse_over

BUDGET = 64  # the target's --max_batch_tokens: a batch over it is refused
VOCAB = 4096  # tiny-random's vocabulary: an id at or over it is refused
PREFETCH = 4


def make_batch(rng: random.Random, bad: bool):
    """(token_ids, seq_lens); a bad batch is one the target refuses, for one of two reasons."""
    if bad and rng.random() < 0.5:
        n = BUDGET + rng.randint(1, 20)
        return np.arange(n, dtype=np.int32) % VOCAB, np.array([n], dtype=np.int32)
    lens = [rng.randint(1, 12) for _ in range(rng.randint(1, 4))]
    tokens = np.array([rng.randrange(VOCAB) for _ in range(sum(lens))], dtype=np.int32)
    if bad:
        tokens[rng.randrange(len(tokens))] = VOCAB + rng.randrange(100)
    return tokens, np.array(lens, dtype=np.int32)


CLEAR = ("outside the vocabulary", "over the token budget", "over this target's", "Submit first",
         "this feed is closed")


def assert_clear(e):
    assert isinstance(e, draftfeed.DraftfeedError), repr(e)
    assert any(c in e.message for c in CLEAR), e.message


class Model:
    """What the feed must hold: outstanding ids in submission order, and how each id ended."""

    def __init__(self):
        self.next_id = 1  # the native feed numbers batches 1, 2, ...
        self.outstanding = {}  # id -> (batch, bad)
        self.ended = {}  # id -> "result" | "error" | "cancelled" | "closed"

    def submitted(self, batch, bad):
        self.outstanding[self.next_id] = (batch, bad)
        self.next_id += 1
        return self.next_id - 1

    def end(self, batch_id, how):
        assert batch_id not in self.ended, f"batch {batch_id} ended twice"
        self.ended[batch_id] = how
        return self.outstanding.pop(batch_id)

    def oldest(self):
        return next(iter(self.outstanding))


def check_result(model, r):
    want_id = model.oldest()
    assert r.batch_id == want_id, f"got batch {r.batch_id}, the oldest outstanding is {want_id}"
    (tokens, lens), bad = model.end(r.batch_id, "result")
    assert not bad, f"batch {r.batch_id} should have been refused"
    np.testing.assert_array_equal(r.token_ids, tokens)
    np.testing.assert_array_equal(r.seq_lens, lens)
    assert r.hidden_bits.shape[0] == len(tokens)


def check_error(model, e):
    assert_clear(e)
    assert e.consumed_batch and e.batch_id == model.oldest()
    _, bad = model.end(e.batch_id, "error")
    assert bad, f"good batch {e.batch_id} failed: {e}"


def do_map(feed, model, rng):
    n = rng.randint(0, 7)
    items = [make_batch(rng, rng.random() < 0.25) for _ in range(n)]
    on_error = rng.choice(["raise", "skip"])
    stop_after = rng.choice([None, None, 0, 1, 3])
    first_new = model.next_id
    submitted_before = feed.stats()["submitted"]
    queued = list(items)
    skipped = []
    gen = feed.map(iter(queued), on_error=on_error,
                   on_skip=lambda err, item: skipped.append(err))
    mine = set()  # ids this map submitted, as the model learns them
    yielded = 0

    def learn():  # map submits ahead of what it yields: catch the model up on its submissions
        while model.next_id < first_new + feed.stats()["submitted"] - submitted_before:
            idx = model.next_id - first_new
            mine.add(model.submitted(items[idx], bad_of[idx]))

    bad_of = [bool((t >= VOCAB).any() or len(t) > BUDGET) for t, _ in items]
    try:
        while True:
            if stop_after is not None and yielded == stop_after:
                break
            try:
                r = next(gen)
            except StopIteration:
                break
            learn()
            for e in skipped:
                check_error(model, e)
            skipped.clear()
            check_result(model, r)
            assert r.batch is items[r.batch_id - first_new] if r.batch_id >= first_new else True
            yielded += 1
    except draftfeed.DraftfeedError as e:
        learn()
        for s in skipped:
            check_error(model, s)
        assert on_error == "raise"
        check_error(model, e)
        # the batches still in flight are not cancelled: they stay for next()
        return
    learn()
    for e in skipped:
        check_error(model, e)
    gen.close()  # leaving early cancels this map's own batches still in flight, no others
    for b in sorted(mine & set(model.outstanding)):
        model.end(b, "cancelled")


def step(feed, model, rng):
    action = rng.choices(["submit", "next", "map", "cancel_some", "cancel_all"],
                         weights=[5, 4, 3, 1, 0.3])[0]
    if action == "submit":
        if len(model.outstanding) >= PREFETCH:
            return  # submit would block (one thread): the feed is full
        bad = rng.random() < 0.2
        batch = make_batch(rng, bad)
        assert feed.submit(*batch) == model.submitted(batch, bad)
    elif action == "next":
        try:
            r = feed.next()
        except draftfeed.DraftfeedError as e:
            if not model.outstanding:
                assert_clear(e)
                assert e.code_name == "FAILED_PRECONDITION" and not e.consumed_batch
            else:
                check_error(model, e)
        else:
            check_result(model, r)
    elif action == "map":
        do_map(feed, model, rng)
    elif action == "cancel_some":
        ids = rng.sample(range(1, model.next_id + 2), k=min(3, model.next_id + 1))
        live = [b for b in ids if b in model.outstanding]
        assert feed.cancel(ids) == len(live)
        for b in live:
            model.end(b, "cancelled")
    else:
        n = len(model.outstanding)
        assert feed.cancel() == n
        for b in list(model.outstanding):
            model.end(b, "cancelled")
    assert feed.stats()["outstanding"] == len(model.outstanding), action


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_call_sequences_lose_and_duplicate_nothing(make_target, seed):
    target = make_target(extra=refuse_over(BUDGET))
    rng = random.Random(seed)
    model = Model()
    feed = draftfeed.Feed(targets=[target.address], layers=[0, -1], prefetch=PREFETCH)
    for _ in range(60):
        step(feed, model, rng)
    left = list(model.outstanding)
    feed.close()
    for b in left:
        model.end(b, "closed")
    # after close every call refuses by name, and nothing new appears
    for call in (feed.next, feed.cancel, lambda: feed.submit(*make_batch(rng, False)),
                 lambda: list(feed.map([make_batch(rng, False)]))):
        with pytest.raises(draftfeed.DraftfeedError) as e:
            call()
        assert_clear(e.value)
    s = feed.stats()
    assert s["closed"]
    ended = model.ended
    assert sorted(ended) == list(range(1, model.next_id)), "a batch never ended"
    count = {how: sum(1 for v in ended.values() if v == how)
             for how in ("result", "error", "cancelled", "closed")}
    assert s["submitted"] == model.next_id - 1
    # (failed also counts a refused batch cancelled before next() took its error)
    assert s["delivered"] == count["result"] and s["failed"] >= count["error"]
    assert s["cancelled"] == count["cancelled"] + count["closed"]
    assert count["result"] > 10 and count["error"] > 0  # the sequence exercised both
