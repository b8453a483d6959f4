"""The Python Feed's count of outstanding batches follows the native feed's, so no call
sequence makes map() stop early (and drop a result) or hang; a closed feed refuses by name."""

import numpy as np
import pytest

import draftfeed

BATCHES = [(np.arange(n, dtype=np.int32) % 4096, np.array([n], dtype=np.int32)) for n in (5, 9, 3)]


def test_a_refused_next_takes_no_batch(target):
    with draftfeed.Feed(targets=[target.address], layers=[1], prefetch=2) as feed:
        with pytest.raises(draftfeed.DraftfeedError) as e:
            feed.next()  # nothing submitted
        assert e.value.code_name == "FAILED_PRECONDITION"
        assert [r.num_tokens for r in feed.map(BATCHES)] == [5, 9, 3]
        # A refused batch takes its batch; the rest still come back.
        feed.submit(np.array([5000], dtype=np.int32), np.array([1], dtype=np.int32))
        with pytest.raises(draftfeed.DraftfeedError, match="outside the vocabulary"):
            feed.next()
        assert [r.num_tokens for r in feed.map(BATCHES)] == [5, 9, 3]
        feed.submit(*BATCHES[0])
        assert feed.cancel() == 1
        assert [r.num_tokens for r in feed.map(BATCHES)] == [5, 9, 3]


def test_a_closed_feed_refuses_by_name(target):
    feed = draftfeed.Feed(targets=[target.address], layers=[1])
    feed.close()
    for call in (lambda: feed.submit(*BATCHES[0]), feed.next, feed.cancel,
                 lambda: feed.add_target(target.address), lambda: feed.target):
        with pytest.raises(draftfeed.DraftfeedError, match="this feed is closed"):
            call()
    assert feed.stats()["closed"]
