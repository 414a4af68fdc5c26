"""Chunks: the units of pipelined replication.

A layout's items (compact region first, then each large tensor) are laid end to end and cut
every `CHUNK_BYTES`: chunk i is a few (item, offset, nbytes) segments. The cut depends only
on the items and the chunk size, so the coordinator and every reader agree on chunk numbers
without sending them. A striped reader that has chunk i marks it in its progress bytes
(`core/stripes.py`) and serves it to its children while it pulls chunk i+1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tensorhub.core.data_types import ByteRange
from tensorhub.core.layout import Item

CHUNK_BYTES = 64 << 20  # equal to the puller's batch size: one chunk is one READ batch


@dataclass(frozen=True)
class Chunk:
    index: int
    segments: tuple[ByteRange, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


def chunks_of(items: Sequence[Item], chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
    """Cut the items, end to end in order, into chunks of `chunk_bytes` (the last smaller).
    Empty items belong to no chunk."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    chunks: list[Chunk] = []
    current: list[ByteRange] = []
    room = chunk_bytes
    for k, item in enumerate(items):
        offset = 0
        while offset < item.nbytes:
            n = min(room, item.nbytes - offset)
            current.append(ByteRange(item=k, offset=offset, nbytes=n))
            offset += n
            room -= n
            if room == 0:
                chunks.append(Chunk(len(chunks), tuple(current)))
                current, room = [], chunk_bytes
    if current:
        chunks.append(Chunk(len(chunks), tuple(current)))
    return chunks
