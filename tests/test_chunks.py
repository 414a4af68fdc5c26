"""A chunked reader's bookkeeping: every byte is asked for until it lands, whatever part of
a request each plan covers."""

from __future__ import annotations

from tensorhub.core.chunks import ChunkTracker, chunks_of, subtract
from tensorhub.core.data_types import ByteRange, Item

MIB = 1 << 20


def _tracker() -> ChunkTracker:
    items = [Item(kind="tensor", nbytes=4 * MIB, tensors=[i], offsets=[0]) for i in range(3)]
    return ChunkTracker(chunks_of(items, chunk_bytes=4 * MIB))  # a chunk per item


def _r(item: int, offset: int, nbytes: int) -> ByteRange:
    return ByteRange(item=item, offset=offset, nbytes=nbytes)


def test_subtract_keeps_only_the_uncovered_parts():
    assert subtract([_r(0, 0, 100), _r(1, 0, 10)], [_r(0, 20, 30), _r(0, 90, 50)]) == \
        [_r(0, 0, 20), _r(0, 50, 40), _r(1, 0, 10)]


def test_unread_bytes_a_later_plan_leaves_out_are_asked_for_again():
    tracker = _tracker()
    tracker.planned([_r(0, 0, 4 * MIB), _r(2, 0, 4 * MIB)])  # chunks 0 and 2
    tracker.landed([_r(0, 0, 4 * MIB)])  # then the source died: chunk 2 never came
    assert tracker.missing([_r(2, 0, 4 * MIB)]) == [_r(1, 0, 4 * MIB), _r(2, 0, 4 * MIB)]
    tracker.planned([_r(1, 0, 4 * MIB)])  # the next plan covers only chunk 1
    tracker.landed([_r(1, 0, 4 * MIB)])
    assert tracker.missing([]) == [_r(2, 0, 4 * MIB)]  # chunk 2 is still owed
    tracker.planned([_r(2, 0, 4 * MIB)])
    assert tracker.missing([]) == []
    tracker.landed([_r(2, 0, 4 * MIB)])
    assert tracker.complete
