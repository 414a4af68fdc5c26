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


def test_what_a_failed_plan_left_unread_is_asked_for_as_plain_byte_ranges():
    from tensorhub.core.data_types import ReadRange

    tracker = _tracker()
    tracker.planned([_r(k, 0, 4 * MIB) for k in range(3)])
    lone = ReadRange(item=1, offset=MIB, nbytes=MIB, source="dead")  # not next to another
    missing = tracker.missing([lone])
    assert missing == [_r(1, MIB, MIB)] and type(missing[0]) is ByteRange
