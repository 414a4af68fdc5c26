"""The striped reader's state machine, with no I/O: what it reads, polls and asks, when."""

from __future__ import annotations

from tensorhub.core.stripes import Poll, Read, Replan, StripedPull, progress_tag


def _of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def test_from_a_complete_parent_it_reads_its_stripe_in_order_without_polling():
    pull = StripedPull(8, 2, version=3, batch=2)
    pull.assign(["trainer", "trainer"], {"trainer"}, now=0.0)
    reads = _of(pull.actions(0.0), Read)
    assert [(r.stripe, r.chunks) for r in reads] == [(0, (0, 2)), (1, (1, 3))]
    assert not _of(pull.actions(0.0), Poll)  # (reads in flight: nothing more to start)


def test_from_a_pulling_parent_it_reads_what_the_parent_has_landed():
    pull = StripedPull(6, 2, version=3)
    pull.assign(["p", None], set(), now=0.0, retry_after=0.5)
    [poll] = _of(pull.actions(0.0), Poll)
    assert (poll.source, poll.lo, poll.hi) == ("p", 0, 6)
    tag = progress_tag(3)
    pull.polled(poll, bytes([tag, tag, 0, 0, 0, 0]), now=0.001)  # chunks 0 and 1 there
    [read] = _of(pull.actions(0.001), Read)
    assert read.chunks == (0,)  # stripe 0 only: chunk 1 is the other stripe's


def test_bytes_left_by_an_older_version_do_not_count():
    pull = StripedPull(4, 1, version=5)
    pull.assign(["p"], set(), now=0.0)
    [poll] = pull.actions(0.0)
    pull.polled(poll, bytes([progress_tag(4)] * 4), now=0.001)
    assert not _of(pull.actions(0.001), Read)


def test_a_failed_read_asks_for_another_parent_naming_the_failed_one():
    pull = StripedPull(4, 2, version=1)
    pull.assign(["a", "b"], {"a", "b"}, now=0.0)
    reads = pull.actions(0.0)
    pull.read_done(reads[0], ok=False, now=0.1)
    actions = pull.actions(0.1)
    [replan] = _of(actions, Replan)
    assert replan == Replan((0,), failed=("a",))
    pull.read_done(reads[1], ok=True, now=0.2)  # the other stripe goes on meanwhile
    assert pull.landed == {1}


def test_a_parent_with_nothing_new_for_the_stall_time_is_reported_behind():
    pull = StripedPull(4, 1, version=1, stall=2.0, poll_max=1.0)
    pull.assign(["slow"], set(), now=0.0)
    t = 0.0
    while True:
        actions = pull.actions(t)
        if _of(actions, Replan):
            break
        for poll in _of(actions, Poll):
            pull.polled(poll, bytes(4), now=t)
        t = pull.wake_at(t)
    assert _of(actions, Replan)[0].behind == ("slow",) and 2.0 <= t < 4.0


def test_a_pending_stripe_is_asked_for_again_after_the_retry_time():
    pull = StripedPull(4, 2, version=1)
    pull.assign(["a", None], {"a"}, now=0.0, retry_after=0.02)
    assert not _of(pull.actions(0.01), Replan)
    assert _of(pull.actions(0.02), Replan) == [Replan((1,))]


def test_a_stripe_with_no_chunks_left_never_makes_the_reader_wake():
    """More stripes than chunks: a stripe without a parent but with nothing to read asks
    for none, so it sets no wake-up (one due at once would have the reader spin while its
    reads run)."""
    pull = StripedPull(1, 2, version=1)
    pull.assign(["a", None], {"a"}, now=0.0)
    [read] = pull.actions(0.0)
    assert read.chunks == (0,)
    assert pull.wake_at(0.0) is None
    assert not pull.actions(1.0)
