"""The reference table: which workers hold which immutable version, and who reads from whom.

Soft state only: every record here can be rebuilt from what live workers re-register after
a coordinator restart. No weights are stored, only references to holders' memory.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field

from tensorhub.core.data_types import Endpoint, Item, Manifest, MemoryDesc, TransferRecord

_seq = itertools.count()


@dataclass
class WorkerRec:
    worker_id: str
    name: str
    role: str
    endpoint: Endpoint
    labels: dict[str, str]
    last_seen: float
    seq: int = field(default_factory=lambda: next(_seq))


@dataclass
class HolderRec:
    worker_id: str
    memory: list[MemoryDesc]
    withdrawn: bool = False


@dataclass
class LayoutRec:
    manifest: Manifest
    items: list[Item]
    checksums: list[str]
    holders: dict[str, HolderRec] = field(default_factory=dict)


@dataclass
class VersionRec:
    version: int
    origin_layout: str
    layouts: dict[str, LayoutRec] = field(default_factory=dict)


@dataclass
class ModelRec:
    latest: int = 0
    versions: dict[int, VersionRec] = field(default_factory=dict)


@dataclass
class Lease:
    """A reader's right to read (model, version, layout) from `sources` until it ends."""

    lease_id: str
    reader: str
    model: str
    version: int
    layout_id: str
    sources: set[str]
    expires: float
    started: float = field(default_factory=time.monotonic)


@dataclass
class Table:
    workers: dict[str, WorkerRec] = field(default_factory=dict)
    models: dict[str, ModelRec] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    transfers: list[TransferRecord] = field(default_factory=list)
    max_transfers: int = 10_000

    def new_lease(self, reader: str, model: str, version: int, layout_id: str,
                  sources: set[str], ttl: float) -> Lease:
        lease = Lease(uuid.uuid4().hex, reader, model, version, layout_id, sources,
                      time.monotonic() + ttl)
        self.leases[lease.lease_id] = lease
        return lease

    def active_reads(self, holder: str, model: str | None = None,
                     version: int | None = None) -> int:
        return sum(
            1
            for lease in self.leases.values()
            if holder in lease.sources
            and (model is None or lease.model == model)
            and (version is None or lease.version == version)
        )

    def record(self, rec: TransferRecord) -> None:
        self.transfers.append(rec)
        if len(self.transfers) > self.max_transfers:
            del self.transfers[: len(self.transfers) - self.max_transfers]

    def drop_holder(self, worker_id: str, model: str | None = None,
                    version: int | None = None) -> None:
        """Remove a worker's references (all, or of one model/version)."""
        for mname, mrec in self.models.items():
            if model is not None and mname != model:
                continue
            for v, vrec in mrec.versions.items():
                if version is not None and v != version:
                    continue
                for lrec in vrec.layouts.values():
                    lrec.holders.pop(worker_id, None)
        self.prune()

    def prune(self) -> None:
        """Forget versions nobody holds any more, except each model's latest."""
        for mrec in self.models.values():
            for v in [v for v, vrec in mrec.versions.items()
                      if v != mrec.latest
                      and not any(lr.holders for lr in vrec.layouts.values())]:
                del mrec.versions[v]
