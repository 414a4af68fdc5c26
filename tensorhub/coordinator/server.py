"""The coordinator: a ZeroMQ ROUTER answering typed requests, a PUB announcing versions.

One thread owns all state, so handlers need no locks; it wakes at least every 100 ms to
expire silent workers and stale leases. Every request gets a typed reply: a malformed,
oversized, unauthorised or simply wrong request gets an `ErrorReply` saying why, and the
coordinator goes on serving.
"""

from __future__ import annotations

import gc
import hmac
import logging
import secrets
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import msgpack
import zmq

from tensorhub.coordinator.forest import Forest
from tensorhub.coordinator.metrics import CoordinatorMetrics
from tensorhub.coordinator.parts import Pending, PendingPart, PendingVersion, check_parts_fit
from tensorhub.coordinator.planner import NoSource, PlannerConfig, distance, plan_ranges
from tensorhub.coordinator.standby import StandingForests
from tensorhub.coordinator.table import (
    HolderRec,
    LayoutRec,
    ModelRec,
    PartialRec,
    Table,
    VersionRec,
    WorkerRec,
    load_memory,
    store_memory,
)
from tensorhub.coordinator.trust import Trust, TrustConfig
from tensorhub.core import curve
from tensorhub.core.data_types import (
    PUBLISHER,
    Ack,
    Announcement,
    ConfirmParents,
    Declare,
    Declared,
    Dropped,
    ErrorReply,
    GetDeclared,
    GetManifest,
    Heartbeat,
    HeartbeatReply,
    Hold,
    HolderStatus,
    HoldingsReply,
    HoldingsRequest,
    LatestRequest,
    Manifest,
    ManifestReply,
    MemoryDesc,
    ModelStatus,
    Part,
    Placement,
    PlanRequest,
    Progress,
    Publish,
    Published,
    PublishStatus,
    PublishStatusReply,
    PullInFlight,
    ReadDone,
    ReadPlan,
    ReadRange,
    Register,
    Registered,
    ReplanStripes,
    Retention,
    RetentionRequest,
    Source,
    StandBy,
    StatusReply,
    StatusRequest,
    StripedPlanRequest,
    StripedRequest,
    TransferRecord,
    Unregister,
    VersionStatus,
    Withdraw,
    Withdrawn,
)
from tensorhub.core.errors import LayoutError
from tensorhub.core.layout import check_manifest, layout_id, plan_items
from tensorhub.core.memory import regions_digest
from tensorhub.core.stripes import PROGRESS_BYTES, warm_lease_id
from tensorhub.core.transport import grants
from tensorhub.core.transport.grants import ANY_READER
from tensorhub.core.wire import (
    MAX_MESSAGE_BYTES,
    Packed,
    WireError,
    decode_envelope,
    encode,
    encode_array,
    encode_map,
    foreign,
)

log = logging.getLogger("tensorhub.coordinator")
# Seconds between walks of the table for workers that stopped heartbeating and expired
# leases (TTLs are seconds: a tenth of a second late is within their slack).
EXPIRY_PERIOD = 0.1
FLEET_PERIOD = 1.0  # seconds between measurements of the fleet's shape (metrics served)
# A gap this long between two reads of the queue (each waits at most 0.1 s) means the
# coordinator itself was not listening: see `Coordinator.forgive_pause`.
PAUSE_FORGIVEN = 1.0


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
    # takes any slot (`pending_grace`).
    stripes: int = 2
    pending_retry: float = 0.02
    pending_grace: float = 0.5
    # A sharded version (`Publish.parts`) is given up if its parts are not all in by then.
    part_wait: float = 120.0
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    trust: TrustConfig = field(default_factory=TrustConfig)
    curve_secret: str | None = None  # Z85 secret key: CURVE on both sockets (core/curve.py)


class Reject(Exception):
    """Raised by a handler to answer with a typed error."""

    def __init__(self, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.reply = ErrorReply(code=code, message=message, retry_after=retry_after)


BUSY_RETRY_MIN = 0.005  # s: a floor, so a fleet on fast links does not poll in a loop
_SEND_MORE = zmq.SNDMORE | zmq.NOBLOCK
# Every Ack is the same: one model, encoded once (heartbeats alone are thousands a second).
_ACK = Ack()
_ACK_BYTES = encode(_ACK)
_NO_MANIFEST = (Packed(msgpack.packb(None)),) * 2
_PLAN_REQUESTS = (PlanRequest, StripedPlanRequest, ReplanStripes, ConfirmParents)


@dataclass(slots=True)
class _Plan:
    """A read plan as the planner left it: made into a `ReadPlan` (`handle`, the handlers)
    or, on the socket, straight into its msgpack bytes. There the sources' memory regions
    never become models: validating 129 `MemoryDesc` per source, only to encode them at once,
    was a third of a plan's CPU, and garbage the collector had to walk (both make the same
    bytes: `tests/test_coordinator.py`)."""

    model: str
    version: int
    layout_id: str
    layout: LayoutRec
    manifest: bool  # carry the manifest and checksums (the reader does not have them)
    lease_id: str
    lease_ttl: float
    sources: list[tuple[WorkerRec, HolderRec | PartialRec]]  # with their memory regions
    ranges: list[ReadRange]
    chunk_bytes: int | None = None  # striped plans only
    complete: bool = True
    stripes: list[str | None] | None = None  # striped plans: a parent per stripe
    retry_after: float | None = None
    progress: dict[str, MemoryDesc] | None = None  # striped: the sources' progress bytes
    holding: list[str] | None = None  # striped: the sources that hold every chunk
    reader: str = ANY_READER  # whom the sources' grants are for

    def _progress_of(self, worker_id: str) -> MemoryDesc | None:
        return self.progress.get(worker_id) if self.progress else None

    def reply(self) -> ReadPlan:
        striped = {} if self.stripes is None else {
            "complete": self.complete, "chunk_bytes": self.chunk_bytes, "stripes": self.stripes,
            "retry_after": self.retry_after, "holding": self.holding}
        layout = self.layout
        return ReadPlan(
            model=self.model, version=self.version, layout_id=self.layout_id,
            manifest=layout.manifest if self.manifest else None,
            checksums=layout.checksums if self.manifest else None,
            lease_id=self.lease_id, lease_ttl=self.lease_ttl,
            sources=[source_of(w, load_memory(rec.memory), self._progress_of(w.worker_id),
                               self.reader)
                     for w, rec in self.sources],
            ranges=self.ranges, **striped)

    def wire(self) -> bytes:
        manifest, checksums = self.layout.packed_manifest() if self.manifest else _NO_MANIFEST
        return encode_map({
            "type": "read_plan", "model": self.model, "version": self.version,
            "layout_id": self.layout_id, "manifest": manifest, "checksums": checksums,
            "lease_id": self.lease_id, "lease_ttl": self.lease_ttl,
            "sources": encode_array([
                encode_map({"worker_id": w.worker_id, "name": w.name, "role": w.role,
                            "endpoint": w.endpoint, "memory": Packed(rec.packed_memory()),
                            "progress": self._progress_of(w.worker_id),
                            "grant": grants.issue(w.grant_key, self.reader)})
                for w, rec in self.sources]),
            "ranges": [r.__dict__ for r in self.ranges],  # (what `encode` packs, sooner)
            "complete": self.complete, "chunk_bytes": self.chunk_bytes,
            "stripes": self.stripes, "retry_after": self.retry_after,
            "holding": self.holding,
        })


@dataclass(slots=True, frozen=True)
class _Encoded:
    """A reply made once and answered many times, with its bytes: a model's newest
    announcement, which every idle watcher's fallback asks for (with its manifest, encoding
    it costs ~0.15 ms)."""

    model: Announcement
    bytes: bytes

    def reply(self) -> Announcement:
        return self.model

    def wire(self) -> bytes:
        return self.bytes


def source_of(worker: WorkerRec, memory: list[MemoryDesc], progress: MemoryDesc | None,
              reader: str) -> Source:
    """A holder as `reader` is told of it: who, where, its regions, and leave to read."""
    return Source(worker_id=worker.worker_id, name=worker.name, role=worker.role,
                  endpoint=worker.endpoint, memory=memory, progress=progress,
                  grant=grants.issue(worker.grant_key, reader))


def _sockets_closed(router: zmq.Socket, pub: zmq.Socket, ctx: zmq.Context,
                    gates: list) -> None:
    """A coordinator's sockets closed, its gate stopped, its context ended (once)."""
    router.close(0)
    pub.close(0)
    for gate in gates:
        gate.stop()
    ctx.term()


def announce_address_for(bind: str) -> str:
    head, _, port = bind.rpartition(":")
    return f"{head}:{int(port) + 1}"


def settle_gc(young: int = 20_000) -> None:
    """Garbage collection for a coordinator process, called once everything it imports is
    loaded. What is alive then (modules, pydantic schemas) lives as long as the process:
    frozen, out of the collector's sight. The table it builds is mostly untracked tuples,
    while one request may allocate and drop thousands of objects (a first striped plan
    carries a memory region per item): the young generation is sized so that one
    request's temporaries do not promote into collections of the whole heap, which every
    request in flight would wait for."""
    gc.freeze()
    gc.set_threshold(young, 10, 10)


class Coordinator:
    def __init__(self, config: CoordinatorConfig = CoordinatorConfig(),
                 clock: Callable[[], float] = time.monotonic):
        """`clock`: the time source for liveness and leases (the simulator drives its own)."""
        self.config = config
        self.clock = clock
        self.start_over()
        self.metrics = CoordinatorMetrics()  # served by `serve_metrics`
        self._fleet_measured_at: float | None = None  # None: no metrics served, never
        # A context of its own: its ZAP handler (`TokenGate`) must not judge the sockets of
        # workers or other coordinators living in the same process. Closed by `stop`, or
        # by `_sockets_closed` when a coordinator never stopped is collected.
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._pub = self._ctx.socket(zmq.PUB)
        self.gate: curve.TokenGate | None = None
        self._gates: list[curve.TokenGate] = []  # (seen by the finalizer once started)
        self._close = weakref.finalize(self, _sockets_closed, self._router, self._pub,
                                       self._ctx, self._gates)
        try:
            self._bind(config)
        except BaseException:
            self._close()
            raise
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handlers = {
            Register: self._register, Heartbeat: self._heartbeat,
            Unregister: self._unregister, Publish: self._publish, Hold: self._hold,
            Withdraw: self._withdraw, PlanRequest: self._plan, StripedPlanRequest: self._plan,
            ReplanStripes: self._plan, ConfirmParents: self._plan, ReadDone: self._read_done,
            Progress: self._progress,
            GetManifest: self._manifest, StatusRequest: self._status,
            HoldingsRequest: self._holdings, RetentionRequest: self._retention,
            LatestRequest: self._latest, PublishStatus: self._publish_status,
            StandBy: self._stand_by,
            Declare: self._declare,
            GetDeclared: self._get_declared,
        }  # fmt: skip
        # What `_answer` calls: the same, except that a plan is left to be made into a
        # model (`handle`) or into bytes (the socket) by the caller.
        self._answers = {**self._handlers, **dict.fromkeys(_PLAN_REQUESTS, self._plan_reply)}

    def _bind(self, config: CoordinatorConfig) -> None:
        """Make both sockets CURVE servers (with a token, or an explicit keypair), start the
        token's gate before any connection can arrive, and bind."""
        self._router.setsockopt(zmq.LINGER, 0)
        # Larger messages are dropped by libzmq, which also drops the sender's connection.
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.curve_public_key = None  # an explicit keypair's, which clients must be given
        secret = config.curve_secret or (
            curve.token_server_secret(config.token) if config.token else None)
        if secret is not None:
            for sock in (self._router, self._pub):
                curve.secure_server(sock, secret)
            if config.curve_secret is not None:
                self.curve_public_key = curve.public_key_of(config.curve_secret)
        if config.token:
            self.gate = curve.TokenGate(self._ctx, config.token)
            self._gates.append(self.gate)
        self._router.bind(config.bind)
        self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        # A requested port 0 means "any free port": the announcement port is then random
        # too (bound port + 1 may be taken by anyone).
        announce = config.announce or (
            announce_address_for(self.address) if not config.bind.endswith(":0") else None
        )
        if announce and not announce.endswith(":0"):
            self._pub.bind(announce)
            self.announce_address = announce
        else:
            port = self._pub.bind_to_random_port(self.address.rpartition(":")[0])
            self.announce_address = f"{self.address.rpartition(':')[0]}:{port}"

    # ------------------------------------------------------------------ lifecycle
    def start_over(self) -> None:
        """Forget every worker, version and reference, as a restart does, sockets kept:
        the table and all the soft state derived from it, together (state left from an
        earlier table would name workers the new one does not know)."""
        self.table = Table(clock=self.clock)
        self.trust = Trust(self.config.trust, self.clock)
        # holder -> {(model, version): until when}: a holder dropped on readers' reports
        # may not offer that version again before then; it is told in heartbeat replies
        self._probation: dict[str, dict[tuple[str, int], float]] = {}
        self._stream_rate: float | None = None  # bytes/s of recent reads (moving average)
        self._workers_in_dc: Counter[str] = Counter()  # replicas by dc: readers to expect
        self._announcements: dict[str, _Encoded] = {}  # model -> its newest
        self.pending = Pending()  # sharded versions waiting for parts (`parts.py`)
        # readers placed ahead of a model's first version (`standby.py`)
        self.standby = StandingForests(self.config.stripes,
                                       self.config.planner.max_readers_per_holder,
                                       self.config.pending_grace)

    def start(self) -> Coordinator:
        """Serve in a background thread (tests, demos, in-process use)."""
        self._thread = threading.Thread(target=self.serve_forever, name="tensorhub-coordinator",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_metrics(self, port: int, addr: str = "0.0.0.0"):
        """Prometheus `/metrics` on `port`, from a thread of its own (`metrics.py`)."""
        server = self.metrics.serve(port, addr)
        self._fleet_measured_at = float("-inf")
        log.info("metrics on http://%s:%d/metrics", addr, port)
        return server

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._close()

    def serve_forever(self) -> None:
        log.info("coordinator serving on %s, announcing on %s", self.address,
                 self.announce_address)
        # A receive waits at most this long, so the loop sees `stop` and expiry in time: no
        # poller, and no `zmq.Again` raised (~3 us) each time the queue runs dry.
        router = self._router
        router.setsockopt(zmq.RCVTIMEO, 100)
        next_expiry = 0.0
        last_turn = self.clock()
        while not self._stop.is_set():
            try:
                frames = router.recv_multipart()
            except zmq.Again:
                frames = None
            now = self.clock()
            if now - last_turn > PAUSE_FORGIVEN:
                self.forgive_pause(now - last_turn)
            last_turn = now
            if frames is not None:
                self._handle_frames(frames)
            # Expiry walks every worker and lease: at most every EXPIRY_PERIOD, not after
            # every request (at 4096 workers heartbeating, that walk was most of the CPU).
            if time.monotonic() >= next_expiry:
                self._expire()
                next_expiry = time.monotonic() + EXPIRY_PERIOD

    # ------------------------------------------------------------------ dispatch
    def _handle_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            if len(frames) >= 2:
                ident, req_id = frames[0], frames[1] if len(frames) > 2 else b""
                self._send(ident, req_id, ErrorReply(
                    code="bad_request",
                    message="expected frames [request id, msgpack envelope]"))
            return
        ident, req_id, payload = frames
        self._send(ident, req_id, self.answer(payload))

    def handle(self, payload: bytes):
        """Decode, authenticate and answer one request (any failure becomes an ErrorReply)."""
        return self._answer(payload, wire=False)

    def answer(self, payload: bytes) -> bytes:
        """`handle`, as the bytes the socket sends: a plan is encoded straight from the
        table, never built as models (what a benchmark or the simulator should time)."""
        reply = self._answer(payload, wire=True)
        if type(reply) is bytes:
            return reply
        return _ACK_BYTES if reply is _ACK else encode(reply)

    def _answer(self, payload: bytes, wire: bool):
        """`handle`, with a prepared reply (a plan, an announcement) made into a model, or
        (`wire`: the socket) into its bytes."""
        try:
            envelope = decode_envelope(payload)
        except WireError as exc:
            return ErrorReply(code="bad_request",
                              message=foreign(payload, "this worker", "request") or str(exc))
        if self.config.token is not None and not hmac.compare_digest(
            (envelope.token or "").encode(), self.config.token.encode()
        ):
            return ErrorReply(code="unauthorized",
                              message="wrong or missing token (set TENSORHUB_TOKEN)")
        request = envelope.request
        impostor = self._impostor(request, envelope.secret)
        if impostor is not None:
            return impostor
        try:
            if type(request) in _PLAN_REQUESTS:
                started = time.perf_counter()
                plan = self._answers[type(request)](request)
                reply = plan.wire() if wire else plan.reply()
                self.metrics.plan_latency.observe(time.perf_counter() - started)
                self.metrics.plans.labels(request.model).inc()
                return reply
            reply = self._answers[type(request)](request)
            if type(reply) is _Plan or type(reply) is _Encoded:
                return reply.wire() if wire else reply.reply()
            return reply
        except Reject as rej:
            return rej.reply
        except Exception as exc:  # a bug must not take the coordinator down
            log.exception("internal error handling %s", request.type)
            return ErrorReply(code="internal", message=f"internal error: {exc}")

    def _impostor(self, request, secret: str | None) -> ErrorReply | None:
        """A refusal if `request` is made as a registered worker without that worker's
        secret (what it carries as another worker, a plan's `done`, is refused by its
        handler)."""
        worker_id = getattr(request, "worker_id", None)
        if worker_id is None:
            return None
        worker = self.table.workers.get(worker_id)
        if worker is None or hmac.compare_digest((secret or "").encode(),
                                                 worker.secret.encode()):
            return None  # (an unknown worker is refused by the handler: register again)
        return ErrorReply(code="unauthorized",
                          message=f"{request.type} as worker {worker_id} without its secret: a "
                                  f"worker acts only for itself (the secret comes with "
                                  f"`Registered`; `CoordinatorClient` shows it)")

    def _send(self, ident: bytes, req_id: bytes, reply) -> None:
        """`reply`: a model, or its bytes."""
        if type(reply) is not bytes:
            reply = encode(reply)
        router = self._router
        try:  # three sends: `send_multipart` checks and wraps frames at twice the cost
            router.send(ident, _SEND_MORE)
            router.send(req_id, _SEND_MORE)
            router.send(reply, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # ------------------------------------------------------------------ helpers
    def _worker(self, worker_id: str) -> WorkerRec:
        worker = self.table.workers.get(worker_id)
        if worker is None:
            raise Reject("unknown_worker",
                         f"worker {worker_id} is not registered (coordinator restarted, "
                         f"or it timed out): register again")
        worker.last_seen = self.clock()
        return worker

    def _model(self, model: str) -> ModelRec:
        mrec = self.table.models.get(model)
        if mrec is None:
            known = ", ".join(sorted(self.table.models)) or "none"
            raise Reject("unknown_model", f"model {model!r} has no versions (known: {known})")
        return mrec

    def _check_memory(self, layout: LayoutRec, memory: list[MemoryDesc]) -> None:
        if len(memory) != len(layout.items):
            raise Reject("layout_mismatch",
                         f"{len(memory)} memory regions for a layout of {len(layout.items)} items")
        for k, (m, item) in enumerate(zip(memory, layout.items, strict=True)):
            if m.nbytes != item.nbytes:
                raise Reject("layout_mismatch",
                             f"item {k}: {m.nbytes} bytes registered, layout says {item.nbytes}")

    @staticmethod
    def _check_manifest(manifest: Manifest) -> None:
        try:
            check_manifest(manifest)
        except LayoutError as exc:
            raise Reject("bad_request", f"manifest: {exc}") from None

    def _new_layout(self, manifest, checksums) -> tuple[str, LayoutRec]:
        self._check_manifest(manifest)
        items = plan_items(manifest)
        if checksums is None or len(checksums) != len(items):
            raise Reject("bad_request",
                         f"need one checksum per item ({len(items)}), got "
                         f"{0 if checksums is None else len(checksums)}")
        return layout_id(manifest), LayoutRec(manifest, items, list(checksums))

    def _update_endpoint(self, worker: WorkerRec, endpoint) -> None:
        if endpoint is not None:
            if endpoint.transport != worker.endpoint.transport:
                raise Reject("bad_request", "a worker cannot change transport")
            worker.endpoint = endpoint

    def _announce(self, model: str, version: int, lid: str, layout: LayoutRec,
                  publisher: str, memory: list[MemoryDesc], parts: int = 1) -> None:
        """Tell subscribers (and later `LatestRequest`s) of a new version, with what a
        reader needs to pull it by the parents it had for the previous one (for a sharded
        version: its part 0's)."""
        announcement = Announcement(
            model=model, version=version, layout_id=lid, checksums=layout.checksums,
            chunk_bytes=self.config.planner.chunk_bytes_for(layout.nbytes),
            publisher=publisher, memory_digest=regions_digest(memory), parts=parts,
            manifest=layout.manifest,
            source=source_of(self.table.workers[publisher], memory,
                             self.table.workers[publisher].progress, ANY_READER)
            if parts == 1 else None)
        msg = encode(announcement)
        self._announcements[model] = _Encoded(announcement, msg)
        try:
            self._pub.send_multipart([model.encode(), msg], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # ------------------------------------------------------------------ handlers
    def _register(self, req: Register) -> Registered:
        worker_id = f"{req.name}-{uuid.uuid4().hex[:8]}"
        secret = secrets.token_hex(16)
        self.table.workers[worker_id] = WorkerRec(
            worker_id, req.name, req.role, req.endpoint, dict(req.labels), self.clock(),
            progress=req.progress, secret=secret, grant_key=req.grant_key)
        if req.role == "replica":
            self._workers_in_dc[req.labels.get("dc", "")] += 1
        log.info("worker %s registered (%s, %s)", worker_id, req.role, req.endpoint.transport)
        if req.role == "trainer":
            for model, newest in req.published.items():
                self._trainer_newest(model, newest)
        return Registered(worker_id=worker_id, secret=secret,
                          heartbeat_interval=self.config.heartbeat_interval,
                          worker_ttl=self.config.worker_ttl,
                          announce_address=self.announce_address,
                          lease_ttl=self.config.lease_ttl)

    def _trainer_newest(self, model: str, newest: int) -> None:
        """A trainer registering again (we restarted) says the newest version it published:
        versions past it that holders brought back since are another run's (a replica left
        over from an earlier job): dropped, so they are never served and never block its
        next publish. From here on versions come from publishes only."""
        mrec = self.table.models.setdefault(model, ModelRec())
        if mrec.published:
            return
        mrec.published = True
        stale = sorted(v for v in mrec.versions if v > newest)
        for v in stale:
            holders = {self.table.workers[h].name if h in self.table.workers else h
                       for layout in mrec.versions.pop(v).layouts.values()
                       for h in layout.holders}
            log.warning("%s v%d, brought back by %s, is past the newest version its trainer "
                        "published (v%d): another run's, dropped", model, v,
                        ", ".join(sorted(holders)) or "nobody", newest)
        for lease_id in [k for k, x in self.table.leases.items()
                         if x.model == model and x.version in stale]:
            del self.table.leases[lease_id]
        announced = self._announcements.get(model)
        if stale and announced is not None and announced.model.version > newest:
            del self._announcements[model]
        mrec.latest = max([newest, *mrec.versions])

    def _heartbeat(self, req: Heartbeat) -> Ack | HeartbeatReply:
        self._worker(req.worker_id).pull = req.pull
        dropped = self._probation.get(req.worker_id)
        if not dropped:
            return _ACK
        now = self.clock()
        return HeartbeatReply(dropped=[
            Dropped(model=m, version=v, retry_after=max(0.0, until - now))
            for (m, v), until in dropped.items()])

    def _unregister(self, req: Unregister) -> Ack:
        self._forget_worker(req.worker_id, "unregistered", "unregistered")
        return _ACK

    def _publish(self, req: Publish) -> Published:
        worker = self._worker(req.worker_id)
        if worker.role != "trainer":
            raise Reject("bad_request", "only a worker registered as trainer may publish")
        latest = self.table.models[req.model].latest if req.model in self.table.models else 0
        if req.version == latest and self._already_published(req):
            # A retry whose first try was answered but the answer lost (a pause, a
            # reconnect): answered as the first was, so a trainer may always retry.
            vrec = self.table.models[req.model].versions[latest]
            return Published(model=req.model, version=latest,
                             layout_id=vrec.part_ids[req.part])
        if req.parts > 1:
            return self._publish_part(req, worker, latest)
        if req.version <= latest:
            raise Reject("stale_version",
                         f"model {req.model!r} is at version {latest}; a new version "
                         f"must be greater (got {req.version})")
        lid, layout = self._held_layout(req, worker)
        self._make_version(req.model, VersionRec(req.version, lid, {lid: layout}))
        log.info("%s published %s v%d (%d items, %.1f MiB)", worker.worker_id, req.model,
                 req.version, len(layout.items), layout.nbytes / 2**20)
        self._announce(req.model, req.version, lid, layout, worker.worker_id, req.memory)
        return Published(model=req.model, version=req.version, layout_id=lid)

    def _make_version(self, model: str, vrec: VersionRec) -> None:
        """`vrec` becomes the model's newest version (all checks passed)."""
        mrec = self.table.models.setdefault(model, ModelRec())
        mrec.published = True
        previous = mrec.versions.get(mrec.latest)
        mrec.versions[vrec.version] = vrec
        mrec.latest = vrec.version
        self.metrics.published.labels(model).inc()
        for lid, layout in vrec.layouts.items():
            last = previous.layouts.get(lid) if previous is not None else None
            if last is not None and last.forest is not None:
                # The same layout: its readers may pull this version by their last parents
                # (`Forest.adopt`, as each confirms), so the forest starts with its publisher.
                layout.previous_forest = last.forest
                self._forest(layout)
            elif vrec.parts is None and (standing := self.standby.take(
                    model, lid, tuple(i.nbytes for i in layout.items))) is not None:
                # Readers stood by for it: they pull by the parents they were placed under.
                layout.previous_forest = standing
                self._forest(layout)
        self.standby.drop_model(model)
        for key in [k for k in self.pending.versions if k[0] == model and k[1] < vrec.version]:
            self._abort(key, f"v{vrec.version} was published first")
        self.table.prune()

    def _held_layout(self, req: Publish | Hold, worker: WorkerRec) -> tuple[str, LayoutRec]:
        """The layout `req` describes, checked against the memory it registers, with
        `worker` as its holder (stored by the caller)."""
        lid, layout = self._new_layout(req.manifest, req.checksums)
        self._check_memory(layout, req.memory)
        self._update_endpoint(worker, req.endpoint)
        layout.holders[worker.worker_id] = HolderRec(worker.worker_id, store_memory(req.memory))
        return lid, layout

    def _already_published(self, req: Publish) -> bool:
        """`req` repeats the publish that made its version (or part): same trainer, same
        bytes."""
        vrec = self.table.models[req.model].versions.get(req.version)
        if vrec is None or req.part >= len(vrec.part_ids):
            return False
        layout = vrec.part_layouts()[req.part]
        return (layout is not None and req.worker_id in layout.holders
                and layout.checksums == list(req.checksums or []))

    # ------------------------------------------------------------------ sharded versions
    def _publish_part(self, req: Publish, worker: WorkerRec, latest: int) -> Published:
        """Part `req.part` of a sharded version: kept aside until all parts are in, then
        the version is made and announced like any other (`parts.py`)."""
        key = (req.model, req.version)
        restored = self._restore_part(req, worker)
        if restored is not None:
            return restored
        if req.version <= latest:
            raise Reject("stale_version",
                         f"model {req.model!r} is at version {latest}; a new version "
                         f"must be greater (got {req.version})")
        if key in self.pending.aborted and key not in self.pending.versions:
            raise Reject("aborted", f"{req.model!r} v{req.version} was given up "
                         f"({self.pending.aborted[key]}); publish the next version")
        pending = self.pending.versions.get(key)
        if pending is not None and pending.parts != req.parts:
            raise Reject("bad_request", f"{req.model!r} v{req.version} is being published "
                         f"in {pending.parts} parts, not {req.parts}")
        lid, layout = self._held_layout(req, worker)
        have = pending.have.get(req.part) if pending is not None else None
        if have is not None:
            if have.publisher == worker.worker_id and have.layout.checksums == layout.checksums:
                return Published(model=req.model, version=req.version, layout_id=lid,
                                 complete=False)  # a repeat
            raise Reject("bad_request", f"part {req.part} of {req.model!r} v{req.version} "
                         f"is in already, from {have.publisher}")
        if pending is None:
            pending = self.pending.versions[key] = PendingVersion(req.version, req.parts,
                                                                  self.clock())
            self.pending.aborted.pop(key, None)
        pending.have[req.part] = PendingPart(lid, layout, worker.worker_id, list(req.memory))
        if not pending.complete:
            log.info("%s published part %d of %s v%d (%d of %d in)", worker.worker_id,
                     req.part, req.model, req.version, len(pending.have), req.parts)
            return Published(model=req.model, version=req.version, layout_id=lid,
                             complete=False)
        self._complete(key, pending)
        return Published(model=req.model, version=req.version, layout_id=lid, complete=True)

    def _complete(self, key: tuple[str, int], pending: PendingVersion) -> None:
        """Every part of a pending version is in: check they fit, then make and announce
        the version (or abort it, `bad_request` to the caller)."""
        model, version = key
        parts = [pending.have[r] for r in range(pending.parts)]
        try:
            check_parts_fit([p.layout.manifest for p in parts])
        except ValueError as exc:
            self._abort(key, str(exc))
            raise Reject("bad_request", f"{model!r} v{version}: {exc}") from None
        del self.pending.versions[key]
        self._make_version(model, VersionRec(version, parts[0].layout_id,
                                             {p.layout_id: p.layout for p in parts},
                                             parts=[p.layout_id for p in parts]))
        log.info("%s v%d published in %d parts (%.1f MiB)", model, version, len(parts),
                 sum(p.layout.nbytes for p in parts) / 2**20)
        self._announce(model, version, parts[0].layout_id, parts[0].layout,
                       parts[0].publisher, parts[0].memory, parts=len(parts))

    def _restore_part(self, req: Publish, worker: WorkerRec) -> Published | None:
        """After a restart a sharded version can come back from its holders before one of
        its ranks sends its part again (that rank was still waiting for the others): the
        part fills the restored record's empty slot."""
        mrec = self.table.models.get(req.model)
        vrec = mrec.versions.get(req.version) if mrec else None
        if vrec is None or vrec.parts is None or len(vrec.parts) != req.parts \
                or vrec.parts[req.part] is not None:
            return None
        lid, layout = self._held_layout(req, worker)
        vrec.layouts[lid] = layout
        vrec.parts[req.part] = lid
        if req.part == 0:
            vrec.origin_layout = lid
        return Published(model=req.model, version=req.version, layout_id=lid,
                         complete=None not in vrec.parts)

    def _abort(self, key: tuple[str, int], reason: str) -> None:
        if self.pending.abort(key, reason) is not None:
            log.warning("%s v%d given up before all its parts were in: %s", *key, reason)

    def _publish_status(self, req: PublishStatus) -> PublishStatusReply:
        key = (req.model, req.version)
        pending = self.pending.versions.get(key)
        if pending is not None:
            return PublishStatusReply(state="pending", parts=pending.parts,
                                      parts_in=sorted(pending.have))
        if key in self.pending.aborted:
            return PublishStatusReply(state="aborted", reason=self.pending.aborted[key])
        mrec = self.table.models.get(req.model)
        vrec = mrec.versions.get(req.version) if mrec else None
        if vrec is not None:
            layouts = vrec.part_layouts()
            back = [r for r, layout in enumerate(layouts) if layout is not None]
            return PublishStatusReply(state="complete" if len(back) == len(layouts)
                                      else "pending", parts=len(layouts), parts_in=back)
        return PublishStatusReply(state="unknown")

    def _part_layout(self, vrec: VersionRec, part: int, model: str) -> tuple[str, LayoutRec]:
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

    def _hold(self, req: Hold) -> Ack:
        worker = self._worker(req.worker_id)
        self._check_probation(req.worker_id, req.model, req.version)
        mrec = self.table.models.get(req.model)
        vrec = mrec.versions.get(req.version) if mrec else None
        pending = self.pending.versions.get((req.model, req.version))
        if vrec is None and pending is not None and req.manifest is not None \
                and req.parts == pending.parts and req.part not in pending.have:
            # A restart while the version was pending: a rank that had it complete
            # announces its part as the others send theirs again. It joins the pending
            # version (which completes when all are in), not a record of its own.
            lid, layout = self._held_layout(req, worker)
            pending.have[req.part] = PendingPart(lid, layout, worker.worker_id,
                                                 list(req.memory))
            if pending.complete:
                self._complete((req.model, req.version), pending)
            return _ACK
        if vrec is None:
            if req.manifest is None or (mrec is not None and req.version < mrec.latest):
                raise Reject("unknown_version",
                             f"model {req.model!r} has no version {req.version}")
            if mrec is not None and mrec.published and req.version > mrec.latest:
                raise Reject("unknown_version",
                             f"model {req.model!r} has no version {req.version}: its trainer "
                             f"publishes versions (latest {mrec.latest}), a holder cannot "
                             f"bring one it never published")
            # Soft state: a holder re-registering after a coordinator restart brings it back.
            # Records are built aside and stored only once every check below has passed.
            lid, layout = self._new_layout(req.manifest, req.checksums)
            vrec = VersionRec(req.version, lid if req.part == 0 else "", {lid: layout},
                              parts=None if req.parts == 1 else
                              [lid if r == req.part else None for r in range(req.parts)])
        new_layout = None
        layout = vrec.layouts.get(req.layout_id)
        if layout is None:
            if req.manifest is None:
                raise Reject("layout_mismatch",
                             f"version {req.version} has no layout {req.layout_id}; "
                             f"send its manifest and checksums to add one")
            lid, layout = self._new_layout(req.manifest, req.checksums)
            if lid != req.layout_id:
                raise Reject("layout_mismatch", "layout id does not match the manifest")
            new_layout = lid
        elif req.checksums is not None and list(req.checksums) != layout.checksums:
            raise Reject("layout_mismatch",
                         f"checksums differ from version {req.version}'s: not the same bytes")
        self._check_memory(layout, req.memory)
        self._update_endpoint(worker, req.endpoint)
        if new_layout is not None:
            vrec.layouts[new_layout] = layout
            if vrec.parts is not None and req.parts == len(vrec.parts) \
                    and vrec.parts[req.part] is None:  # a part back after a restart
                vrec.parts[req.part] = new_layout
                if req.part == 0:
                    vrec.origin_layout = new_layout
        if req.version not in (mrec.versions if mrec else {}):
            mrec = self.table.models.setdefault(req.model, ModelRec())
            mrec.versions[req.version] = vrec
            mrec.latest = max(mrec.latest, req.version)
        layout.holders[worker.worker_id] = HolderRec(worker.worker_id, store_memory(req.memory))
        if layout.forest is not None:
            layout.forest.add_root(worker.worker_id, worker.labels.get("dc", ""))
        return _ACK

    def _withdraw(self, req: Withdraw) -> Withdrawn:
        self._worker(req.worker_id)
        self._end_probation(req.worker_id, req.model, req.version)  # nothing left to offer
        mrec = self.table.models.get(req.model)
        vrec = mrec.versions.get(req.version) if mrec else None
        if vrec is not None and req.version == mrec.latest and not req.force:
            for part, layout in enumerate(vrec.part_layouts()):
                me = layout.holders.get(req.worker_id) if layout else None
                others = [h for h in layout.holders.values()
                          if h.worker_id != req.worker_id and not h.withdrawn] if layout else []
                if me is not None and not me.withdrawn and not others:
                    what = f" (part {part})" if vrec.parts else ""
                    raise Reject("last_holder",
                                 f"{req.worker_id} is the last holder of {req.model!r} "
                                 f"v{req.version}{what}, the newest version: wait until a "
                                 f"replica holds it, or publish a newer one first",
                                 retry_after=0.2)
        if vrec is not None:
            # No new reads of it from us, complete or partial; reads in flight may finish.
            self.table.drop_partial(req.worker_id, req.model, req.version)
            for layout in vrec.layouts.values():
                holder = layout.holders.get(req.worker_id)
                if holder is not None:
                    holder.withdrawn = True
        active = self.table.active_reads(req.worker_id, req.model, req.version)
        if active == 0:
            self.table.drop_holder(req.worker_id, req.model, req.version)
        return Withdrawn(active_reads=active)

    def _resolve(self, model: str, version) -> tuple[ModelRec, VersionRec]:
        mrec = self._model(model)
        v = mrec.latest if version == "latest" else version
        vrec = mrec.versions.get(v)
        if vrec is None:
            raise Reject("unknown_version",
                         f"model {model!r} has no version {v} (latest is {mrec.latest})")
        return mrec, vrec

    def _plan(self, req: PlanRequest | StripedRequest) -> ReadPlan:
        return self._plan_reply(req).reply()

    def _plan_reply(self, req: PlanRequest | StripedRequest) -> _Plan:
        plan = self._make_plan(req)
        plan.reader = req.worker_id
        return plan

    def _make_plan(self, req: PlanRequest | StripedRequest) -> _Plan:
        self._worker(req.worker_id)
        if type(req) is PlanRequest and req.done is not None:
            self._apply_done(req)
        _, vrec = self._resolve(req.model, req.version)
        lid = req.layout_id or self._part_layout(vrec, 0, req.model)[0]
        layout = vrec.layouts.get(lid)
        if layout is None:
            raise Reject("layout_mismatch",
                         f"nobody holds {req.model!r} v{vrec.version} in layout {lid}; "
                         f"known layouts: {', '.join(vrec.layouts)}")
        if type(req) is not PlanRequest:
            return self._plan_striped(req, vrec.version, lid, layout)
        avoid = self.trust.avoided(req.worker_id)
        try:
            ranges = plan_ranges(self.table, layout, req.worker_id, self.config.planner,
                                 req.missing, avoid)
        except ValueError as exc:
            raise Reject("bad_request", str(exc)) from None
        except NoSource as exc:
            raise self._no_source(exc, req.worker_id, req.model, vrec.version, layout, avoid,
                                  "every holder is serving its maximum of readers",
                                  striped=False) from None
        source_ids = {r.source for r in ranges}
        lease = self.table.new_lease(req.worker_id, req.model, vrec.version, lid, source_ids,
                                     self.config.lease_ttl)
        workers = self.table.workers
        return _Plan(req.model, vrec.version, lid, layout, self._with_manifest(req),
                     lease.lease_id, float(self.config.lease_ttl),
                     [(workers[sid], layout.holders[sid]) for sid in source_ids],
                     ranges)

    def _apply_done(self, req: PlanRequest) -> None:
        """The end of the reader's previous lease, carried by its next request (one round
        trip instead of two). It is the reader's own: another worker's id is refused."""
        if req.done.worker_id != req.worker_id:
            raise Reject("bad_request", f"a plan request of {req.worker_id} carries a "
                                        f"{req.done.type} of {req.done.worker_id}")
        self._read_done(req.done)

    @staticmethod
    def _with_manifest(req: PlanRequest | StripedRequest) -> bool:
        """Whether a plan carries the manifest and checksums: unless the reader has them."""
        return not (req.known_manifest and req.version != "latest")

    def _no_source(self, exc: NoSource, reader: str, model: str, version: int,
                   layout: LayoutRec, avoid, busy: str, striped: bool = True) -> Reject:
        """`unreachable` when this reader failed on every holder there is (its own fault,
        most likely: the others read them); `busy` (retry soon) when holders exist but are
        all serving; else `no_holder`."""
        serving = [h for h in (layout.serving() if striped else
                               [h.worker_id for h in layout.holders.values() if not h.withdrawn])
                   if h != reader]
        if avoid and serving and all(h in avoid for h in serving):
            names = ", ".join(sorted(self.table.workers[h].name for h in serving
                                     if h in self.table.workers)[:8])
            return Reject(
                "unreachable",
                f"{self.table.workers[reader].name} could not read {model!r} v{version} "
                f"from any holder ({names}) while they still heartbeat, so this worker's "
                f"transport is the likely fault: check that it reaches other hosts "
                f"(UCX_NET_DEVICES, UCX_TLS, TENSORHUB_TRANSPORT, firewalls). They are "
                f"offered to it again after {self.config.trust.window:.0f} s")
        if exc.busy:
            self.metrics.busy.labels(model).inc()
            return Reject("busy", busy, retry_after=self._busy_retry(layout))
        return Reject("no_holder", f"no live holder of {model!r} v{version} is left; the "
                      f"trainer must publish it again", retry_after=1.0)

    def _busy_retry(self, layout: LayoutRec) -> float:
        """How long a busy reader waits: a quarter of a chunk's time at the rate reads have
        had lately (a holder frees once a chunk is read; waiting longer idles it), at least
        `BUSY_RETRY_MIN`, at most the configured `busy_retry`."""
        if self._stream_rate is None:
            return self.config.busy_retry
        chunk_time = self.config.planner.chunk_bytes_for(layout.nbytes) / self._stream_rate
        return min(self.config.busy_retry, max(BUSY_RETRY_MIN, chunk_time / 4))

    def _forest(self, layout: LayoutRec) -> Forest:
        """The layout's forest, begun at its first striped reader with the complete holders
        there are as roots."""
        if layout.forest is None:
            layout.forest = Forest(self.config.stripes, self.config.planner.max_readers_per_holder,
                                   self.config.pending_grace)
            for h in layout.holders.values():
                worker = self.table.workers.get(h.worker_id)
                if worker is not None and not h.withdrawn:
                    layout.forest.add_root(h.worker_id, worker.labels.get("dc", ""),
                                           reader=worker.role == "replica")
                    if worker.role == "trainer" and layout.forest.publisher is None:
                        layout.forest.publisher = h.worker_id
        return layout.forest

    def _plan_striped(self, req: StripedRequest, version: int, lid: str,
                      layout: LayoutRec) -> _Plan:
        """A parent per stripe for the whole version (see `forest.py`): at a reader's first
        request, or for the `stripes` it names again (no parent yet, or a parent that
        failed or fell behind)."""
        reader = self.table.workers[req.worker_id]
        forest = self._forest(layout)
        chunk_bytes = self.config.planner.chunk_bytes_for(layout.nbytes)
        nchunks = len(layout.chunks(chunk_bytes))
        if nchunks > PROGRESS_BYTES:
            raise Reject("bad_request", f"{nchunks} chunks of {chunk_bytes} bytes: a striped "
                                        f"pull takes at most {PROGRESS_BYTES} (--chunk-mib)")
        dc, now = reader.labels.get("dc", ""), self.clock()
        member = forest.members.get(req.worker_id)
        # A reader that reads by its last parents confirms; its lease is opened under the
        # name it already uses.
        confirming = type(req) is ConfirmParents
        lease_name = warm_lease_id(req.worker_id, req.model, version) if confirming else None
        kept: list[str | None] | None = None  # its old parents, if it reads by them
        if not any(not h.withdrawn and h.worker_id != req.worker_id
                   for h in layout.holders.values()):
            # Nobody has every chunk: readers of it could never complete.
            raise Reject("no_holder", f"no live holder of {req.model!r} v{version} is left; "
                                      f"the trainer must publish it again", retry_after=1.0)
        if member is not None and member.root:
            # It holds the version already (a second pull of it): nothing to read.
            parents: list[str | None] = [None] * forest.stripes
        elif confirming and layout.previous_forest is not None and (
                kept := forest.adopt(req.worker_id, layout.previous_forest)) is not None:
            # It pulls by the parents it had for the last version (no plan waited for):
            # taken in with them (a stripe whose old parent left gets a new one), and its
            # lease opened under the name it already uses.
            self._take_memory(req, reader, layout)
            parents = forest.fill(req.worker_id, now, self._workers_in_dc[dc])
        elif member is None:
            if req.relay and req.memory is None:
                raise Reject("bad_request", "the first striped plan request of a reader that "
                                            "serves what it pulls must carry its memory")
            self._take_memory(req, reader, layout)
            parents = forest.join(req.worker_id, dc, self._workers_in_dc[dc], now,
                                  relay=req.relay)
        else:
            # On record once, and only a parent it had: a reader asking again after a busy
            # reply names the same failed parent again, already replaced.
            stripes, failed_ids, behind = (req.stripes, req.failed, req.behind) \
                if type(req) is ReplanStripes else ([], [], [])
            parents_now = {member.parents[s] for s in stripes if s < forest.stripes}
            for failed in parents_now & set(failed_ids):
                source = self.table.workers.get(failed)
                self.table.record(TransferRecord(
                    reader=reader.name, source=source.name if source else failed,
                    model=req.model, version=version, nbytes=0, seconds=0.0, ok=False,
                    error="a striped read failed; the stripe is planned elsewhere"))
            for failed in failed_ids:
                self._report_failed(reader, failed, req.model, version,
                                    "a striped read failed", protected_sources=None)
            gone = set(failed_ids) | set(behind)
            avoid = gone | set(self.trust.avoided(req.worker_id))
            for s in stripes:
                if s < forest.stripes and member.parents[s] in gone:
                    forest.replace(req.worker_id, s, avoid, now)
            parents = forest.fill(req.worker_id, now, self._workers_in_dc[dc], avoid)
            if None in parents:
                avoid = self.trust.avoided(req.worker_id)
                serving = [h for h in layout.serving() if h != req.worker_id]
                if avoid and serving and all(h in avoid for h in serving):
                    raise self._no_source(NoSource(busy=True), req.worker_id, req.model,
                                          version, layout, avoid, "")
        sources = {p for p in parents if p is not None}
        lease_id = layout.striped_leases.get(req.worker_id)
        lease = self.table.leases.get(lease_id) if lease_id else None
        if lease is None:
            lease = self.table.new_lease(req.worker_id, req.model, version, lid, sources,
                                         self.config.lease_ttl, lease_id=lease_name)
            layout.striped_leases[req.worker_id] = lease.lease_id
        elif lease.sources != sources:
            dropped = lease.sources - sources
            self.table.leases[lease.lease_id] = replace(lease, sources=sources)
            self._finish_withdrawals(dropped, req.model, version)
        workers = self.table.workers
        chosen, holding = [], []
        progress: dict[str, MemoryDesc] = {}
        for sid in sorted(sources):
            m = forest.members[sid]
            rec = layout.holders.get(sid) if m.root else layout.partial.get(sid)
            if rec is None or sid not in workers:
                continue
            chosen.append((workers[sid], rec))
            if workers[sid].progress is not None:
                progress[sid] = workers[sid].progress
            if m.root:
                holding.append(sid)
        # A parent taken in before it confirmed has no regions here yet: not named, unless
        # it is one the reader had (it knows its regions).
        named = {w.worker_id for w, _ in chosen}
        parents = [p if p in named or (kept and p == kept[s]) else None
                   for s, p in enumerate(parents)]
        pending = any(p is None for p in parents) and not (member is not None and member.root)
        return _Plan(req.model, version, lid, layout, self._with_manifest(req), lease.lease_id,
                     float(self.config.lease_ttl), chosen, [], chunk_bytes, not pending,
                     parents, self.config.pending_retry if pending else None, progress,
                     holding)

    def _take_memory(self, req: StripedRequest, reader: WorkerRec, layout: LayoutRec) -> None:
        """A striped reader's destination regions: it serves its chunks from them."""
        if req.memory is not None:
            self._check_memory(layout, req.memory)
            self._update_endpoint(reader, req.endpoint)
            layout.partial.add(req.worker_id, store_memory(req.memory), [])

    def _stand_by(self, req: StandBy) -> Placement:
        """Place a reader ahead in the forest of the model's first version in its layout
        (`standby.py`)."""
        reader = self._worker(req.worker_id)
        if reader.role != "replica":
            raise Reject("bad_request", "only a replica stands by for a version")
        mrec = self.table.models.get(req.model)
        if mrec is not None and mrec.versions:
            raise Reject("stale_version", f"{req.model!r} v{mrec.latest} is out already: "
                                          f"pull it (standing by is for a first version)")
        if any(m.nbytes <= 0 for m in req.memory):
            raise Reject("bad_request", "a region of zero bytes")
        sizes = tuple(m.nbytes for m in req.memory)
        self._update_endpoint(reader, req.endpoint)
        dc = reader.labels.get("dc", "")

        def publisher_dc() -> str:  # (a trainer's, else this reader's)
            trainer = next((w for w in self.table.workers.values() if w.role == "trainer"),
                           reader)
            return trainer.labels.get("dc", "")

        try:
            parents = self.standby.place(
                req.model, req.layout_id, req.worker_id, dc, sizes, store_memory(req.memory),
                self._workers_in_dc[dc], self.clock(), publisher_dc)
        except ValueError as exc:
            raise Reject("layout_mismatch", str(exc)) from None
        standing = self.standby.get(req.model, req.layout_id)
        workers = self.table.workers
        sources = [source_of(workers[p], load_memory(standing.memory[p]), workers[p].progress,
                             req.worker_id)
                   for p in dict.fromkeys(parents) if p is not None and p != PUBLISHER]
        return Placement(model=req.model, layout_id=req.layout_id,
                         chunk_bytes=self.config.planner.chunk_bytes_for(sum(sizes)),
                         stripes=parents, sources=sources,
                         # (a leaf's stripe waits for the grace, after which any slot is
                         # its: there is no hurry before the version exists)
                         retry_after=self.config.pending_grace if None in parents else None)

    def _declare(self, req: Declare) -> Ack:
        """Keep the manifest a trainer says its model's first version will have (`Declare`)."""
        if self._worker(req.worker_id).role != "trainer":
            raise Reject("bad_request", "only a worker registered as trainer declares")
        mrec = self.table.models.get(req.model)
        if mrec is not None and mrec.versions:
            raise Reject("stale_version", f"{req.model!r} v{mrec.latest} is out already: "
                                          f"readers allocate from its manifest")
        self._check_manifest(req.manifest)  # (one that could be published)
        self.standby.declare(req.model, req.manifest)
        return _ACK

    def _get_declared(self, req: GetDeclared) -> Declared:
        declared = self.standby.declared(req.model)
        mrec = self.table.models.get(req.model)
        if declared is None or (mrec is not None and mrec.versions):
            raise Reject("unknown_model", f"no manifest declared for {req.model!r} (its "
                                          f"trainer has not declared one, or a version "
                                          f"is out: read its manifest)")
        manifest, lid = declared
        return Declared(model=req.model, layout_id=lid, manifest=manifest)

    def _progress(self, req: Progress) -> Ack:
        """Record the reader as a partial holder of the chunks it has finished."""
        worker = self._worker(req.worker_id)
        _, vrec = self._resolve(req.model, req.version)
        layout = vrec.layouts.get(req.layout_id)
        if layout is None:
            raise Reject("layout_mismatch",
                         f"{req.model!r} v{vrec.version} has no layout {req.layout_id}")
        if req.memory is not None:
            self._check_memory(layout, req.memory)
            memory = store_memory(req.memory)
        elif req.worker_id in layout.partial:
            memory = layout.partial[req.worker_id].memory  # checked when it was stored
        else:
            raise Reject("bad_request", f"the first progress report of {req.model!r} "
                                        f"v{vrec.version} must carry the reader's memory")
        count = len(layout.chunks(self.config.planner.chunk_bytes_for(layout.nbytes)))
        bad = [c for c in req.chunks if c >= count]
        if bad:
            raise Reject("bad_request", f"chunks {bad[:8]} do not exist (the layout has "
                                        f"{count} chunks)")
        if req.worker_id in layout.holders:
            return _ACK  # already a complete holder (or withdrawing): nothing to add
        self._update_endpoint(worker, req.endpoint)
        layout.partial.add(req.worker_id, memory, req.chunks)
        return _ACK

    def _read_done(self, req: ReadDone) -> Ack:
        reader = self._worker(req.worker_id)
        lease = self.table.leases.get(req.lease_id)
        if lease is None or lease.reader != req.worker_id:
            return _ACK  # expired, released, or not this worker's: nothing to do
        del self.table.leases[req.lease_id]
        layout = self._layout_of(lease)
        if layout is not None and layout.striped_leases.get(req.worker_id) == req.lease_id:
            del layout.striped_leases[req.worker_id]
        for sid in sorted(req.by_source or lease.sources):
            source = self.table.workers.get(sid)
            nbytes = req.by_source.get(sid, req.nbytes)
            self.table.record(TransferRecord(
                reader=reader.name, source=source.name if source else sid, model=lease.model,
                version=lease.version, nbytes=nbytes, seconds=req.seconds, ok=req.ok,
                error=req.error))
            if req.ok and source is not None:
                self.metrics.served(source.role, distance(reader, source), nbytes)
        if req.ok and req.nbytes:  # the whole pull (the records above are per source)
            self.table.last_pull[reader.name] = req.worker_id, TransferRecord(
                reader=reader.name, source=",".join(
                    self.table.workers[s].name if s in self.table.workers else s
                    for s in sorted(req.by_source or lease.sources)),
                model=lease.model, version=lease.version, nbytes=req.nbytes,
                seconds=req.seconds, ok=True)
        if req.ok:
            self.trust.read_ok(req.worker_id)
            if req.nbytes >= 1 << 20 and req.seconds > 0:
                rate = req.nbytes / req.seconds
                self._stream_rate = rate if self._stream_rate is None \
                    else 0.9 * self._stream_rate + 0.1 * rate
        elif not req.failed_holders:
            # The reader gave up (not a source failure it will re-plan around): its partial
            # buffers may be reused, so it serves none of them any more.
            self.table.drop_partial(req.worker_id, lease.model, lease.version)
        for failed in req.failed_holders:
            self._report_failed(reader, failed, lease.model, lease.version, req.error,
                                protected_sources=lease.sources)
        self._finish_withdrawals(lease.sources, lease.model, lease.version)
        return _ACK

    def _layout_of(self, lease) -> LayoutRec | None:
        mrec = self.table.models.get(lease.model)
        vrec = mrec.versions.get(lease.version) if mrec else None
        return vrec.layouts.get(lease.layout_id) if vrec else None

    def _report_failed(self, reader: WorkerRec, failed: str, model: str, version: int,
                       error: str | None, protected_sources: set[str] | None) -> None:
        """A reader could not read from `failed`: it is avoided by that reader, and dropped
        only when credible readers on distinct nodes agree (`trust.py`). A source outside
        the reader's lease (`protected_sources`) is not its to report."""
        if protected_sources is not None and failed not in protected_sources:
            return
        holder = self.table.workers.get(failed)
        protected = (holder is not None and holder.role == "trainer") \
            or self._last_complete_holder(failed, model, version)
        if self.trust.report(reader.worker_id, failed, protected,
                             node=reader.labels.get("node", "")):
            log.warning("%s v%d: readers agree that holder %s fails (latest: %s, %s); "
                        "dropping its reference", model, version,
                        holder.name if holder else failed, reader.name, error)
            complete = self._holds_complete(failed, model, version)
            self.table.drop_holder(failed, model, version)
            self.metrics.evictions.labels("failed_reads").inc()
            if holder is not None and complete:  # told; it may offer it again later
                self._probation.setdefault(failed, {})[(model, version)] = \
                    self.clock() + self.trust.config.window
        else:
            log.warning("%s could not read %s v%d from %s (%s); it is planned elsewhere",
                        reader.name, model, version, holder.name if holder else failed, error)

    def _check_probation(self, worker_id: str, model: str, version: int) -> None:
        """A holder dropped on readers' reports offers the version again only once its
        probation (the trust window, on our clock) is over; readers' reports of it start
        afresh then."""
        until = self._probation.get(worker_id, {}).get((model, version))
        if until is None:
            return
        left = until - self.clock()
        if left > 0:
            raise Reject("probation", f"{model} v{version}: readers on several nodes failed "
                         f"to read it from this worker; it may be offered again in "
                         f"{left:.1f} s", retry_after=left)
        self._end_probation(worker_id, model, version)
        log.info("%s offers %s v%d again after its probation", worker_id, model, version)

    def _end_probation(self, worker_id: str, model: str, version: int) -> None:
        dropped = self._probation.get(worker_id)
        if dropped is not None:
            dropped.pop((model, version), None)
            if not dropped:
                del self._probation[worker_id]

    def _holds_complete(self, worker_id: str, model: str, version: int) -> bool:
        """Whether `worker_id` holds (a part of) `version` completely: a reader still
        pulling it (a relay) has nothing to offer again, and ends its pull as usual."""
        mrec = self.table.models.get(model)
        vrec = mrec.versions.get(version) if mrec else None
        return vrec is not None and any(
            (h := layout.holders.get(worker_id)) is not None and not h.withdrawn
            for layout in vrec.layouts.values())

    def _last_complete_holder(self, worker_id: str, model: str, version: int) -> bool:
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

    def _finish_withdrawals(self, holders, model: str, version: int) -> None:
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

    def _latest(self, req: LatestRequest) -> _Encoded:
        """The model's newest version as it was announced (the watchers' one fallback)."""
        mrec = self._model(req.model)
        announced = self._announcements.get(req.model)
        if announced is None or announced.model.version != mrec.latest:
            # (a version brought back by holders after a restart: no publish was seen)
            _, vrec = self._resolve(req.model, "latest")
            lid, layout = self._part_layout(vrec, 0, req.model)
            announcement = Announcement(model=req.model, version=mrec.latest, layout_id=lid,
                                        parts=len(vrec.part_ids), manifest=layout.manifest)
            announced = _Encoded(announcement, encode(announcement))
            self._announcements[req.model] = announced
        return announced

    def _manifest(self, req: GetManifest) -> ManifestReply:
        _, vrec = self._resolve(req.model, req.version)
        lid, layout = self._part_layout(vrec, req.part, req.model)
        return ManifestReply(model=req.model, version=vrec.version, layout_id=lid,
                             manifest=layout.manifest,
                             parts=len(vrec.part_ids))

    def _holdings(self, req: HoldingsRequest) -> HoldingsReply:
        mrec = self.table.models.get(req.model)
        wanted = set(req.names)
        holdings: dict[str, list[int]] = {n: [] for n in req.names}
        for v, vrec in sorted(mrec.versions.items()) if mrec else []:
            if vrec.parts is not None:
                for name in wanted:
                    if self._holds_every_part(name, vrec):
                        holdings[name].append(v)
                continue
            for layout in vrec.layouts.values():
                for h in layout.holders.values():
                    w = self.table.workers.get(h.worker_id)
                    if w is not None and w.name in wanted and not h.withdrawn \
                            and v not in holdings[w.name]:
                        holdings[w.name].append(v)
        pulls = {n: self.table.last_pull[n][1] for n in req.names if n in self.table.last_pull}
        return HoldingsReply(latest=mrec.latest if mrec else 0, holdings=holdings, pulls=pulls)

    def _complete_holders(self, vrec: VersionRec) -> int:
        """Workers holding the version completely: every part, for a sharded one (by the
        name each part's worker has, `Part.worker_name`)."""
        if vrec.parts is None:
            return len({h.worker_id for layout in vrec.layouts.values()
                        for h in layout.holders.values() if not h.withdrawn})
        first = vrec.part_layouts()[0]
        names = {w.name for h in (first.holders.values() if first is not None else ())
                 if not h.withdrawn and (w := self.table.workers.get(h.worker_id))}
        return sum(self._holds_every_part(name, vrec) for name in names)

    def _holds_every_part(self, name: str, vrec: VersionRec) -> bool:
        """A reader named `name` holds every part of a sharded version, each by the worker
        it runs for that part (`Part.worker_name`)."""
        for r, layout in enumerate(vrec.part_layouts()):
            part_name = Part.worker_name(name, r)
            if layout is None or not any(
                    not h.withdrawn and (w := self.table.workers.get(h.worker_id)) is not None
                    and w.name == part_name for h in layout.holders.values()):
                return False
        return True

    def _retention(self, req: RetentionRequest) -> Retention:
        mrec = self.table.models.get(req.model)
        vrec = mrec.versions.get(req.version) if mrec else None
        replicas = {w.worker_id for w in self.table.workers.values() if w.role == "replica"}
        held = 0
        if vrec is not None and vrec.parts is not None:  # the least-held part counts
            held = min(len({h.worker_id for h in layout.holders.values() if not h.withdrawn}
                           & replicas) if layout else 0
                       for layout in vrec.part_layouts())
        elif vrec is not None:
            holders = {h.worker_id for lid, layout in vrec.layouts.items()
                       if req.layout_id in (None, lid)
                       for h in layout.holders.values() if not h.withdrawn}
            held = len(holders & replicas)
        active = sum(1 for lease in self.table.leases.values()
                     if lease.model == req.model and lease.version == req.version)
        return Retention(replica_holders=held, active_reads=active, replicas=len(replicas))

    def _status(self, req: StatusRequest) -> StatusReply:
        now = self.clock()
        workers = [
            {"worker_id": w.worker_id, "name": w.name, "role": w.role,
             "transport": w.endpoint.transport, "seen_ago": round(now - w.last_seen, 3),
             "labels": ",".join(f"{k}={v}" for k, v in sorted(w.labels.items()))}
            for w in self.table.workers.values()
        ]  # fmt: skip
        models = []
        for name, mrec in sorted(self.table.models.items()):
            versions = []
            for v, vrec in sorted(mrec.versions.items()):
                for lid, layout in vrec.layouts.items():
                    holders = [
                        HolderStatus(
                            worker_id=h.worker_id,
                            name=self.table.workers[h.worker_id].name
                            if h.worker_id in self.table.workers else "?",
                            role=self.table.workers[h.worker_id].role
                            if h.worker_id in self.table.workers else "?",
                            active_reads=self.table.active_reads(h.worker_id, name, v),
                            withdrawn=h.withdrawn)
                        for h in layout.holders.values()
                    ]
                    versions.append(VersionStatus(
                        version=v, layout_id=lid,
                        part=vrec.parts.index(lid) if vrec.parts and lid in vrec.parts else None,
                        nbytes=sum(i.nbytes for i in layout.items), holders=holders))
            models.append(ModelStatus(model=name, latest=mrec.latest, versions=versions))
        suspects = [self.table.workers[r].name for r in self.trust.suspects()
                    if r in self.table.workers]
        pulls = [PullInFlight(reader=w.name, **dict(w.pull))
                 for w in self.table.workers.values() if w.pull is not None]
        return StatusReply(workers=workers, models=models,
                           reads_in_flight=len(self.table.leases),
                           transfers=self.table.transfers[-200:], suspect_readers=suspects,
                           pulls=pulls)

    # ------------------------------------------------------------------ expiry
    def forgive_pause(self, seconds: float) -> None:
        """The coordinator did not read its queue for `seconds` (this process or its
        machine was paused, or one request took that long): heartbeats and lease reports
        sent meanwhile are still queued, so the gap counts against no worker and no lease.
        Without this, the first expiry walk after a pause drops every worker at once, and
        all of them register again."""
        log.warning("the coordinator did not read its queue for %.1f s (paused, or busy); "
                    "not counting that against heartbeats or read leases", seconds)
        for worker in self.table.workers.values():
            worker.last_seen += seconds
        for lease in self.table.leases.values():
            lease.expires += seconds
        for pending in self.pending.versions.values():
            pending.started += seconds

    def _forget_worker(self, worker_id: str, why: str, reason: str) -> None:
        """`why` for the log, `reason` for the evictions metric."""
        worker = self.table.workers.pop(worker_id, None)
        if worker is None:
            return
        self.metrics.evictions.labels(reason).inc()
        if worker.role == "replica":
            self._workers_in_dc[worker.labels.get("dc", "")] -= 1
        log.info("worker %s %s: dropping its references and reads", worker_id, why)
        for key in self.pending.published_by(worker_id):
            self._abort(key, f"{worker.name}, which published a part, {why}")
        self.trust.forget(worker_id)
        self.standby.forget(worker_id)
        self._probation.pop(worker_id, None)
        if self.table.last_pull.get(worker.name, ("",))[0] == worker_id:
            del self.table.last_pull[worker.name]
        for lease_id in [k for k, v in self.table.leases.items() if v.reader == worker_id]:
            lease = self.table.leases.pop(lease_id)
            self._finish_withdrawals(lease.sources, lease.model, lease.version)
        self.table.drop_holder(worker_id, gone=True)

    def _expire(self) -> None:
        now, ttl = self.clock(), self.config.worker_ttl
        for key, pv in list(self.pending.versions.items()):
            if now - pv.started > self.config.part_wait:
                self._abort(key, f"part(s) {pv.missing()} of {pv.parts} not in within "
                                 f"{self.config.part_wait:.0f} s")
        for w in [w for w in self.table.workers.values() if now - w.last_seen > ttl]:
            self._forget_worker(w.worker_id, "stopped heartbeating", "heartbeat")
        for worker_id, dropped in list(self._probation.items()):
            for model, version in [k for k, until in dropped.items() if until < now - ttl]:
                self._end_probation(worker_id, model, version)  # told long since, or gone
        for lease in [x for x in self.table.leases.values() if x.expires < now]:
            log.warning("read lease of %s on %s v%d expired", lease.reader, lease.model,
                        lease.version)
            del self.table.leases[lease.lease_id]
            self._finish_withdrawals(lease.sources, lease.model, lease.version)
        if self._fleet_measured_at is not None and now - self._fleet_measured_at >= FLEET_PERIOD:
            self._fleet_measured_at = now
            self._measure_fleet()

    def _measure_fleet(self) -> None:
        """The fleet's shape for the metrics: another walk of every worker and holder, so
        only while metrics are served, and at most every `FLEET_PERIOD`."""
        holders, latest = {}, {}
        for model, mrec in self.table.models.items():
            latest[model] = mrec.latest
            for version, vrec in mrec.versions.items():
                holders[(model, version)] = self._complete_holders(vrec)
        roles = Counter(w.role for w in self.table.workers.values())
        self.metrics.fleet(holders, latest, len(self.table.leases), roles, len(self.standby))

