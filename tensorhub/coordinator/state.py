"""What the coordinator knows, with no I/O: the reference table and the soft state derived
from it, the checks its handlers share, and the configuration.

One thread owns it (the socket loop in `server.py`, or the simulator's queue), so nothing
here locks. The handlers, grouped by concern in the modules beside this one, read and change
it; `dispatch.py` routes each request to its handler.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tensorhub import settings
from tensorhub.coordinator.forest import Forest
from tensorhub.coordinator.metrics import CoordinatorMetrics
from tensorhub.coordinator.owner_key import load_owner_key
from tensorhub.coordinator.owners import Owners, owner_key
from tensorhub.coordinator.parts import Pending
from tensorhub.coordinator.planner import PlannerConfig
from tensorhub.coordinator.prepare import Prepared
from tensorhub.coordinator.standby import StandingForests
from tensorhub.coordinator.table import (
    HolderRec,
    LayoutRec,
    ModelRec,
    Table,
    VersionRec,
    WorkerRec,
    store_memory,
)
from tensorhub.coordinator.trust import Trust, TrustConfig
from tensorhub.core.data_types import (
    Ack,
    Announcement,
    ErrorReply,
    Hold,
    Manifest,
    MemoryDesc,
    Part,
    Publish,
    Source,
)
from tensorhub.core.errors import LayoutError
from tensorhub.core.layout import check_manifest as check_layout
from tensorhub.core.layout import layout_id, plan_items
from tensorhub.core.transport import grants

log = logging.getLogger("tensorhub.coordinator")
ACK = Ack()  # every Ack is the same


@dataclass(frozen=True)
class CoordinatorConfig:
    bind: str = "tcp://127.0.0.1:5555"
    announce: str | None = None  # default: bind port + 1
    token: str | None = None
    heartbeat_interval: float = 1.0
    worker_ttl: float = 5.0
    lease_ttl: float = 120.0
    busy_retry: float = 0.05  # the longest a busy reader waits; less on links seen faster
    # Striped pulls (`forest.py`): stripes per version, and how a reader with no parent yet
    # for a stripe is told to wait (`pending_retry`), and for how long at most before it
    # takes any slot (`pending_grace`): only while readers keep arriving, one within
    # `pending_settle` of the last.
    stripes: int = 2
    pending_retry: float = 0.02
    pending_grace: float = 0.5
    pending_settle: float = 0.1
    # A sharded version (`Publish.parts`) is given up if its parts are not all in by then.
    part_wait: float = 120.0
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)
    # Addresses whose holders must have made a layout other than the publisher's, with
    # the same checksums, before readers are planned onto it (one on the publisher's own
    # address is enough: see `CoordinatorState.vouched`).
    layout_vouchers: int = 2
    # Open connections one address may hold (None: `settings.CONNECTIONS_PER_PEER`), at
    # most a quarter of the open-file limit (`connections.py`).
    connections_per_peer: int | None = None
    curve_secret: str | None = None  # Z85 secret key: CURVE on both sockets (core/curve.py)
    # The file model credentials' key is kept in, so that they outlive a restart (made at
    # the first start; `owner_key.py`). None: a key of this process's own (unless CURVE).
    owner_key_file: str | None = None


@dataclass(frozen=True, slots=True)
class Spliced:
    """A reply with parts encoded beforehand (`wire.encode`'s `packed`, by path): the
    socket sends them as they are; as a model (`model`) it is the reply itself."""

    reply: object
    packed: dict

    def model(self):
        return self.reply


class Reject(Exception):
    """Raised by a handler to answer with a typed error."""

    def __init__(self, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.reply = ErrorReply(code=code, message=message, retry_after=retry_after)


def source_of(worker: WorkerRec, memory: list[MemoryDesc], progress: MemoryDesc | None,
              reader: str) -> Source:
    """A holder as `reader` is told of it: who, where, its regions, and leave to read."""
    return Source(worker_id=worker.worker_id, name=worker.name, role=worker.role,
                  endpoint=worker.endpoint, memory=memory, progress=progress,
                  grant=grants.issue(worker.grant_key, reader))


class CoordinatorState:
    """The coordinator's records and the soft state derived from them. The handlers
    change it; the announcements it makes wait in `outbox` for whoever drives it."""

    def __init__(self, config: CoordinatorConfig = CoordinatorConfig(),
                 clock: Callable[[], float] = time.monotonic, announce_address: str = ""):
        """`clock`: the time source for liveness and leases (the simulator drives its own);
        `announce_address`: where workers subscribe to announcements (told in
        `Registered`)."""
        self.config = config
        self.clock = clock
        self.announce_address = announce_address
        self.metrics = CoordinatorMetrics()  # served by `Coordinator.serve_metrics`
        self.fleet_measured_at: float | None = None  # None: no metrics served, never
        # Announcements made, for the socket loop to publish (topic, bytes), oldest first.
        self.outbox: list[tuple[bytes, bytes]] = []
        self.owner_key = owner_key(config.curve_secret, load_owner_key(
            config.owner_key_file) if config.owner_key_file else None)  # (`owners.py`)
        # The address the request being handled came from, as the socket saw it (the
        # socket loop sets it per request; asked only by a registration): "" unknown.
        self.peer: Callable[[], str] = lambda: ""
        # A large request's manifest work, done beside the socket loop (`prepare.py`): set
        # while its handler runs
        self.prepared: Prepared | None = None
        self.start_over()

    def start_over(self) -> None:
        """Forget every worker, version and reference, as a restart does: the table and all
        the soft state derived from it, together (state left from an earlier table would
        name workers the new one does not know)."""
        self.table = Table(clock=self.clock)
        if not self.owner_key[1]:  # (a new process's key: older credentials fail)
            self.owner_key = owner_key(None)
        self.owners = Owners(*self.owner_key)  # who published each model first
        # model -> the newest version a trainer said it published, where nobody could show
        # the model's credential and no version was there to judge it by: holders may not
        # bring back versions past it (`holdings._brought_back`); it numbers nothing
        self.claims: dict[str, int] = {}
        self.trust = Trust(self.config.trust, self.clock)
        # holder -> {(model, version): until when}: a holder dropped on readers' reports
        # may not offer that version again before then; it is told in heartbeat replies
        self.probation: dict[str, dict[tuple[str, int], float]] = {}
        # (holder, model, version) on probation because readers found its bytes bad
        self.bad_bytes: set[tuple[str, str, int]] = set()
        self.stream_rate: float | None = None  # bytes/s of recent reads (moving average)
        self.workers_in_dc: Counter[str] = Counter()  # replicas by dc: readers to expect
        # what each address's registrations make us hold (`settings.MAX_*_PER_PEER`)
        self.peer_workers: Counter[str] = Counter()
        self.peer_metadata: Counter[str] = Counter()
        self.metadata_total = 0
        # model -> its newest announcement and its bytes (made once, asked for by every
        # idle watcher's fallback)
        self.announcements: dict[str, tuple[Announcement, bytes]] = {}
        self.outbox.clear()  # announcements of the forgotten table are not sent
        self.pending = Pending()  # sharded versions waiting for parts (`parts.py`)
        # readers placed ahead of a model's first version (`standby.py`)
        self.standby = StandingForests(self.config.stripes,
                                       self.config.planner.max_readers_per_holder,
                                       self.config.pending_grace)

    @staticmethod
    def witness(worker: WorkerRec) -> str:
        """What a worker is as a witness against a holder (`trust.py`): the address the
        coordinator saw it register from; else (no sockets: the simulator) its node."""
        return worker.peer or worker.labels.get("node", "") or worker.worker_id

    def vouched(self, vrec: VersionRec, lid: str, layout: LayoutRec) -> bool:
        """Whether readers may be planned onto `layout` of `vrec`. The publisher's layouts
        are its word. Any other layout's checksums come from its holders, so a token holder
        could hold bytes the trainer never published under them: such a layout is served
        once holders at `layout_vouchers` addresses made it (converted it from what they
        pulled, never read it) with the same checksums, or one on an address the publisher
        holds the version from (the coordinator tells processes apart by address only)."""
        if layout.vouched or lid in vrec.part_ids:
            return True
        workers = self.table.workers
        layout.vouched = len(layout.vouchers) >= self.config.layout_vouchers or any(
            self.witness(w) in layout.vouchers
            for part in vrec.part_layouts() if part is not None
            for h in part.holders.values()
            if (w := workers.get(h.worker_id)) is not None and w.role == "trainer")
        return layout.vouched

    def worker(self, worker_id: str) -> WorkerRec:
        worker = self.table.workers.get(worker_id)
        if worker is None:
            raise Reject("unknown_worker",
                         f"worker {worker_id} is not registered (coordinator restarted, "
                         f"or it timed out): register again")
        worker.last_seen = self.clock()
        return worker

    def model(self, model: str) -> ModelRec:
        mrec = self.table.models.get(model)
        if mrec is None:
            known = ", ".join(sorted(self.table.models)) or "none"
            raise Reject("unknown_model", f"model {model!r} has no versions (known: {known})")
        return mrec

    def resolve(self, model: str, version) -> tuple[ModelRec, VersionRec]:
        mrec = self.model(model)
        v = mrec.latest if version == "latest" else version
        vrec = mrec.versions.get(v)
        if vrec is None:
            raise Reject("unknown_version",
                         f"model {model!r} has no version {v} (latest is {mrec.latest})")
        return mrec, vrec

    def part_layout(self, vrec: VersionRec, part: int, model: str) -> tuple[str, LayoutRec]:
        """Part `part` of a version (0: the whole of an unsharded one)."""
        lids = vrec.part_ids
        if part >= len(lids):
            raise Reject("bad_request", f"{model!r} v{vrec.version} has {len(lids)} part(s), "
                         f"not a part {part}")
        lid = lids[part]
        if lid is None or lid not in vrec.layouts:
            raise Reject("no_holder", f"no holder of part {part} of {model!r} "
                         f"v{vrec.version} is back yet (coordinator restarted)",
                         retry_after=0.2)
        return lid, vrec.layouts[lid]

    def check_memory(self, layout: LayoutRec, memory: list[MemoryDesc]) -> None:
        if len(memory) != len(layout.items):
            raise Reject("layout_mismatch",
                         f"{len(memory)} memory regions for a layout of {len(layout.items)} items")
        for k, (m, item) in enumerate(zip(memory, layout.items, strict=True)):
            if m.nbytes != item.nbytes:
                raise Reject("layout_mismatch",
                             f"item {k}: {m.nbytes} bytes registered, layout says {item.nbytes}")

    @staticmethod
    def check_manifest(manifest: Manifest) -> None:
        try:
            check_layout(manifest)
        except LayoutError as exc:
            raise Reject("bad_request", f"manifest: {exc}") from None

    def new_layout(self, manifest, checksums) -> tuple[str, LayoutRec]:
        prepared = self.prepared
        if prepared is not None and prepared.manifest is manifest:  # (done beside the loop)
            items, lid = prepared.items, prepared.layout_id
        else:
            self.check_manifest(manifest)
            items, lid, prepared = plan_items(manifest), None, None
        if checksums is None or len(checksums) != len(items):
            raise Reject("bad_request",
                         f"need one checksum per item ({len(items)}), got "
                         f"{0 if checksums is None else len(checksums)}")
        layout = LayoutRec(manifest, items, list(checksums))
        if prepared is not None and prepared.packed is not None:
            layout._packed = prepared.packed
        return lid or layout_id(manifest), layout

    def update_endpoint(self, worker: WorkerRec, endpoint) -> None:
        if endpoint is not None:
            if endpoint.transport != worker.endpoint.transport:
                raise Reject("bad_request", "a worker cannot change transport")
            self.account_metadata(worker, endpoint)
            worker.endpoint = endpoint

    def account_metadata(self, worker: WorkerRec, endpoint) -> None:
        """`worker`'s transport metadata becomes `endpoint`'s: refused past the caps on
        what one address, and all workers, may make the coordinator hold."""
        new = len(endpoint.agent_metadata or b"")
        delta = new - worker.meta_bytes
        if delta > 0:
            peer = worker.peer
            if peer and self.peer_metadata[peer] + delta > settings.MAX_METADATA_PER_PEER:
                raise Reject("bad_request", f"workers registered from {peer} hold "
                             f"{self.peer_metadata[peer] / 2**20:.0f} MiB of transport "
                             f"metadata already (at most "
                             f"{settings.MAX_METADATA_PER_PEER / 2**20:.0f} MiB an address)")
            if self.metadata_total + delta > settings.MAX_METADATA_TOTAL:
                raise Reject("bad_request", "the coordinator holds its most of workers' "
                             "transport metadata")
        if worker.peer:
            self.peer_metadata[worker.peer] += delta
        self.metadata_total += delta
        worker.meta_bytes = new

    def release_metadata(self, worker: WorkerRec) -> None:
        """A worker is forgotten: what it counted against its address goes."""
        self.metadata_total -= worker.meta_bytes
        if worker.peer:
            self.peer_metadata[worker.peer] -= worker.meta_bytes
            self.peer_workers[worker.peer] -= 1
            if self.peer_workers[worker.peer] <= 0:
                del self.peer_workers[worker.peer]
                self.peer_metadata.pop(worker.peer, None)
        worker.meta_bytes = 0

    def held_layout(self, req: Publish | Hold, worker: WorkerRec) -> tuple[str, LayoutRec]:
        """The layout `req` describes, checked against the memory it registers, with
        `worker` as its holder (stored by the caller)."""
        lid, layout = self.new_layout(req.manifest, req.checksums)
        self.check_memory(layout, req.memory)
        self.update_endpoint(worker, req.endpoint)
        layout.holders[worker.worker_id] = HolderRec(worker.worker_id, store_memory(req.memory))
        return lid, layout

    def forest(self, layout: LayoutRec) -> Forest:
        """The layout's forest, begun at its first striped reader with the complete holders
        there are as roots."""
        if layout.forest is None:
            layout.forest = Forest(self.config.stripes, self.config.planner.max_readers_per_holder,
                                   self.config.pending_grace, self.config.pending_settle)
            roots = [(h.worker_id, worker) for h in layout.holders.values()
                     if (worker := self.table.workers.get(h.worker_id)) is not None
                     and not h.withdrawn]
            layout.forest.publisher = next(
                (wid for wid, worker in roots if worker.role == "trainer"), None)
            for wid, worker in roots:
                layout.forest.add_root(wid, worker.labels.get("dc", ""),
                                       reader=worker.role == "replica")
        return layout.forest

    def finish_withdrawals(self, holders, model: str, version: int) -> None:
        mrec = self.table.models.get(model)
        vrec = mrec.versions.get(version) if mrec else None
        if vrec is None:
            return
        for layout in vrec.layouts.values():
            for hid in holders:  # the lease's few sources, not every holder (O(fleet))
                rec = layout.holders.get(hid)
                if rec is not None and rec.withdrawn \
                        and self.table.active_reads(hid, model, version) == 0:
                    del layout.holders[hid]
        self.table.prune()

    def end_probation(self, worker_id: str, model: str, version: int) -> None:
        dropped = self.probation.get(worker_id)
        self.bad_bytes.discard((worker_id, model, version))
        if dropped is not None:
            dropped.pop((model, version), None)
            if not dropped:
                del self.probation[worker_id]

    def holds_complete(self, worker_id: str, model: str, version: int) -> bool:
        """Whether `worker_id` holds (a part of) `version` completely: a reader still
        pulling it (a relay) has nothing to offer again, and ends its pull as usual."""
        mrec = self.table.models.get(model)
        vrec = mrec.versions.get(version) if mrec else None
        return vrec is not None and any(
            (h := layout.holders.get(worker_id)) is not None and not h.withdrawn
            for layout in vrec.layouts.values())

    def last_complete_holder(self, worker_id: str, model: str, version: int) -> bool:
        """Whether `worker_id` holds `version` completely and nobody else does (a partial
        holder never is: the version survives it)."""
        mrec = self.table.models.get(model)
        vrec = mrec.versions.get(version) if mrec else None
        if vrec is None:
            return False
        if vrec.parts is not None:  # the last holder of any one part
            return any(layout is not None and {h.worker_id for h in layout.holders.values()
                                               if not h.withdrawn} == {worker_id}
                       for layout in vrec.part_layouts())
        complete = {h.worker_id for layout in vrec.layouts.values()
                    for h in layout.holders.values() if not h.withdrawn}
        return complete == {worker_id}

    def complete_holders(self, vrec: VersionRec) -> int:
        """Readers holding the version completely: every part, for a sharded one (by the
        name each part's worker has, `Part.worker_name`), or their share of a version in
        tiles (`holds_every_part`)."""
        if vrec.parts is None:
            return len({h.worker_id for layout in vrec.layouts.values()
                        for h in layout.holders.values() if not h.withdrawn})
        names = set()
        for r, layout in enumerate(vrec.part_layouts()):
            suffix = Part.worker_name("", r)
            for h in layout.holders.values() if layout is not None else ():
                w = self.table.workers.get(h.worker_id)
                if not h.withdrawn and w is not None and w.name.endswith(suffix):
                    names.add(w.name[:len(w.name) - len(suffix)])
        return sum(self.holds_every_part(name, vrec) for name in names)

    def holds_every_part(self, name: str, vrec: VersionRec) -> bool:
        """A reader named `name` holds every part of a sharded version, each by the worker
        it runs for that part (`Part.worker_name`): every live worker of that name (a name
        is its worker's choice, see `holdings.holdings`). Of a version in tiles
        (`tensorhub/tiles.py`) it holds its share: the part every rank loads whole, and
        each tile a live worker of its name runs for (one at least); of a version in layer
        blocks (`tensorhub/stages.py`), each part a live worker of its name runs for (a
        pipeline stage's)."""
        layouts = vrec.part_layouts()
        first = next((lr.manifest for lr in layouts if lr is not None), None)
        tiles = first.tiles if first is not None else None
        blocks = first.blocks if first is not None else None
        held = 0
        for r, layout in enumerate(layouts):
            part_name = Part.worker_name(name, r)
            if ((tiles is not None and r != tiles) or blocks is not None) \
                    and not self.table.named[part_name]:
                continue  # (a part outside its share)
            workers = self.table.workers
            holding = sum(1 for h in layout.holders.values() if not h.withdrawn
                          and (w := workers.get(h.worker_id)) is not None
                          and w.name == part_name) if layout is not None else 0
            if not holding or holding != self.table.named[part_name]:
                return False
            held += 1
        return held >= 2 if tiles is not None else held >= 1

    def abort(self, key: tuple[str, int], reason: str) -> None:
        if self.pending.abort(key, reason) is not None:
            log.warning("%s v%d given up before all its parts were in: %s", *key, reason)

    def layout(self, model: str, version: int, layout_id: str) -> LayoutRec | None:
        mrec = self.table.models.get(model)
        vrec = mrec.versions.get(version) if mrec else None
        return vrec.layouts.get(layout_id) if vrec else None
