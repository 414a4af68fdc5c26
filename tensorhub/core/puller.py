"""Carrying out a read plan: group ranges by source, read them, verify the bytes.

Kept apart from `Replica` so that engine plugins, which own their memory in their own way,
run the very same code path to pull a version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tensorhub.core.checksum import checksum
from tensorhub.core.data_types import MemoryDesc, ReadPlan
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


def read_plan(transport: Transport, plan: ReadPlan, dest: list[torch.Tensor],
              timeout: float) -> PullStats:
    """Read every range of `plan` into `dest` (one uint8 buffer per item). Raises
    `TransferError` naming the failing source."""
    if len(dest) != len(plan.checksums):
        raise ValueError(f"{len(dest)} destination items for a plan of {len(plan.checksums)}")
    sources = {s.worker_id: s for s in plan.sources}
    by_source: dict[str, list[ReadOp]] = {}
    for r in plan.ranges:
        src = sources[r.source]
        m = src.memory[r.item]
        remote = MemoryDesc(addr=m.addr + r.offset, nbytes=r.nbytes, device=m.device, mem=m.mem)
        local = dest[r.item][r.offset : r.offset + r.nbytes]
        by_source.setdefault(r.source, []).append(ReadOp(local=local, remote=remote))
    started = time.perf_counter()
    deadline = time.monotonic() + timeout
    counted: dict[str, int] = {}
    for sid, ops in by_source.items():
        transport.read(Peer(sid, sources[sid].endpoint), ops,
                       timeout=max(0.001, deadline - time.monotonic()))
        counted[sources[sid].name] = sum(op.remote.nbytes for op in ops)
    seconds = time.perf_counter() - started
    return PullStats(model=plan.model, version=plan.version,
                     sources=[sources[s].name for s in by_source], nbytes=sum(counted.values()),
                     seconds=seconds, by_source=counted)


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
