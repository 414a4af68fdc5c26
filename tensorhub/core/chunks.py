"""Chunks: the units of pipelined replication.

A layout's items (compact region first, then each large tensor) are laid end to end and cut
every `CHUNK_BYTES`: chunk i is a few (item, offset, nbytes) segments. The cut depends only
on the items and the chunk size, so the coordinator and every reader agree on chunk numbers
without sending them. A reader that has finished chunk i reports it (`Progress`) and serves
it to others while it pulls chunk i+1.
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


def subtract(ranges: Iterable[ByteRange], covered: Iterable[ByteRange]) -> list[ByteRange]:
    """The parts of `ranges` that no range of `covered` overlaps."""
    cuts: dict[int, list[tuple[int, int]]] = {}
    for c in covered:
        cuts.setdefault(c.item, []).append((c.offset, c.offset + c.nbytes))
    out = []
    for r in ranges:
        pieces = [(r.offset, r.offset + r.nbytes)]
        for lo, hi in cuts.get(r.item, []):
            pieces = [p for a, b in pieces
                      for p in ((a, min(b, lo)), (max(a, hi), b)) if p[0] < p[1]]
        out.extend(ByteRange(item=r.item, offset=a, nbytes=b - a) for a, b in pieces)
    return out


class ChunkTracker:
    """A chunked reader's bookkeeping: which chunks are complete (to report and serve), and
    which bytes are still missing (to ask for), whatever the size of the reads that land.

    `landed` counts each byte once (the puller never reads a range twice), so a chunk is
    complete exactly when all its bytes have landed, in any number of pieces and plans."""

    def __init__(self, chunks: Sequence[Chunk]):
        self.chunks = list(chunks)
        self._by_item = segments_by_item(self.chunks)
        self._left = {c.index: c.nbytes for c in self.chunks}
        self._planned: set[int] = set()
        # Bytes a failed plan did not read that no later plan has covered yet (a plan may
        # cover only part of what we ask for): asked for again until a plan covers them.
        self._owed: list[ByteRange] = []

    @property
    def complete(self) -> bool:
        return not self._left

    def planned(self, ranges: Iterable[ByteRange]) -> None:
        """A plan now covers these ranges."""
        ranges = list(ranges)
        self._planned.update(index for index, _ in chunks_in(self.chunks, ranges,
                                                             self._by_item))
        if self._owed:
            self._owed = subtract(self._owed, ranges)

    def landed(self, ranges: Iterable[ByteRange]) -> list[int]:
        """These ranges have landed; return the chunks that are now complete."""
        finished = []
        for index, piece in chunks_in(self.chunks, ranges, self._by_item):
            left = self._left.get(index)
            if left is None:
                continue
            left -= piece.nbytes
            if left <= 0:
                del self._left[index]
                finished.append(index)
            else:
                self._left[index] = left
        return finished

    def missing(self, unread: Iterable[ByteRange]) -> list[ByteRange]:
        """What to ask for next: the open plan's `unread` ranges (after a failure) and those
        of earlier failures that no plan has covered since, plus every chunk no plan has
        covered yet."""
        self._owed = merge([*self._owed, *unread])
        rest = [s for c in self.chunks if c.index not in self._planned for s in c.segments]
        return merge([*self._owed, *rest])
