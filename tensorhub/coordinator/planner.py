"""The planner of whole-item plans: which holder a reader pulls every item (or the ranges
it still misses) from.

One source per plan, replicas before the trainer, least-loaded first, at most
`max_readers_per_holder` concurrent readers each, so a fleet forms a tree rather than a star
out of the trainer. Striped plans (the default) are made by `forest.py`; this module also
says how a version is cut into chunks for them (`PlannerConfig.chunk_bytes_for`).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass

from tensorhub.coordinator.table import LayoutRec, Table, WorkerRec
from tensorhub.core.chunks import CHUNK_BYTES
from tensorhub.core.data_types import ByteRange, ReadRange


@dataclass(frozen=True)
class PlannerConfig:
    max_readers_per_holder: int = 2  # readers one holder serves at once (a forest's fan-out)
    chunk_bytes: int = CHUNK_BYTES  # the largest chunk
    # A version is cut into at least this many chunks (each at least `min_chunk_bytes`): a
    # fan-out's tail after the publisher's last byte is a few chunk times (log2 of the
    # fleet), so a small version cut into a handful of large chunks waits mostly on its
    # tail. 1: always `chunk_bytes`.
    min_chunks: int = 64
    min_chunk_bytes: int = 8 << 20
    scan_limit: int = 16  # usable holders examined before taking the best seen
    scan_budget: int = 4096  # holders examined per plan in all: bounds a plan's cost

    def chunk_bytes_for(self, nbytes: int) -> int:
        """The chunk size of a version of `nbytes`: `chunk_bytes`, or less for a small one
        (whole MiB, at least `min_chunk_bytes`)."""
        wanted = -(-nbytes // max(1, self.min_chunks))
        wanted = -(-wanted // (1 << 20)) << 20
        return min(self.chunk_bytes, max(self.min_chunk_bytes, wanted))


class NoSource(Exception):
    """No eligible holder now: `busy` says whether one will free up (retry) or none exists."""

    def __init__(self, busy: bool):
        self.busy = busy


def plan_ranges(table: Table, layout: LayoutRec, reader: str, config: PlannerConfig,
                missing: list[ByteRange] | None = None,
                avoid: Collection[str] = ()) -> list[ReadRange]:
    """Ranges for `reader` to read: every item whole, or only the `missing` ranges left
    after a failed read (re-planning reads nothing twice), from no holder in `avoid`."""
    # A bounded scan from a rotating start: a plan's cost stays flat in the fleet's size. A
    # fleet with fewer free holders than `scan_limit` is scanned whole: the least loaded,
    # oldest one wins.
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


def distance(reader: WorkerRec, holder: WorkerRec) -> int:
    """0 same node, 1 same datacenter, 2 remote (a missing label counts as equal)."""
    r, h = reader.labels, holder.labels
    if r.get("dc", "") != h.get("dc", ""):
        return 2
    node = r.get("node")
    return 0 if node is not None and node == h.get("node") else 1
