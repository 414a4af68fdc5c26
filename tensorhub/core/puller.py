"""Carrying out a read plan: group ranges by source, read them, verify the bytes.

Kept apart from `Replica` so that engine plugins, which own their memory in their own way,
run the very same code path to pull a version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tensorhub.core.checksum import checksum
from tensorhub.core.data_types import MemoryDesc, ReadPlan, ReadRange
from tensorhub.core.errors import IntegrityError
from tensorhub.core.transport import Peer, ReadOp, Transport


@dataclass
class PullStats:
    """What one pull did; engines log it and the demo prints it."""

    model: str
    version: int
    sources: list[str]
    nbytes: int
    seconds: float
    verify_seconds: float = 0.0
    by_source: dict[str, int] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


BATCH_BYTES = 64 << 20  # progress is tracked per batch: a failure loses at most this much


def split(plan: ReadPlan, batch_bytes: int | None = None) -> list[ReadRange]:
    """The plan's ranges cut into pieces of at most `batch_bytes` (idempotent)."""
    batch_bytes = batch_bytes or BATCH_BYTES
    pieces = []
    for r in plan.ranges:
        for off in range(0, max(r.nbytes, 1), batch_bytes):
            n = min(batch_bytes, r.nbytes - off)
            pieces.append(r.model_copy(update={"offset": r.offset + off, "nbytes": n}))
    return pieces


def read_plan(transport: Transport, plan: ReadPlan, dest: list[torch.Tensor],
              timeout: float, done: set[tuple[int, int, int]] | None = None,
              stats: PullStats | None = None, batch_bytes: int | None = None) -> PullStats:
    """Read the ranges of `plan` into `dest` (one uint8 buffer per item), in batches of at
    most `batch_bytes`. Every range read is added to `done` (and ranges already in it are
    skipped), so after a `TransferError` (which names the failing source) the caller knows
    exactly which bytes are still missing and re-plans only those. `stats` (if given)
    accumulates across such attempts."""
    if len(dest) != len(plan.checksums):
        raise ValueError(f"{len(dest)} destination items for a plan of {len(plan.checksums)}")
    done = set() if done is None else done
    batch_bytes = batch_bytes or BATCH_BYTES
    sources = {s.worker_id: s for s in plan.sources}
    batches: list[tuple[str, list[ReadRange]]] = []
    for r in split(plan, batch_bytes):
        if r.key() in done:
            continue
        if batches and batches[-1][0] == r.source and \
                sum(x.nbytes for x in batches[-1][1]) + r.nbytes <= batch_bytes:
            batches[-1][1].append(r)
        else:
            batches.append((r.source, [r]))
    if stats is None:
        stats = PullStats(plan.model, plan.version, [], 0, 0.0)
    deadline = time.monotonic() + timeout
    for sid, ranges in batches:
        src = sources[sid]
        ops = []
        for r in ranges:
            m = src.memory[r.item]
            ops.append(ReadOp(
                local=dest[r.item][r.offset : r.offset + r.nbytes],
                remote=MemoryDesc(addr=m.addr + r.offset, nbytes=r.nbytes, device=m.device,
                                  mem=m.mem)))
        started = time.perf_counter()
        try:
            transport.read(Peer(sid, src.endpoint), ops,
                           timeout=max(0.001, deadline - time.monotonic()))
        finally:
            stats.seconds += time.perf_counter() - started
        done.update(r.key() for r in ranges)
        nbytes = sum(r.nbytes for r in ranges)
        if src.name not in stats.by_source:
            stats.sources.append(src.name)
        stats.by_source[src.name] = stats.by_source.get(src.name, 0) + nbytes
        stats.nbytes += nbytes
    return stats


def verify(plan: ReadPlan, dest: list[torch.Tensor]) -> float:
    """Compare each item's checksum with the version's; return the seconds it took."""
    started = time.perf_counter()
    for k, (buf, expected) in enumerate(zip(dest, plan.checksums, strict=True)):
        got = checksum(buf)
        if got != expected:
            raise IntegrityError(
                f"{plan.model} v{plan.version}: item {k} ({buf.numel()} bytes) has checksum "
                f"{got}, expected {expected}: torn or stale bytes, refusing them"
            )
    return time.perf_counter() - started
