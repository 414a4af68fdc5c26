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
from collections.abc import Collection
from dataclasses import dataclass

from tensorhub.coordinator.table import HolderRec, LayoutRec, PartialRec, Table, WorkerRec
from tensorhub.core.chunks import CHUNK_BYTES, chunks_in
from tensorhub.core.data_types import ByteRange, ReadRange


@dataclass(frozen=True)
class PlannerConfig:
    max_readers_per_holder: int = 2
    max_streams_per_remote_dc: int = 1
    # One holder per chunked plan: its lease is one stream and ends (freeing the holder's
    # slot) when that holder's chunks are read; a reader stripes by keeping one lease per
    # stream open. Whole-item plans (`plan_ranges`) ignore this.
    max_sources_per_plan: int = 1
    max_chunks_per_plan: int = 4  # a reader re-plans this often, so load spreads as it grows
    # One chunk a lease from a contended holder: every chunk is matched afresh (the rarest,
    # from whichever holder is free now) and a holder's slot frees after one chunk time.
    # Two a lease (the earlier default) left fleets of 1024-4096 at 1.22-1.26 x the lower
    # bound in the simulator, rising with N; one gives 1.14-1.19 from 8 to 4096, 0.08-0.13
    # above the optimum at every N (the cost: a plan round trip per chunk, ~0.04 at N = 8).
    max_chunks_per_source: int = 1
    # ... but the only usable holder, when idle and no reader waits for a first chunk, gives
    # up to this many: a reader with a holder to itself (one replica, the tail of a fan-out)
    # makes fewer plan round trips for the same bytes. (Given by any idle holder, it cost
    # the simulated fleet 0.01-0.02 of the lower bound at N = 64-512: less agility.)
    max_chunks_from_idle_source: int = 4
    chunk_bytes: int = CHUNK_BYTES  # the largest chunk
    # A version is cut into at least this many chunks (each at least `min_chunk_bytes`): a
    # fan-out's tail after the publisher's last byte is a few chunk times (log2 of the
    # fleet), so a small version cut into a handful of large chunks waits mostly on its
    # tail. 1: always `chunk_bytes`.
    min_chunks: int = 64
    min_chunk_bytes: int = 8 << 20

    def chunk_bytes_for(self, nbytes: int) -> int:
        """The chunk size of a version of `nbytes`: `chunk_bytes`, or less for a small one
        (whole MiB, at least `min_chunk_bytes`)."""
        wanted = -(-nbytes // max(1, self.min_chunks))
        wanted = -(-wanted // (1 << 20)) << 20
        return min(self.chunk_bytes, max(self.min_chunk_bytes, wanted))
    scan_limit: int = 16  # usable holders examined before taking the best seen
    scan_budget: int = 4096  # holders examined per plan in all: bounds a plan's cost
    rarest_first: bool = True  # offer the chunks fewest peers have first (more to trade)
    # Readers with nothing yet come first: while one of a datacenter that reads nothing was
    # refused within this many seconds, its readers that already read take a further stream
    # only from an idle holder (so the fleet's holders multiply fast at the start).
    starving_ttl: float = 0.1


class NoSource(Exception):
    """No eligible holder now: `busy` says whether one will free up (retry) or none exists."""

    def __init__(self, busy: bool):
        self.busy = busy


def plan_ranges(table: Table, layout: LayoutRec, reader: str, config: PlannerConfig,
                missing: list[ByteRange] | None = None,
                avoid: Collection[str] = ()) -> list[ReadRange]:
    """Ranges for `reader` to read: every item whole, or only the `missing` ranges left
    after a failed read (re-planning reads nothing twice), from no holder in `avoid`."""
    # A bounded scan from a rotating start, as for chunked plans: a plan's cost stays flat in
    # the fleet's size (scanning all 2048 holders took ~5 ms a plan). A fleet with fewer
    # free holders than `scan_limit` is scanned whole: the least loaded, oldest one wins.
    ids = list(layout.holders)
    table.plans += 1
    start = table.plans * 104729 % max(1, len(ids))
    free, live, budget = [], False, config.scan_budget
    for hid in itertools.chain(ids[start:], ids[:start]):
        if budget <= 0 or len(free) >= config.scan_limit:
            break
        budget -= 1
        worker = table.workers.get(hid)
        if layout.holders[hid].withdrawn or worker is None or hid == reader or hid in avoid:
            continue
        live = True
        load = table.active_reads(hid)
        if load < config.max_readers_per_holder:
            free.append((worker.role == "trainer", load, worker.seq, hid))
    if not free:
        raise NoSource(busy=live)
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
    sources: dict[str, HolderRec | PartialRec]  # each source's copy (its regions)
    complete: bool  # False: some missing chunks are left for a later plan
    remote_into: str | None  # the reader's dc, if a source lies outside it
    chunks: tuple[int, ...] = ()  # the chunks planned


def distance(reader: WorkerRec, holder: WorkerRec) -> int:
    """0 same node, 1 same datacenter, 2 remote (a missing label counts as equal)."""
    r, h = reader.labels, holder.labels
    if r.get("dc", "") != h.get("dc", ""):
        return 2
    node = r.get("node")
    return 0 if node is not None and node == h.get("node") else 1


def plan_chunks(table: Table, layout: LayoutRec, layout_id: str, reader_id: str,
                config: PlannerConfig, missing: list[ByteRange] | None = None,
                avoid: Collection[str] = ()) -> ChunkPlan:
    """Ranges for `reader_id`: its missing bytes (everything, if None, less the chunks it
    has reported) cut at chunk boundaries, from no holder in `avoid` (ones it failed on).

    Holders first, chunks second (as BitTorrent picks peers, then pieces): among the
    holders that are free and have something this reader lacks, the least loaded (an
    idle holder's upload is capacity the fleet is wasting), nearest, trainer last, win;
    each then gives its rarest chunks. Choosing chunks first (rarest, then a holder of
    it) sent every reader to the few holders of the rarest chunks while the others'
    uploads idled, and made the fleet a chain that grew by two readers per chunk time.
    """
    reader = table.workers[reader_id]
    chunk_bytes = config.chunk_bytes_for(layout.nbytes)
    chunks = layout.chunks(chunk_bytes)
    if missing is None:
        have = layout.partial[reader_id].chunks if reader_id in layout.partial else set()
        pieces = [(c.index, s) for c in chunks if c.index not in have for s in c.segments]
    else:
        pieces = chunks_in(chunks, missing, layout.segments_by_item(chunk_bytes))
    if not pieces:
        return ChunkPlan([], {}, True, None)
    my_dc = reader.labels.get("dc", "")
    reading = table.leases.by_reader[reader_id]
    starving = table.starving.setdefault(my_dc, {})
    expired = table.clock() - config.starving_ttl
    while starving and next(iter(starving.values())) < expired:
        del starving[next(iter(starving))]
    # An empty reader with no stream goes first: while one waits, a reader that already
    # reads takes a further stream only from an idle holder, never a holder's last slot.
    someone_starving = len(starving) > (reader_id in starving)
    cap = 1 if reading and someone_starving else config.max_readers_per_holder
    try:
        # (A reader already reading on another stream gets one chunk even so: a long
        # lease here would leave its other stream nothing to plan, so no striping.)
        plan = _plan_chunks(table, layout, layout_id, reader, config, pieces, my_dc, cap, avoid,
                            idle_room=(config.max_chunks_per_source
                                       if someone_starving or reading
                                       else config.max_chunks_from_idle_source))
    except NoSource as exc:
        if exc.busy and not reading and not (reader_id in layout.partial
                                             and layout.partial[reader_id].chunks):
            starving.pop(reader_id, None)
            starving[reader_id] = table.clock()
        raise
    starving.pop(reader_id, None)
    return plan


def _plan_chunks(table: Table, layout: LayoutRec, layout_id: str, reader: WorkerRec,
                 config: PlannerConfig, pieces: list[tuple[int, ByteRange]],
                 my_dc: str, cap: int, avoid: Collection[str], idle_room: int) -> ChunkPlan:
    reader_id = reader.worker_id
    want: dict[int, list[ByteRange]] = {}
    for index, piece in pieces:
        want.setdefault(index, []).append(piece)
    remote_room = config.max_streams_per_remote_dc - table.leases.remote_into[my_dc]
    ids = layout.serving()
    if not ids:
        raise NoSource(busy=False)
    holders, partial = layout.holders, layout.partial
    reads = table.leases.chunk_reads
    if not any(not h.withdrawn for h in holders.values()) and \
            any(not partial.having(c) and not reads[(layout_id, c)] for c in want):
        # No complete copy is left and no reader has or is reading these chunks: partial
        # holders can only wait on each other, so nobody can finish this version. Waiting
        # for one that can never free up would hold every such reader until its timeout.
        raise NoSource(busy=False)
    pairs, loads, workers = table.leases.by_pair, table.leases.by_holder, table.workers

    def usable_key(hid: str) -> tuple | None:
        # The cheapest test first: in a large fleet most holders are busy (it is most of
        # what a plan costs, and of what the simulator's runtime is).
        load = loads.get(hid, 0)
        if load >= cap:
            return None
        worker = workers.get(hid)
        if worker is None or hid == reader_id or (reader_id, hid) in pairs or hid in avoid:
            return None  # gone, myself, one stream from it already (one per source), failed
        rec = holders.get(hid)
        if (rec is not None and rec.withdrawn) or (rec is None and hid not in partial):
            return None  # withdrew or left since the list was made
        dist = distance(reader, worker)
        if dist == 2 and remote_room <= 0:
            return None
        if rec is None and partial[hid].chunks.isdisjoint(want):
            return None  # nothing this reader lacks
        if worker.role == "trainer" and load and len(holders) <= 1 and not sends_fresh():
            return None  # a busy sole publisher sends no copy of what the fleet already has
        return (dist == 2, worker.role == "trainer", load, dist)

    fresh: list[bool] = []

    def sends_fresh() -> bool:
        """Whether a chunk this reader lacks is nowhere in the fleet yet (no replica has
        it, none is reading it). While the publisher is the only complete holder, its
        upload is what a fan-out waits on (every byte leaves it at least once): while it
        is busy, a copy of a chunk others already hold would only slow the rest down."""
        if not fresh:
            fresh.append(any(nowhere(c) for c in want))
        return fresh[0]

    def nowhere(chunk: int) -> bool:
        """No replica has the chunk and none is reading it."""
        return not partial.having(chunk) and not reads[(layout_id, chunk)]

    # A bounded scan from a rotating start: plans spread over the fleet, cost stays flat.
    table.plans += 1
    start = (reader.seq * 7919 + table.plans * 104729) % len(ids)
    budget, seen, idle = config.scan_budget, [], 0
    for order, hid in enumerate(itertools.chain(ids[start:], ids[:start])):
        if budget <= 0 or len(seen) >= config.scan_limit or idle >= config.max_sources_per_plan:
            break  # (enough idle same-node replicas seen: none can be better)
        budget -= 1
        key = usable_key(hid)
        if key is not None:
            seen.append((*key, order, hid))
            idle += key == (False, False, 0, 0)
    if not seen:
        raise NoSource(busy=True)
    taken: set[int] = set()
    ranges: list[ReadRange] = []
    sources: dict[str, HolderRec | PartialRec] = {}
    remote_chosen = False
    for key in heapq.nsmallest(config.max_sources_per_plan, seen):
        hid = key[-1]
        # A reader with one idle holder to itself (no other usable holder seen) takes more.
        per_source = idle_room if key[2] == 0 and len(seen) == 1 \
            else config.max_chunks_per_source
        room = min(per_source, config.max_chunks_per_plan - len(taken))
        if room <= 0:
            break
        if key[0]:
            if remote_chosen:
                continue  # one stream per plan into a remote dc
            remote_chosen = True
        has = want if hid in holders else partial[hid].chunks
        offer = [c for c in has if c in want and c not in taken]
        if key[1] and key[2] and len(holders) <= 1:  # a busy sole publisher: fresh chunks only
            offer = [c for c in offer if nowhere(c)]
        if config.rarest_first:  # counting copies in flight: two readers fetch two chunks
            offer.sort(key=lambda c: (len(layout.partial.having(c)) + reads[(layout_id, c)],
                                      c))
        else:
            offer.sort()
        take = sorted(offer[:room])
        taken.update(take)
        for c in take:
            ranges.extend(ReadRange(item=p.item, offset=p.offset, nbytes=p.nbytes, source=hid)
                          for p in want[c])
        rec = layout.holders.get(hid)
        sources[hid] = rec if rec is not None else layout.partial[hid]
    if not ranges:
        raise NoSource(busy=True)
    return ChunkPlan(ranges, sources, len(taken) == len(want),
                     my_dc if remote_chosen else None, tuple(sorted(taken)))
