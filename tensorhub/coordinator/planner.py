"""The planner: which holders a reader pulls which byte ranges from.

First cut (foundation): one source per read, chosen so that a fleet forms a tree rather than
a star out of the trainer — replicas before the trainer, least-loaded first, at most
`max_readers_per_holder` concurrent readers each. The answer is already a list of
(item, offset, nbytes, source) ranges so that chunked, striped and re-planned reads extend
it without changing the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

from tensorhub.coordinator.table import LayoutRec, Table
from tensorhub.core.data_types import ByteRange, ReadRange


@dataclass(frozen=True)
class PlannerConfig:
    max_readers_per_holder: int = 2


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
    free = sorted(c for c in candidates if c[1] < config.max_readers_per_holder)
    if not free:
        raise NoSource(busy=True)
    source = free[0][3]
    if missing is None:
        return [ReadRange(item=k, offset=0, nbytes=item.nbytes, source=source)
                for k, item in enumerate(layout.items)]
    for r in missing:
        if r.item >= len(layout.items) or r.offset + r.nbytes > layout.items[r.item].nbytes:
            raise ValueError(f"range {r.item}:{r.offset}+{r.nbytes} is outside the layout")
    return [ReadRange(item=r.item, offset=r.offset, nbytes=r.nbytes, source=source)
            for r in missing]
