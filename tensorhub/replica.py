"""A worker that pulls versions into its own buffers and then serves them to others.

`pull` asks the coordinator for a plan, reads one-sided from the holders it names, verifies
every byte against the version's checksums, and only then reports itself as a holder, so
later readers pull from it instead of the trainer.

In place (default) the replica reads straight into its live buffers: before that it
withdraws its reference to the version it holds and waits for reads of it to end, and a
failed pull leaves it holding nothing (`version is None`). With `staging=True` it reads
into a shadow copy while it keeps serving the old version, and a failed pull leaves it
exactly on its previous version; the price is a second copy of the weights in memory.

Striped (default, `chunked=True`): the coordinator names one parent per stripe of the
version once (`coordinator/forest.py`); the replica reads each chunk from its parent as
soon as the parent has it (it polls the parent's progress bytes one-sided), marks it in its
own progress bytes, and so serves it to its own children while it pulls the next ones
(pipelined replication: a fleet pulls a version in about the time one reader does, and
the coordinator hears from each reader a few times a version, not once a chunk; see
`striped.py`). `chunked=False` asks for one whole-item plan per pull instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from tensorhub import metrics
from tensorhub.core.announcements import VersionWatcher
from tensorhub.core.client import busy_wait
from tensorhub.core.data_types import (
    PUBLISHER,
    Announcement,
    ByteRange,
    ConfirmParents,
    GetManifest,
    Manifest,
    Part,
    Placement,
    PlanRequest,
    PullProgress,
    ReadDone,
    ReadPlan,
    ReplanStripes,
    Source,
    StandBy,
    StripedPlanRequest,
    StripedRequest,
)
from tensorhub.core.errors import (
    CoordinatorError,
    IntegrityError,
    LayoutError,
    TensorHubError,
    TransferError,
)
from tensorhub.core.layout import DEFAULT_COMPACT_THRESHOLD, BoundLayout, manifest_of
from tensorhub.core.memory import describe, regions_digest
from tensorhub.core.puller import PullStats, Verifier, check_item, read_plan, split
from tensorhub.core.session import WorkerSession
from tensorhub.core.stripes import Replan, warm_lease_id
from tensorhub.core.transport import Transport
from tensorhub.publisher import NamedTensors, named_list
from tensorhub.striped import StripedReader

log = logging.getLogger("tensorhub.replica")


@dataclass(frozen=True)
class _Parents:
    """The parents a striped pull ended with, or a standby placement named (`PUBLISHER`
    for the coming version's publisher): the next version of the same layout is pulled
    from them, with no plan request, if its announcement allows."""

    layout_id: str
    stripes: tuple[str, ...]
    sources: dict[str, Source]
    chunk_bytes: int
    worker_id: str  # ours when we had them (the coordinator's leases name it)

NO_HOLDER_GRACE = 3.0  # seconds a plan waits for holders to (re-)appear before giving up
STANDBY_RETRY = 5.0  # seconds before standing by again after the coordinator could not place us



def _plan_request(ask: dict, missing: list[ByteRange] | None, done: ReadDone | None,
                  striped: dict) -> PlanRequest | StripedRequest:
    """The plan request of its kind: whole-item (no striped field), a striped pull's first,
    a re-plan of the stripes named, or the confirmation of a warm start (no stripe named)."""
    if not striped:
        return PlanRequest(**ask, missing=missing, done=done)
    if "stripes" not in striped:
        return StripedPlanRequest(**ask, **striped)
    if striped["stripes"]:
        return ReplanStripes(**ask, **striped)
    return ConfirmParents(**ask, **{k: v for k, v in striped.items()
                                    if k not in ("stripes", "failed", "behind")})

class Replica:
    def __init__(
        self,
        coordinator: str,
        model: str,
        named_tensors: NamedTensors | None = None,
        *,
        name: str = "replica",
        transport: str | Transport | None = None,
        staging: bool = False,
        verify: bool = True,
        compact_threshold: int = DEFAULT_COMPACT_THRESHOLD,
        token: str | None = None,
        timeout: float = 10.0,
        labels: dict[str, str] | None = None,
        device: str = "cpu",
        chunked: bool = True,
        part: int = 0,
        coordinator_wait: float = 0.0,
    ):
        """`named_tensors`: the worker's own buffers (live parameters), in checkpoint layout.
        None: allocate buffers from the manifest of the first version pulled (a worker
        joining with no weights of its own). `chunked=False`: whole-item plans, no
        striping (one source a pull). `part`: which part of a sharded version this replica
        pulls and holds (`PartedReplica` runs one replica per part). `coordinator_wait`:
        how long to keep trying to register with a coordinator that does not answer."""
        self.model = model
        self.part = Part(part=part, parts=part + 1)  # parts: as the manifest says, once seen
        self.staging = staging
        self.verify = verify
        self.chunked = chunked
        self.session = WorkerSession(coordinator, name, "replica", transport, labels, token,
                                     timeout, register_wait=coordinator_wait)
        self._device = device
        self.layout: BoundLayout | None = None
        self._staged: list[torch.Tensor] | None = None
        if named_tensors is not None:
            named = named_list(named_tensors)
            try:
                self._bind(BoundLayout(manifest_of(named, compact_threshold),
                                       [t for _, t in named]))
            except BaseException:
                self.session.close()
                raise
        self.version: int | None = None
        self._checksums: list[str] = []  # the held version's, per item
        self._late_seen = 0  # the transport's late reads when we last verified our buffers
        self.last_pull: PullStats | None = None
        self.last_pull_planned = True  # False: the last pull needed no plan request
        self._watcher: VersionWatcher | None = None
        self._parents: _Parents | None = None
        self._registrations = 0  # the session's, at our last first request (0: none yet)
        self._standby_at = 0.0  # when `wait_for_newer` may stand by (again)

    def _bind(self, layout: BoundLayout) -> None:
        """Register our buffers (and the staging copy) before anyone reads into or from them."""
        if self.staging:
            self._staged = [torch.empty_like(b) for b in layout.item_bytes]
            self.session.transport.register(self._staged)
        self.session.transport.register(layout.item_bytes)
        self.layout = layout

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.layout.named_tensors()) if self.layout else {}

    def allocate(self, manifest: Manifest) -> None:
        """Buffers of our own for `manifest` (a declared first version: `GetDeclared`), for
        a replica that has none yet, so that it can stand by before that version exists."""
        if self.layout is not None:
            raise LayoutError(f"{self.session.name} has buffers already")
        self._bind(BoundLayout.allocate(manifest, self._device))
        self._standby_at = 0.0  # (it could not stand by without buffers: it can now)

    def _late_reads(self) -> int:
        return self.session.transport.late_reads

    def reverify(self, always: bool = False) -> None:
        """Verify the version we hold again if a read given up earlier has landed since it
        was verified (its bytes may have gone into our buffers), or `always` (before an
        engine applies it: a peer's one-sided WRITE into registered memory is possible on
        some fabrics); raises `IntegrityError` and stops holding the version if they did
        not match."""
        late = self._late_reads()
        if self.version is None or (late == self._late_seen and not always):
            return
        plan = ReadPlan.model_construct(model=self.model, version=self.version,
                                        checksums=self._checksums)
        try:
            for k, buf in enumerate(self.layout.item_bytes):
                check_item(plan, k, buf)
        except IntegrityError:
            version, self.version = self.version, None
            try:
                self.session.withdraw(self.model, version, 10.0, force=True)
            except TensorHubError as exc:
                log.warning("%s: withdrawing v%d: %s", self.session.name, version, exc)
            raise
        if late != self._late_seen:
            log.warning("%s: a late read landed; %s v%d verified again: whole",
                        self.session.name, self.model, self.version)
        self._late_seen = late

    # ------------------------------------------------------------------ pulling
    def _plan(self, version, deadline: float, missing: list[ByteRange] | None = None,
              done: ReadDone | None = None, known: ReadPlan | None = None,
              **striped) -> ReadPlan:
        """Ask for a plan (carrying the previous plan's lease's end, `done`; with `known`,
        an earlier plan of this pull, the manifest and checksums are not sent again; with
        `striped`, the striped request's fields); wait while holders are busy, and briefly
        (a few heartbeats, in case holders are re-registering with a restarted
        coordinator) while none is left."""
        no_holder_until = time.monotonic() + NO_HOLDER_GRACE
        while True:
            try:
                plan = self.session.call(_plan_request(
                    dict(worker_id=self.session.worker_id, model=self.model, version=version,
                         layout_id=self.layout.layout_id if self.layout else None,
                         known_manifest=known is not None), missing, done, striped))
                if plan.manifest is None or plan.checksums is None:
                    if known is None or plan.layout_id != known.layout_id:
                        raise CoordinatorError(f"a plan for {self.model} v{plan.version} came "
                                               f"without its manifest", code="bad_reply")
                    plan = plan.model_copy(update={"manifest": known.manifest,
                                                   "checksums": known.checksums})
                return plan
            except CoordinatorError as exc:
                retry = exc.retry_after if exc.code in ("busy", "no_holder") else None
                if known is not None and exc.code in ("unknown_model", "unknown_version"):
                    retry = 0.2  # mid-pull: a restarted coordinator, holders re-registering
                if retry is not None and exc.code == "busy":
                    retry = busy_wait(retry)
                limit = deadline if exc.code == "busy" else min(deadline, no_holder_until)
                if retry is None or time.monotonic() + retry > limit:
                    raise
                time.sleep(retry)

    def _read_done(self, plan: ReadPlan, ok: bool, stats: PullStats | None = None,
                   error: str | None = None, failed: list[str] | None = None,
                   by_source: dict[str, int] | None = None) -> ReadDone:
        return ReadDone(worker_id=self.session.worker_id, lease_id=plan.lease_id, ok=ok,
                        nbytes=stats.nbytes if stats else 0,
                        seconds=stats.seconds if stats else 0.0, error=error,
                        failed_holders=failed or [], by_source=by_source or {})

    def _end_lease(self, plan: ReadPlan, ok: bool, stats: PullStats | None = None,
                   error: str | None = None, failed: list[str] | None = None,
                   by_source: dict[str, int] | None = None) -> None:
        try:
            self.session.call(self._read_done(plan, ok, stats, error, failed, by_source))
        except TensorHubError as exc:  # the lease expires on its own
            log.warning("could not end read lease %s: %s", plan.lease_id, exc)

    def _read(self, plan: ReadPlan, dest: list[torch.Tensor], deadline: float,
              max_replans: int, verifier: Verifier | None, total: PullStats,
              ) -> tuple[ReadPlan, PullStats]:
        """Read a whole-item plan into `total`'s count; a failed source is reported and the
        bytes not yet read are planned again elsewhere, up to `max_replans` failures. The
        last plan's lease is left to the caller, to end after `Hold`."""
        done: set[tuple[int, int, int]] = set()
        failures = 0
        while True:
            try:
                read_plan(self.session.transport, plan, dest,
                          timeout=max(0.001, deadline - time.monotonic()), done=done,
                          stats=total, verifier=verifier)
                return plan, total
            except TransferError as exc:
                self._end_lease(plan, ok=False, error=str(exc),
                                failed=[exc.source] if exc.source else None)
                failures += 1
                if failures > max_replans or time.monotonic() > deadline:
                    raise
                unread = [r for r in split(plan) if r.key() not in done]
                log.warning("%s: reading %s v%d failed (%s); planning the missing %.1f MiB "
                            "again", self.session.name, self.model, plan.version, exc,
                            sum(r.nbytes for r in unread) / 2**20)
                plan = self._plan(plan.version, deadline,
                                  [ByteRange(item=r.item, offset=r.offset, nbytes=r.nbytes)
                                   for r in unread], known=plan)
            except BaseException as exc:
                self._end_lease(plan, ok=False, error=str(exc))
                raise

    def _first_request(self, dest: list[torch.Tensor]) -> dict:
        """A striped pull's first plan request: our memory, when we serve what we pull."""
        if not self.chunked:
            return {}
        self._registrations = self.session.registrations
        relay = not self.staging
        return {"relay": relay,
                "memory": [describe(b) for b in dest] if relay else None,
                "endpoint": self.session.transport.endpoint() if relay else None}

    def _ask_again(self, plan: ReadPlan, dest: list[torch.Tensor], action: Replan,
                   deadline: float) -> ReadPlan:
        """A striped pull's later plan request: parents for `action.stripes` (our memory
        again only if the coordinator restarted since and does not know it)."""
        again = self.session.registrations != self._registrations \
            or not self.last_pull_planned  # (the coordinator may not expect us)
        first = self._first_request(dest) if again else {"relay": not self.staging}
        return self._plan(plan.version, deadline, known=plan, stripes=list(action.stripes),
                          failed=list(action.failed), behind=list(action.behind), **first)

    def pull(self, version: int | str = "latest", timeout: float = 60.0,
             max_replans: int = 3) -> int:
        """Pull `version` (or the latest) into this replica's buffers; return the version.

        A source that fails mid-read is reported (the coordinator drops its references)
        and only the missing ranges are re-planned from another holder, up to
        `max_replans` times. Raises `CoordinatorError` (unknown model/version, no holder
        left), `TransferError`, `IntegrityError` or `LayoutError`; see the class docstring
        for what a failure leaves behind."""
        deadline = time.monotonic() + timeout
        late_before = self._late_reads()  # a late read landing from here on: verify again
        warm = self._warm_plan(version)
        self.last_pull_planned = warm is None
        if self.layout is None and (self.chunked or self.part.part):
            # A striped pull's first request carries our buffers (and a part's plan names
            # its layout): allocate them first, from the announcement if it says the
            # manifest (no coordinator call), else from the coordinator.
            announced = self._announced_manifest(version)
            if announced is not None:
                version, manifest, parts = announced.version, announced.manifest, 1
            else:
                reply = self.session.call(GetManifest(model=self.model, version=version,
                                                      part=self.part.part))
                manifest, parts = reply.manifest, reply.parts
                if parts > self.part.parts and self.part.parts == 1 and self.part.part == 0:
                    raise LayoutError(f"{self.model} v{reply.version} is published in "
                                      f"{parts} parts (a sharded trainer): read it with "
                                      f"tensorhub.PartedReplica, which pulls every part")
            self.part = Part(part=self.part.part, parts=parts)
            self._bind(BoundLayout.allocate(manifest, self._device))
        dest = self._staged if self.staging else self.layout.item_bytes if self.layout else []
        if self.chunked and not self.staging:
            self.session.progress.zero_()  # no byte of an older pull may pass for this one
        if warm is not None:
            log.info("%s: pulling %s v%d from the parents of %s (no plan to wait for)",
                     self.session.name, self.model, warm.version,
                     "its standby" if self.version is None else f"v{self.version}")
        plan = warm or self._plan(version, deadline, **self._first_request(dest))
        if plan.version == self.version:
            self._end_lease(plan, ok=True)
            return plan.version
        if self.layout is None:
            try:
                self._bind(BoundLayout.allocate(plan.manifest, self._device))
            except BaseException as exc:
                self._end_lease(plan, ok=False, error=str(exc))
                raise
        if plan.layout_id != self.layout.layout_id:
            self._end_lease(plan, ok=False, error="layout mismatch")
            raise LayoutError(f"{self.model} v{plan.version} has layout {plan.layout_id}, "
                              f"this replica {self.layout.layout_id}")
        dest = self._staged if self.staging else self.layout.item_bytes
        previous = self.version
        by_source: dict[str, int] | None = None
        reader: StripedReader | None = None
        stats = PullStats(self.model, plan.version, [], 0, 0.0)
        self.session.pulling = self._progress(plan.version, dest, stats, lambda: reader)
        try:
            if not self.staging and previous is not None:
                self.version = None  # from here on our buffers are not a complete version
                self.session.withdraw(self.model, previous, deadline - time.monotonic())
            verifier = Verifier(plan, dest) if self.verify else None
            try:
                if self.chunked:
                    reader = StripedReader(
                        self.session, plan, dest, not self.staging, verifier,
                        lambda action: self._ask_again(reader.plan, dest, action, deadline),
                        confirm=self._confirm(plan, dest, deadline) if warm else None)
                    plan = reader.run(deadline, max_replans)
                    stats, by_source = reader.stats, reader.by_source
                else:
                    plan, stats = self._read(plan, dest, deadline, max_replans, verifier,
                                             stats)
            except BaseException:
                if verifier is not None:
                    verifier.close()
                raise
            if verifier is not None:
                stats.verify_seconds = verifier.finish()
        except BaseException as exc:
            self.session.pulling = None
            if self.chunked and not self.staging:
                self.session.progress.zero_()  # our children stop reading from us
            self._end_leases(plan, reader, str(exc))
            if self.chunked and not self.staging:
                self._stop_serving_partial(plan.version, deadline)
            raise
        try:
            if self.staging:
                if previous is not None:
                    self.version = None
                    self.session.withdraw(self.model, previous,
                                          max(1.0, deadline - time.monotonic()))
                for live, staged in zip(self.layout.item_bytes, dest, strict=True):
                    live.copy_(staged)
            self.layout.scatter()
            # Hold before ending the lease: a reader planned in between then finds us as a
            # holder, rather than a momentarily idle trainer (trees, not stars).
            self.session.hold(self.model, plan.version, self.layout, plan.checksums, self.part)
            self.version = plan.version
            self._checksums, self._late_seen = plan.checksums, late_before
            if reader is not None and not self.staging:
                self._remember_parents(reader)
        finally:
            self.session.pulling = None
            self._end_lease(plan, ok=self.version == plan.version, stats=stats,
                            by_source=by_source)
        self.last_pull = stats
        metrics.pulled(self.model, plan.version, stats.nbytes, stats.seconds)
        log.info("%s pulled %s v%d from %s: %.1f MiB in %.3fs (%.2f GB/s)", self.session.name,
                 self.model, plan.version, ",".join(stats.sources), stats.nbytes / 2**20,
                 stats.seconds, stats.gbps)
        return plan.version

    def _end_leases(self, plan: ReadPlan, reader: StripedReader | None, error: str) -> None:
        """End every lease a failed pull may hold: its first plan's, its last plan's (a
        re-plan or a confirmation may have brought another), and that of a confirmation
        still under way once it is answered (else each would count against its sources,
        as a read in flight, until it expires: a trainer withdrawing waits for them)."""
        last = reader.plan if reader is not None else plan
        self._end_lease(last, ok=False, error=error)
        if plan.lease_id != last.lease_id:
            self._end_lease(plan, ok=False, error=error)
        pending = reader.confirm if reader is not None else None
        if pending is not None:
            def end(future: Future) -> None:
                if future.exception() is None and future.result().lease_id not in (
                        plan.lease_id, last.lease_id):
                    self._end_lease(future.result(), ok=False, error=error)
            pending.add_done_callback(end)

    def _progress(self, version: int, dest: list[torch.Tensor], stats: PullStats,
                  striped: Callable[[], StripedReader | None]) -> Callable[[], PullProgress]:
        """How far this pull is, for the session's heartbeats (a striped pull counts in its
        reader's stats, a whole-item pull in `stats`)."""
        total = sum(t.numel() * t.element_size() for t in dest)
        started = time.monotonic()

        def progress() -> PullProgress:
            reader = striped()
            done = (reader.stats if reader is not None else stats).nbytes
            return PullProgress(model=self.model, version=version, done=min(done, total),
                                total=total, seconds=time.monotonic() - started)
        return progress

    def _remember_parents(self, reader: StripedReader) -> None:
        """Keep the parents this pull ended with, for the next version (`_warm_plan`), and
        listen for announcements from now on."""
        stripes = reader.plan.stripes
        if not stripes or None in stripes or self.layout is None:
            self._parents = None
            return
        self._parents = _Parents(self.layout.layout_id, tuple(stripes),
                                 {sid: reader.sources[sid] for sid in set(stripes)},
                                 reader.plan.chunk_bytes or 0, self.session.worker_id)
        if self._watcher is None:
            self._watcher = VersionWatcher(self.session, self.model)

    def _confirm(self, warm: ReadPlan, dest: list[torch.Tensor],
                 deadline: float) -> Future:
        """Tell the coordinator, while we already read, that we read by the carried
        parents: it makes our lease hold those parents' bytes for us (and takes us in as a
        new reader if it did not carry us). Its answer is the plan we would have had: the
        pull takes it, and does not complete without it (a version withdrawn meanwhile by
        every holder fails by name, `no_holder`)."""
        future: Future = Future()

        def send() -> None:
            try:
                future.set_result(self._ask_again(warm, dest, Replan(()), deadline))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=send, daemon=True,
                         name=f"tensorhub-confirm-{self.session.name}").start()
        return future

    def announcement(self, version: int | str = "latest") -> Announcement | None:
        """The announcement of `version` (or of the newest), if we listen for them (since
        the first `wait_for_newer`) and heard it."""
        return self._watcher.announcement(version) if self._watcher is not None else None

    def _announced_manifest(self, version: int | str) -> Announcement | None:
        """The announcement of `version` if we listen for them and it carries the manifest
        of a whole (unsharded) version: what a reader with no buffers allocates them by."""
        if self.part != Part():
            return None
        a = self.announcement(version)
        return a if a is not None and a.manifest is not None and a.parts == 1 else None

    def _warm_plan(self, version: int | str) -> ReadPlan | None:
        """A plan for `version` made here, with no coordinator call: the parents of our
        last striped pull, if its announcement says the layout, the chunking and (where a
        parent is the publisher) the publisher's memory are as they were. The coordinator
        carried the same parents over and holds a lease for us by a known id."""
        p = self._parents
        if p is None or self._watcher is None or self.layout is None or self.staging \
                or p.worker_id != self.session.worker_id or p.layout_id != self.layout.layout_id:
            return None
        a = self._watcher.announcement(version)
        if a is None or a.version == self.version or a.layout_id != p.layout_id \
                or not a.checksums or a.chunk_bytes != p.chunk_bytes:
            return None
        for sid, src in p.sources.items():
            if src.role == "trainer" and (sid != a.publisher
                                          or regions_digest(src.memory) != a.memory_digest):
                return None
        sources, stripes = dict(p.sources), list(p.stripes)
        if PUBLISHER in stripes:  # placed on standby under whoever would publish
            if a.source is None or a.source.worker_id != a.publisher or a.parts != 1:
                return None
            sources[a.publisher] = a.source
            stripes = [a.publisher if s == PUBLISHER else s for s in stripes]
        return ReadPlan(model=self.model, version=a.version, layout_id=a.layout_id,
                        manifest=self.layout.manifest, checksums=a.checksums,
                        lease_id=warm_lease_id(self.session.worker_id, self.model, a.version),
                        lease_ttl=0.0, sources=list(sources.values()), ranges=[],
                        chunk_bytes=p.chunk_bytes, stripes=stripes,
                        holding=[sid for sid in sources if sid == a.publisher])

    def _stop_serving_partial(self, version: int, deadline: float) -> None:
        """After a failed pull: others may be reading the chunks we reported; stop offering
        them and give those reads a moment to end before the buffers are written again (a
        reader that still loses that race fails its checksum check: no torn version is
        ever held or served)."""
        try:
            self.session.withdraw(self.model, version,
                                  min(5.0, max(0.5, deadline - time.monotonic())))
        except TensorHubError as exc:
            log.warning("%s: could not withdraw the chunks of %s v%d it served: %s",
                        self.session.name, self.model, version, exc)

    def wait_for_newer(self, timeout: float, than: int | str | None = "ours") -> int | None:
        """Block until the coordinator knows a version newer than ours (or than `than`);
        None at the timeout."""
        if self._watcher is None:
            self._watcher = VersionWatcher(self.session, self.model)
        than = self.version if than == "ours" else than
        deadline = time.monotonic() + timeout
        while True:  # (woken to stand by again while a stripe has no parent yet)
            if self._standing_by_due():
                self.stand_by()
            now = time.monotonic()
            wake = self._standby_at if self.version is None and self._standby_at > now \
                else deadline
            newer = self._watcher.wait_newer(than, max(0.0, min(deadline, wake) - now))
            if newer is not None or time.monotonic() >= deadline:
                return newer

    def _standing_by_due(self) -> bool:
        """No version yet, none announced, and not (fully) placed ahead of the first."""
        p = self._parents
        placed = p is not None and p.worker_id == self.session.worker_id \
            and None not in p.stripes
        return not placed and time.monotonic() >= self._standby_at \
            and self.version is None and self._watcher.latest() is None

    def stand_by(self) -> bool:
        """Be placed now in the forest of the model's first version, in our layout (see
        `StandBy`): when it is announced we pull at once from the parents named here, with
        no plan request to wait for, as a steady fleet pulls from the last version's. For a
        replica whose buffers are ready (given) and that reads striped into them;
        `wait_for_newer` does it while no version exists. True once every stripe has a
        parent (a stripe with none yet is filled when it asks again, or by the pull's
        confirmation). A coordinator that cannot place us is no error: the pull then asks
        for a plan as usual."""
        self._standby_at = time.monotonic() + STANDBY_RETRY
        if not self.chunked or self.staging or self.layout is None or self.part != Part():
            self._standby_at = float("inf")
            return False
        if self._watcher is None:  # (a pull by a placement starts from its announcement)
            self._watcher = VersionWatcher(self.session, self.model)
        try:
            placed: Placement = self.session.call(StandBy(
                worker_id=self.session.worker_id, model=self.model,
                layout_id=self.layout.layout_id,
                memory=[describe(b) for b in self.layout.item_bytes],
                endpoint=self.session.transport.endpoint()))
        except TensorHubError as exc:
            log.info("%s: not on standby for %s (%s); its first pull will ask for a plan",
                     self.session.name, self.model, exc)
            return False
        self._parents = _Parents(placed.layout_id, tuple(placed.stripes),
                                 {s.worker_id: s for s in placed.sources}, placed.chunk_bytes,
                                 self.session.worker_id)
        if None in placed.stripes:
            self._standby_at = time.monotonic() + (placed.retry_after or 0.5)
            return False
        log.info("%s: on standby for %s's first version, under %s", self.session.name,
                 self.model, ", ".join(placed.stripes))
        return True

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
        self.session.close()

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
