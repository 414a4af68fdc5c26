"""Chunks: a layout's items laid end to end and cut at fixed sizes, the same for everyone."""

from __future__ import annotations

import pytest

from tensorhub.core.chunks import chunks_of
from tensorhub.core.data_types import ByteRange
from tensorhub.core.layout import Item

MIB = 1 << 20


def _items(*sizes: int) -> list[Item]:
    return [Item(kind="tensor", nbytes=n, tensors=[i], offsets=[0])
            for i, n in enumerate(sizes)]


def _r(item: int, offset: int, nbytes: int) -> ByteRange:
    return ByteRange(item=item, offset=offset, nbytes=nbytes)


def test_items_are_cut_end_to_end_so_a_chunk_may_span_two_items():
    chunks = chunks_of(_items(3 * MIB, 0, 2 * MIB), chunk_bytes=2 * MIB)
    assert [c.segments for c in chunks] == [
        (_r(0, 0, 2 * MIB),),
        (_r(0, 2 * MIB, MIB), _r(2, 0, MIB)),  # (the empty item belongs to no chunk)
        (_r(2, MIB, MIB),),
    ]
    assert [c.index for c in chunks] == [0, 1, 2]
    assert sum(c.nbytes for c in chunks) == 5 * MIB


def test_the_last_chunk_is_smaller_and_a_size_must_be_positive():
    chunks = chunks_of(_items(5 * MIB), chunk_bytes=2 * MIB)
    assert [c.nbytes for c in chunks] == [2 * MIB, 2 * MIB, MIB]
    with pytest.raises(ValueError):
        chunks_of(_items(MIB), chunk_bytes=0)
