"""The planner: which holders a reader pulls which byte ranges from.

Whole-item plans (`plan_ranges`, the first cut): one source per read, replicas before the
trainer, least-loaded first, at most `max_readers_per_holder` concurrent readers each, so a
fleet forms a tree rather than a star out of the trainer.

Chunked plans (`plan_chunks`, readers that opt in): a source per chunk, chosen among
complete holders *and* partial ones that have finished that chunk (pipelined replication:
chunk i comes from a peer that is still pulling chunk i+1), nearest first (same node < same
datacenter < remote, at most `max_streams_per_remote_dc` streams into a datacenter, whose
readers then seed it), trainer last, striped over up to `max_sources_per_plan` holders.
A chunk no free holder has yet is left out and the plan says `complete=False`: the reader
reads what it got, reports `Progress`, and asks again for the rest.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tensorhub.coordinator.table import LayoutRec, Table, WorkerRec
from tensorhub.core.chunks import CHUNK_BYTES, chunks_in
from tensorhub.core.data_types import ByteRange, MemoryDesc, ReadRange


@dataclass(frozen=True)
class PlannerConfig:
    max_readers_per_holder: int = 2
    max_streams_per_remote_dc: int = 1
    max_sources_per_plan: int = 2  # striping: one reader's chunks come from this many holders
    max_chunks_per_plan: int = 4  # a reader re-plans this often, so load spreads as it grows
    max_chunks_per_source: int = 2  # ... and a lone busy source cannot hold it back long
    chunk_bytes: int = CHUNK_BYTES
    scan_limit: int = 64  # free holders of one chunk examined before taking the best seen
    scan_budget: int = 4096  # holders examined per plan in all: bounds a plan's cost
    rarest_first: bool = True  # offer the chunks fewest peers have first (more to trade)


class NoSource(Exception):
    """No eligible holder now: `busy` says whether one will free up (retry) or none exists."""

    def __init__(self, busy: bool):
        self.busy = busy


def plan_ranges(table: Table, layout: LayoutRec, reader: str, config: PlannerConfig,
                missing: list[ByteRange] | None = None) -> list[ReadRange]:
    """Ranges for `reader` to read: every item whole, or only the `missing` ranges left
    after a failed read (re-planning reads nothing twice)."""
    candidates = []
    for holder in layout.holders.values():
        worker = table.workers.get(holder.worker_id)
        if holder.withdrawn or worker is None or holder.worker_id == reader:
            continue
        load = table.active_reads(holder.worker_id)
        candidates.append((worker.role == "trainer", load, worker.seq, holder.worker_id))
    if not candidates:
        raise NoSource(busy=False)
    free = [c for c in candidates if c[1] < config.max_readers_per_holder]
    if not free:
        raise NoSource(busy=True)
    source = min(free)[3]
    if missing is None:
        return [ReadRange(item=k, offset=0, nbytes=item.nbytes, source=source)
                for k, item in enumerate(layout.items)]
    for r in missing:
        if r.item >= len(layout.items) or r.offset + r.nbytes > layout.items[r.item].nbytes:
            raise ValueError(f"range {r.item}:{r.offset}+{r.nbytes} is outside the layout")
    return [ReadRange(item=r.item, offset=r.offset, nbytes=r.nbytes, source=source)
            for r in missing]


@dataclass
class ChunkPlan:
    ranges: list[ReadRange]
    memory: dict[str, list[MemoryDesc]]  # each source's regions (partial or complete)
    complete: bool  # False: some missing chunks are left for a later plan
    remote_into: str | None  # the reader's dc, if a source lies outside it
    chunks: tuple[int, ...] = ()  # the chunks planned


def _distance(reader: WorkerRec, holder: WorkerRec) -> int:
    """0 same node, 1 same datacenter, 2 remote (a missing label counts as equal)."""
    r, h = reader.labels, holder.labels
    if r.get("dc", "") != h.get("dc", ""):
        return 2
    node = r.get("node")
    return 0 if node is not None and node == h.get("node") else 1


def plan_chunks(table: Table, layout: LayoutRec, layout_id: str, reader_id: str,
                config: PlannerConfig, missing: list[ByteRange] | None = None) -> ChunkPlan:
    """Ranges for `reader_id`: its missing bytes (everything, if None, less the chunks it
    has reported) cut at chunk boundaries, each chunk from the best free holder of it."""
    reader = table.workers[reader_id]
    chunks = layout.chunks(config.chunk_bytes)
    if missing is None:
        have = layout.partial[reader_id].chunks if reader_id in layout.partial else set()
        pieces = [(c.index, s) for c in chunks if c.index not in have for s in c.segments]
    else:
        pieces = chunks_in(chunks, missing, layout.segments_by_item(config.chunk_bytes))
    if not pieces:
        return ChunkPlan([], {}, True, None)
    cap = config.max_readers_per_holder
    my_dc = reader.labels.get("dc", "")
    remote_room = config.max_streams_per_remote_dc - table.leases.remote_into[my_dc]
    chosen: dict[str, int] = {}  # source -> chunks given to it in this plan
    remote_chosen = False
    known: dict[str, tuple[WorkerRec, int, int] | None] = {}  # id -> (worker, load, dist)

    def look(hid: str) -> tuple[WorkerRec, int, int] | None:
        """The holder's worker, load and distance, or None if it cannot serve this reader."""
        if hid in known:
            return known[hid]
        worker = table.workers.get(hid)
        info = None
        if worker is not None and hid != reader_id:
            info = (worker, table.active_reads(hid), _distance(reader, worker))
        known[hid] = info
        return info

    def usable_key(hid: str) -> tuple | None:
        key = usable(hid)
        return None if key is None else (*key, hid)

    def usable(hid: str) -> tuple | None:
        info = look(hid)
        if info is None:
            return None
        worker, load, dist = info
        if chosen.get(hid, 0) >= config.max_chunks_per_source:
            return None
        if hid not in chosen:
            if load >= cap or len(chosen) >= config.max_sources_per_plan:
                return None
            if dist == 2 and (remote_chosen or remote_room <= 0):
                return None  # one stream per plan into a remote dc, and few at once
        # nearest, then anyone but the trainer, then spread over sources, then least loaded
        return (dist, worker.role == "trainer", chosen.get(hid, 0), load, worker.seq)

    complete_ids = [h.worker_id for h in layout.holders.values() if not h.withdrawn]
    holders_known = bool(complete_ids) or bool(layout.partial)
    # Complete holders have every chunk: only the few best can serve this plan. Examine a
    # bounded window of them (rotating with the reader, so windows spread over the fleet).
    start = reader.seq % len(complete_ids) if complete_ids else 0
    window = itertools.islice(itertools.chain(complete_ids[start:], complete_ids[:start]),
                              4 * config.scan_limit)
    complete_ids = [k[-1] for k in heapq.nsmallest(
        config.max_sources_per_plan + 1, filter(None, map(usable_key, window)))]
    ranges: list[ReadRange] = []
    source_of: dict[int, str | None] = {}  # chunk -> its source in this plan (None: later)
    best_complete: tuple[int, tuple[str | None, tuple | None]] | None = None
    budget = [config.scan_budget]  # holders examined per plan, all chunks together
    skipped = False
    if config.rarest_first:  # counting copies in flight, so two readers fetch two chunks
        reads = table.leases.chunk_reads
        pieces.sort(key=lambda p: (len(layout.partial.having(p[0])) + reads[(layout_id, p[0])],
                                   p[0]))
    for index, piece in pieces:
        if index not in source_of:
            if len(chosen) and sum(chosen.values()) >= config.max_chunks_per_plan:
                skipped = True
                break
            version = sum(chosen.values())
            full = len(chosen) >= config.max_sources_per_plan
            if best_complete is None or best_complete[0] != version:
                # rank the complete candidates again after each choice (striping key)
                best_complete = (version, _best(complete_ids, usable, config.scan_limit,
                                                budget))
            having = layout.partial.having(index)
            partial = (h for h in ([h for h in chosen if h in having] if full else having)
                       if h not in layout.holders)  # a complete record (or withdrawal) wins
            best = _best(partial, usable, config.scan_limit, budget, best_complete[1])[0]
            source_of[index] = best
            if best is None:
                skipped = True
                continue
            if best not in chosen and look(best)[2] == 2:
                remote_chosen = True
            chosen[best] = chosen.get(best, 0) + 1
        source = source_of[index]
        if source is not None:
            ranges.append(ReadRange(item=piece.item, offset=piece.offset, nbytes=piece.nbytes,
                                    source=source))
    if not ranges:
        raise NoSource(busy=holders_known)
    memory = {}
    for sid in chosen:
        rec = layout.holders.get(sid)
        memory[sid] = rec.memory if rec is not None else layout.partial[sid].memory
    return ChunkPlan(ranges, memory, not skipped, my_dc if remote_chosen else None,
                     tuple(c for c, src in source_of.items() if src is not None))


def _best(ids: Iterable[str], usable: Callable[[str], tuple | None], scan_limit: int,
          budget: list[int], start: tuple[str | None, tuple | None] = (None, None),
          ) -> tuple[str | None, tuple | None]:
    """The usable holder with the smallest key (and its key), better than `start`, looking
    at no more than `scan_limit` usable ones, and drawing on the plan's `budget`."""
    best, best_key = start
    usable_seen = 0
    for hid in ids:
        if budget[0] <= 0:
            break
        budget[0] -= 1
        key = usable(hid)
        if key is None:
            continue
        if best_key is None or key < best_key:
            best, best_key = hid, key
        usable_seen += 1
        if usable_seen >= scan_limit:
            break
    return best, best_key
