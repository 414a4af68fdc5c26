"""Chunks: the units of pipelined replication.

A layout's items (compact region first, then each large tensor) are laid end to end and cut
every `CHUNK_BYTES`: chunk i is a few (item, offset, nbytes) segments. The cut depends only
on the items and the chunk size, so the coordinator and every reader agree on chunk numbers
without sending them. A striped reader that has chunk i marks it in its progress bytes
(`core/stripes.py`) and serves it to its children while it pulls chunk i+1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tensorhub.core.data_types import ByteRange, Item

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


def segments_by_item(chunks: Sequence[Chunk]) -> dict[int, list[tuple[int, ByteRange]]]:
    """item -> its (chunk index, segment) pairs in order: `chunks_in`'s index, to keep."""
    by_item: dict[int, list[tuple[int, ByteRange]]] = {}
    for c in chunks:
        for s in c.segments:
            by_item.setdefault(s.item, []).append((c.index, s))
    return by_item


def chunks_in(chunks: Sequence[Chunk], ranges: Iterable[ByteRange],
              by_item: dict[int, list[tuple[int, ByteRange]]] | None = None,
              ) -> list[tuple[int, ByteRange]]:
    """The pieces of `ranges` cut at chunk boundaries, each with its chunk index, in chunk
    order. Raises ValueError for a range outside the layout."""
    by_item = segments_by_item(chunks) if by_item is None else by_item
    pieces = []
    for r in ranges:
        segs = by_item.get(r.item, [])
        end = r.offset + r.nbytes
        if r.nbytes and (not segs or end > segs[-1][1].offset + segs[-1][1].nbytes):
            raise ValueError(f"range {r.item}:{r.offset}+{r.nbytes} is outside the layout")
        for index, s in segs:
            lo, hi = max(r.offset, s.offset), min(end, s.offset + s.nbytes)
            if lo == s.offset and hi == s.offset + s.nbytes:
                pieces.append((index, s))  # a whole segment (the usual case): no new model
            elif lo < hi:
                pieces.append((index, ByteRange(item=r.item, offset=lo, nbytes=hi - lo)))
    pieces.sort(key=lambda p: (p[0], p[1].item, p[1].offset))
    return pieces


def merge(ranges: Iterable[ByteRange]) -> list[ByteRange]:
    """Adjacent ranges of the same item joined: a short `missing` list for a re-plan. Always
    plain `ByteRange`s, also for a lone `ReadRange` of a failed plan (a `PlanRequest`'s
    `missing` refuses other types)."""
    runs: list[list[int]] = []  # [item, offset, nbytes]: models made once, at the end
    for r in sorted(ranges, key=lambda r: (r.item, r.offset)):
        if runs and runs[-1][0] == r.item and runs[-1][1] + runs[-1][2] == r.offset:
            runs[-1][2] += r.nbytes
        else:
            runs.append([r.item, r.offset, r.nbytes])
    return [ByteRange(item=i, offset=o, nbytes=n) for i, o, n in runs]
