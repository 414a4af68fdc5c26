"""The reference table: which workers hold which immutable version, and who reads from whom.

Soft state only: every record here can be rebuilt from what live workers re-register after
a coordinator restart. No weights are stored, only references to holders' memory.
"""

from __future__ import annotations

import itertools
import operator
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgpack
from pydantic import TypeAdapter

from tensorhub.coordinator.forest import Forest
from tensorhub.core.chunks import CHUNK_BYTES, Chunk, chunks_of
from tensorhub.core.data_types import (
    Endpoint,
    Manifest,
    MemoryDesc,
    PullProgress,
    TransferRecord,
)
from tensorhub.core.layout import Item
from tensorhub.core.wire import Packed, encode

_seq = itertools.count()

# A holder's memory regions as the table keeps them: one tuple of plain tuples. Tuples of
# ints and strings are untracked by Python's garbage collector, whereas 4096 holders of a
# 129-item layout as `MemoryDesc` models were 530k tracked objects that made each full
# collection stop the coordinator for ~175 ms (its plan latency p99).
StoredMemory = tuple[tuple[int, int, int, str], ...]
_memory_list = TypeAdapter(list[MemoryDesc])


def store_memory(memory: list[MemoryDesc]) -> StoredMemory:
    return tuple((m.addr, m.nbytes, m.device, m.mem) for m in memory)


def pack_memory(stored: StoredMemory) -> bytes:
    """The regions as a plan's source carries them on the wire: a msgpack list of
    `MemoryDesc` maps (the bytes `encode` makes of `load_memory(stored)`)."""
    return msgpack.packb([{"addr": a, "nbytes": n, "device": d, "mem": k}
                          for a, n, d, k in stored], use_bin_type=True)


def load_memory(stored: StoredMemory) -> list[MemoryDesc]:
    """The regions as models for a reply (validating dicts in pydantic-core is 2.5x faster
    than `model_construct` in Python: ~0.1 ms for 129 regions)."""
    return _memory_list.validate_python(
        [{"addr": a, "nbytes": n, "device": d, "mem": k} for a, n, d, k in stored])


# Records kept per worker, holder or read are slotted: no instance dict each (a 4096-worker
# table is walked by every full garbage collection, one pause for every request in flight).
@dataclass(slots=True)
class WorkerRec:
    worker_id: str
    name: str
    role: str
    endpoint: Endpoint
    labels: dict[str, str]
    last_seen: float
    seq: int = field(default_factory=lambda: next(_seq))
    progress: MemoryDesc | None = None  # its progress bytes (striped pulls)
    pull: PullProgress | None = None  # its pull in flight, as of its last heartbeat
    secret: str = ""  # what its requests must show (`Envelope.secret`)
    grant_key: str | None = None  # what its readers' grants are made with
    # The address its registration came from, as the coordinator's socket saw it ("" in
    # the simulator): what it is as a witness against a holder (`trust.py`).
    peer: str = ""
    meta_bytes: int = 0  # its endpoint's transport metadata (counted against its address)


class _PackedMemory:
    """A copy's `memory` as plans carry it, encoded at the first plan from it (bytes, which
    the collector does not track; ~45 us a plan otherwise, for 129 regions)."""

    __slots__ = ()
    memory: StoredMemory
    packed: bytes | None

    def packed_memory(self) -> bytes:
        if self.packed is None:
            self.packed = pack_memory(self.memory)
        return self.packed


@dataclass(slots=True)
class HolderRec(_PackedMemory):
    worker_id: str
    memory: StoredMemory
    withdrawn: bool = False
    packed: bytes | None = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class PartialRec(_PackedMemory):
    """A reader still pulling a version: it serves the chunks it has finished (its
    children learn which by polling its progress bytes)."""

    worker_id: str
    memory: StoredMemory
    packed: bytes | None = field(default=None, repr=False, compare=False)


class PartialHolders(dict[str, PartialRec]):
    """Partial holders of one layout (readers still pulling it, which serve what they
    have); `version` is bumped by every change of membership (`LayoutRec.serving`)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0  # bumped when a worker is added or dropped (the planner caches)

    def add(self, worker_id: str, memory: StoredMemory) -> None:
        rec = self.get(worker_id)
        if rec is None:
            rec = PartialRec(worker_id, memory)
            super().__setitem__(worker_id, rec)
            self.version += 1
        if rec.memory is not memory:
            rec.memory, rec.packed = memory, None

    def drop(self, worker_id: str) -> None:
        if super().pop(worker_id, None) is not None:
            self.version += 1


class CompleteHolders(dict[str, HolderRec]):
    """Complete holders of one layout; `version` is bumped by every change of membership, so
    the planner's cached holder list is rebuilt when one holder leaves and another joins
    (a count alone would not change)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 0

    def __setitem__(self, worker_id: str, rec: HolderRec) -> None:
        super().__setitem__(worker_id, rec)
        self.version += 1

    def __delitem__(self, worker_id: str) -> None:
        super().__delitem__(worker_id)
        self.version += 1

    def pop(self, worker_id: str, *default):  # type: ignore[override]
        self.version += 1
        return super().pop(worker_id, *default)


@dataclass
class LayoutRec:
    manifest: Manifest
    items: list[Item]
    checksums: list[str]
    holders: CompleteHolders = field(default_factory=CompleteHolders)  # complete copies
    partial: PartialHolders = field(default_factory=PartialHolders)
    _chunks: tuple[int, list[Chunk]] | None = None
    # the planner's list of holder ids (complete, then partial), kept while membership stays
    _serving: tuple[tuple[int, int], list[str]] | None = None
    _packed: tuple[Packed, Packed] | None = None  # manifest and checksums, msgpack-encoded
    _nbytes: int | None = None
    # Striped pulls: who reads which stripe from whom, and each reader's one lease.
    forest: Forest | None = None
    previous_forest: Forest | None = None  # the last version's, in this layout (`adopt`)
    striped_leases: dict[str, str] = field(default_factory=dict)  # reader -> lease id
    # Holders disagreed on its checksums (a layout not the publisher's, whose bytes only
    # its holders vouch for): no reads are planned from it; readers take the publisher's.
    untrusted: bool = False
    # A layout not the publisher's is read from only once enough witnesses vouch for its
    # checksums (`CoordinatorState.vouched`): the addresses of holders that made it
    # themselves, never of those that read it (`relays`: a relay repeats what it read).
    vouchers: set[str] = field(default_factory=set)
    relays: set[str] = field(default_factory=set)
    vouched: bool = False  # (once vouched for, it stays: its checksums never change)

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            self._nbytes = sum(i.nbytes for i in self.items)
        return self._nbytes

    def packed_manifest(self) -> tuple[Packed, Packed]:
        """The manifest and checksums as plans carry them, encoded once (both immutable):
        a model of thousands of tensors made encoding them most of a first plan's cost."""
        if self._packed is None:
            self._packed = (Packed(encode(self.manifest)),
                            Packed(msgpack.packb(self.checksums, use_bin_type=True)))
        return self._packed

    def serving(self) -> list[str]:
        """Complete (not withdrawn) then partial holders' ids, rebuilt only when the
        partial or the complete holders changed (membership): callers check each id again
        (a holder that withdrew or left since is skipped), so a plan costs O(its scan)."""
        key = (self.partial.version, self.holders.version)
        if self._serving is None or self._serving[0] != key:
            ids = [h.worker_id for h in self.holders.values() if not h.withdrawn]
            ids += [p for p in self.partial if p not in self.holders]
            self._serving = (key, ids)
        return self._serving[1]

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> list[Chunk]:
        if self._chunks is None or self._chunks[0] != chunk_bytes:
            self._chunks = (chunk_bytes, chunks_of(self.items, chunk_bytes))
        return self._chunks[1]


@dataclass
class VersionRec:
    version: int
    origin_layout: str  # the checkpoint layout (of part 0, for a sharded version)
    layouts: dict[str, LayoutRec] = field(default_factory=dict)
    # A sharded version: its parts' layout ids, in part order (None: a part not back yet
    # after a restart). Holding the version means holding every part.
    parts: list[str | None] | None = None

    @property
    def part_ids(self) -> list[str | None]:
        """Layout id of each part: the origin alone for an unsharded version."""
        return self.parts if self.parts is not None else [self.origin_layout]

    def part_layouts(self) -> list[LayoutRec | None]:
        """Each part's record (None: not back yet after a restart)."""
        return [self.layouts.get(lid) if lid is not None else None for lid in self.part_ids]


@dataclass
class ModelRec:
    latest: int = 0
    versions: dict[int, VersionRec] = field(default_factory=dict)
    # A trainer published it since this coordinator started: from then on versions come
    # from publishes only, never from a holder's word (before, holders restore them).
    published: bool = False


@dataclass(slots=True)
class Lease:
    """A reader's right to read (model, version, layout) from `sources` until it ends."""

    lease_id: str
    reader: str
    model: str
    version: int
    layout_id: str
    sources: set[str]
    expires: float
    started: float = 0.0


class Leases(dict[str, Lease]):
    """Leases by id, with the counts the planner asks for on every plan kept up to date on
    insert and removal (counting over all leases made planning O(fleet) per holder)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_holder: Counter[str] = Counter()
        self.by_holder_version: Counter[tuple[str, str, int]] = Counter()

    def _count(self, lease: Lease, step: int) -> None:
        for sid in lease.sources:
            self.by_holder[sid] += step
            self.by_holder_version[(sid, lease.model, lease.version)] += step

    def __setitem__(self, key: str, lease: Lease) -> None:
        old = self.get(key)
        if old is not None:
            self._count(old, -1)
        super().__setitem__(key, lease)
        self._count(lease, 1)

    def __delitem__(self, key: str) -> None:
        self._count(self[key], -1)
        super().__delitem__(key)

    _missing = object()

    def pop(self, key, default=_missing):  # type: ignore[override]
        if key in self:
            lease = super().pop(key)
            self._count(lease, -1)
            return lease
        if default is Leases._missing:
            raise KeyError(key)
        return default

    def _unsupported(self, *args, **kwargs):
        raise TypeError("Leases: use [k] = v, del, or pop (the counts must stay right)")

    popitem = setdefault = update = clear = _unsupported  # type: ignore[assignment]


_TRANSFER_FIELDS = tuple(TransferRecord.model_fields)
_transfer_row = operator.attrgetter(*_TRANSFER_FIELDS)  # a record's fields as a tuple
assert _TRANSFER_FIELDS[-1] == "ended_at"  # (`Transfers.append` stamps the last field)


class Transfers:
    """The latest transfers, oldest first, read as `TransferRecord`s but kept as plain
    tuples: tuples of strings and numbers are untracked by the garbage collector, whereas
    10,000 records as models were 20k objects that every full collection walked."""

    def __init__(self) -> None:
        self._rows: deque[tuple] = deque()

    @staticmethod
    def _model(row: tuple) -> TransferRecord:
        return TransferRecord(**dict(zip(_TRANSFER_FIELDS, row, strict=True)))

    def append(self, rec: TransferRecord) -> None:
        row = _transfer_row(rec)
        if rec.ended_at is None:  # (the last field: stamped as it is recorded)
            row = (*row[:-1], time.time())
        self._rows.append(row)

    def keep_last(self, count: int) -> None:
        while len(self._rows) > count:
            self._rows.popleft()

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._model(row) for row in list(self._rows)[index]]
        return self._model(self._rows[index])

    def __iter__(self) -> Iterator[TransferRecord]:
        return (self._model(row) for row in self._rows)


@dataclass
class Table:
    workers: dict[str, WorkerRec] = field(default_factory=dict)
    # live workers by name (names are the workers' choice: several may share one), kept
    # by `membership` as workers come and go, so that no holdings question walks them all
    named: Counter[str] = field(default_factory=Counter)
    models: dict[str, ModelRec] = field(default_factory=dict)
    leases: Leases = field(default_factory=Leases)
    transfers: Transfers = field(default_factory=Transfers)
    max_transfers: int = 10_000
    # reader name -> (its worker id, its last whole pull): what engines' front ends count
    last_pull: dict[str, tuple[str, TransferRecord]] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic  # injectable: the simulator's clock
    plans: int = 0  # whole-item plans made: rotates where the planner starts looking

    def new_lease(self, reader: str, model: str, version: int, layout_id: str,
                  sources: set[str], ttl: float, lease_id: str | None = None) -> Lease:
        now = self.clock()
        lease = Lease(lease_id or uuid.uuid4().hex, reader, model, version, layout_id,
                      sources, now + ttl, now)
        self.leases[lease.lease_id] = lease
        return lease

    def active_reads(self, holder: str, model: str | None = None,
                     version: int | None = None) -> int:
        if model is None and version is None:
            return self.leases.by_holder[holder]
        if model is not None and version is not None:
            return self.leases.by_holder_version[(holder, model, version)]
        return sum(
            1
            for lease in self.leases.values()
            if holder in lease.sources
            and (model is None or lease.model == model)
            and (version is None or lease.version == version)
        )

    def record(self, rec: TransferRecord) -> None:
        self.transfers.append(rec)
        self.transfers.keep_last(self.max_transfers)

    def drop_holder(self, worker_id: str, model: str | None = None,
                    version: int | None = None, gone: bool = False) -> None:
        """Remove a worker's references (all, or of one model/version); `gone`: the worker
        left the fleet, so no forest may adopt it later either."""
        for mname, mrec in self.models.items():
            if model is not None and mname != model:
                continue
            for v, vrec in mrec.versions.items():
                if version is not None and v != version:
                    continue
                for lrec in vrec.layouts.values():
                    lrec.holders.pop(worker_id, None)
                    lrec.partial.drop(worker_id)
                    if lrec.forest is not None:
                        (lrec.forest.forget if gone else lrec.forest.remove)(worker_id)
        self.prune()

    def drop_partial(self, worker_id: str, model: str, version: int) -> None:
        """Forget that a reader serves the chunks it had of (model, version)."""
        vrec = self.models[model].versions.get(version) if model in self.models else None
        for lrec in vrec.layouts.values() if vrec else []:
            lrec.partial.drop(worker_id)
            if lrec.forest is not None:
                lrec.forest.remove(worker_id, keep_history=True)

    def prune(self) -> None:
        """Forget versions nobody holds any more, except each model's latest."""
        for mrec in self.models.values():
            for v in [v for v, vrec in mrec.versions.items()
                      if v != mrec.latest and not _held(vrec)]:
                del mrec.versions[v]


def _held(vrec: VersionRec) -> bool:
    """Someone holds the version: a layout of it, or every part of a sharded one."""
    if vrec.parts is not None:
        return all(layout is not None and layout.holders for layout in vrec.part_layouts())
    return any(lr.holders for lr in vrec.layouts.values())
