"""A worker that pulls versions into its own buffers and then serves them to others.

`pull` asks the coordinator for a plan, reads one-sided from the holders it names, verifies
every byte against the version's checksums, and only then reports itself as a holder, so
later readers pull from it instead of the trainer.

In place (default) the replica reads straight into its live buffers: before that it
withdraws its reference to the version it holds and waits for reads of it to end, and a
failed pull leaves it holding nothing (`version is None`). With `staging=True` it reads
into a shadow copy while it keeps serving the old version, and a failed pull leaves it
exactly on its previous version; the price is a second copy of the weights in memory.

Striped (default): the coordinator names one parent per stripe of the version once
(`coordinator/forest.py`); the replica reads each chunk from its parent as soon as the
parent has it (it polls the parent's progress bytes one-sided), marks it in its own
progress bytes, and so serves it to its own children while it pulls the next ones
(pipelined replication: a fleet pulls a version in about the time one reader does, and
the coordinator hears from each reader a few times a version, not once a chunk; see
`striped.py`). `whole_items=True` asks for one whole-item plan per pull instead.

What a pull sends and does with the answers is `reader/session.py` (the simulator runs the
same); this module gives it real I/O: the coordinator client, buffers, transports.
"""

from __future__ import annotations

import logging
import time

import torch

from tensorhub import metrics, settings
from tensorhub.core.announcements import VersionWatcher
from tensorhub.core.checksum import checksum
from tensorhub.core.data_types import (
    Announcement,
    GetManifest,
    Manifest,
    Part,
    Placement,
    PlanRequest,
    ReadDone,
    ReadPlan,
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
from tensorhub.core.layout_diff import explain_mismatch
from tensorhub.core.memory import describe
from tensorhub.core.named_tensors import NamedTensors, named_list
from tensorhub.core.patch import PatchError
from tensorhub.core.patch_budget import PatchCosts, Verdict
from tensorhub.core.puller import PullStats, Verifier, check_item, read_plan, read_verified, split
from tensorhub.core.session import WorkerSession, default_name
from tensorhub.core.transport import Transport
from tensorhub.reader.patches import PatchPuller, apply_chain
from tensorhub.reader.session import Parents, PullSession, Reader, failure_text
from tensorhub.reader.striped import StripedReader

log = logging.getLogger("tensorhub.replica")


class Replica:
    """A worker's copy of one model: `pull()` brings its buffers to a version, verified
    against the version's checksums, and from then on it serves that version to others.

    Give it your own tensors (an engine's live parameters, in the publisher's names,
    dtypes, shapes and order) or none (it allocates them from the first version's
    layout). `wait_for_newer(timeout)` blocks until a newer version is announced.

    What a failed pull leaves: in place (default) the replica reads straight into its
    buffers, so a pull that fails after reading began leaves it holding nothing (`version`
    is None; a pull stopped before any byte changed, Ctrl-C while it waited, leaves it on
    the version it held). With `staging=True` it reads into a second copy (host or device
    memory the size of the model) while it keeps serving the old version, and any failed
    pull leaves it exactly on its previous version.
    """

    def __init__(
        self,
        coordinator: str,
        model: str,
        named_tensors: NamedTensors | None = None,
        *,
        name: str | None = None,
        transport: str | Transport | None = None,
        staging: bool = False,
        verify: bool = True,
        compact_threshold: int = DEFAULT_COMPACT_THRESHOLD,
        token: str | None = None,
        timeout: float = 10.0,
        labels: dict[str, str] | None = None,
        device: str = "cpu",
        whole_items: bool = False,
        part: int = 0,
        coordinator_wait: float = 0.0,
        patches: bool = True,
    ):
        """`name`: how status and logs show this worker (default: `replica-HOST-PID`, with
        a number after the first in a process).
        `named_tensors`: the worker's own buffers (live parameters), in checkpoint layout.
        None: allocate buffers from the manifest of the first version pulled (a worker
        joining with no weights of its own). `whole_items`: whole-item plans, no
        striping (one source a pull). `part`: which part of a sharded version this replica
        pulls and holds (`PartedReplica` runs one replica per part). `coordinator_wait`:
        how long to keep trying to register with a coordinator that does not answer.
        `patches`: a replica holding a version takes a newer one as the trainer's patches
        when a short chain of them moves fewer bytes and is expected to land sooner than
        the whole on this replica's measured rates (`reader/patches.py`, `patch_costs`;
        `TENSORHUB_PATCHES=0` turns it off too)."""
        self.model = model
        self.part = Part(part=part, parts=part + 1)  # parts: as the manifest says, once seen
        self.staging = staging
        self.verify = verify
        self.whole_items = whole_items
        self.session = WorkerSession(coordinator, name or default_name("replica"), "replica",
                                     transport, labels, token,
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
        self._parents: Parents | None = None
        self._standby_at = 0.0  # when `wait_for_newer` may stand by (again)
        self._patches = PatchPuller(self.session, model, self._plan, self._end) \
            if patches and settings.PATCHES.get() else None
        self.last_pull_patches: list[int] = []  # the versions the last pull took as patches
        # what a chain of patches is weighed on (our own pull and apply rates), and the
        # last weighing (None: no chain was there to weigh)
        self.patch_costs = PatchCosts()
        self.last_patch_verdict: Verdict | None = None
        self.session.check_held = self._check_held
        self.last_pull_reread = 0  # bytes the last pull read again (they failed checksums)
        self.last_pull_bad_sources: list[str] = []  # names of who served those bad bytes

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
        except IntegrityError as exc:
            version, self.version = self.version, None
            log.error("%s: its copy of %s v%d is damaged (%s); withdrawing it",
                      self.session.name, self.model, version, exc)
            try:
                self.session.withdraw(self.model, version, 10.0, force=True, damaged=True)
            except TensorHubError as exc:
                log.warning("%s: withdrawing v%d: %s", self.session.name, version, exc)
            raise
        if late != self._late_seen:
            log.warning("%s: a late read landed; %s v%d verified again: whole",
                        self.session.name, self.model, self.version)
        self._late_seen = late

    def _check_held(self, model: str, version: int) -> None:
        """Readers found bad bytes of `version` (the heartbeat loop's thread): verify our
        copy; a damaged one is withdrawn (`reverify`), a whole one offered again later."""
        if model == self.model and version == self.version:
            try:
                self.reverify(always=True)
            except IntegrityError:
                return
            log.info("%s: readers reported bad bytes of %s v%d; our copy verifies whole",
                     self.session.name, model, version)

    # ------------------------------------------------------------------ pulling
    def _reader(self, dest: list[torch.Tensor]) -> Reader:
        relay = not self.whole_items and not self.staging
        return Reader(self.model, self.layout.layout_id if self.layout else None,
                      [describe(b) for b in dest] if relay else None,
                      self.session.transport.endpoint(), relay, self.whole_items)

    def _plan(self, pull: PullSession, request: PlanRequest | StripedRequest) -> None:
        """Ask for a plan, and again while the session says to wait (busy holders, none
        left for a moment)."""
        while True:
            try:
                pull.planned(self.session.call(request), time.monotonic())
                return
            except CoordinatorError as exc:
                wait = pull.refused(exc.code, exc.retry_after, time.monotonic())
                if wait is None:
                    raise
                time.sleep(wait)

    def _end(self, dones: list[ReadDone]) -> None:
        for done in dones:
            try:
                self.session.call(done)
            except TensorHubError as exc:  # the lease expires on its own
                log.warning("could not end read lease %s: %s", done.lease_id, exc)

    def _read_around(self, pull: PullSession, dest: list[torch.Tensor], items: list[int],
                     first: IntegrityError, deadline: float) -> None:
        """`items` failed their checksums: read them again from another holder (the
        publisher only when nobody else holds the version), and name the source whose bytes
        changed (`PullSession.blame`; the coordinator hears it with the pull's end). Raises
        the `IntegrityError` only when no other holder gives bytes that pass."""
        avoid = {src for *_, src in pull.pieces(items)}
        log.warning("%s: %s v%d: %d item(s) failed their checksums (%s); reading them again "
                    "from a holder other than %s", self.session.name, self.model,
                    pull.plan.version, len(items), first,
                    ", ".join(sorted(pull.sources[s].name for s in avoid if s in pull.sources)))
        for _ in range(settings.REREAD_TRIES):
            pieces = pull.pieces(items)
            before = [checksum(dest[k][o:o + n]) for k, o, n, _ in pieces]
            try:
                plan = pull.reread_planned(self.session.call(pull.reread_request(items, avoid)))
            except CoordinatorError as exc:
                log.warning("%s: no other holder to read %s v%d's bad items from (%s)",
                            self.session.name, self.model, pull.plan.version, exc)
                raise first from None
            source = plan.ranges[0].source if plan.ranges else None
            try:
                read_plan(self.session.transport, plan, dest,
                          timeout=max(0.001, deadline - time.monotonic()),
                          stats=pull.stats, on_batch=pull.served)
            except TransferError as exc:
                self._end([pull.reread_done(plan, False, str(exc), exc.source)])
                avoid.add(exc.source or source or "")
                continue
            self._end([pull.reread_done(plan, True)])
            still = []
            for k in items:
                try:
                    check_item(pull.plan, k, dest[k])
                except IntegrityError:
                    still.append(k)
            done = [k for k in items if k not in still]
            if done:
                after_pieces = [p for p in pieces if p[0] in done]
                bad = pull.blame(after_pieces,
                                 [b for p, b in zip(pieces, before, strict=True) if p[0] in done],
                                 [checksum(dest[k][o:o + n]) for k, o, n, _ in after_pieces])
                log.warning("%s: %s v%d: read %d item(s) again from %s and they pass; bad "
                            "bytes came from %s", self.session.name, self.model,
                            pull.plan.version, len(done),
                            pull.sources[source].name if source in pull.sources else source,
                            ", ".join(sorted(pull.sources[b].name if b in pull.sources else b
                                             for b in bad)) or "nobody identified")
            if not still:
                return
            items = still
            if source:
                avoid.add(source)
        raise first

    def _read_whole(self, pull: PullSession, dest: list[torch.Tensor],
                    verifier: Verifier | None) -> None:
        """Read a whole-item plan; a failed source is reported and the bytes not yet read
        are planned again elsewhere, up to `max_replans` failures."""
        done: set[tuple[int, int, int]] = set()
        while True:
            try:
                read_plan(self.session.transport, pull.plan, dest,
                          timeout=max(0.001, pull.deadline - time.monotonic()), done=done,
                          stats=pull.stats, verifier=verifier, on_batch=pull.served)
                return
            except TransferError as exc:
                self._end([pull.source_failed(str(exc), exc.source)])
                if pull.failures > pull.max_replans or time.monotonic() > pull.deadline:
                    raise
                unread = [r for r in split(pull.plan) if r.key() not in done]
                log.warning("%s: reading %s v%d failed (%s); planning the missing %.1f MiB "
                            "again", self.session.name, self.model, pull.plan.version, exc,
                            sum(r.nbytes for r in unread) / 2**20)
                self._plan(pull, pull.missing_request(unread))

    def pull(self, version: int | str = "latest", timeout: float = 60.0,
             max_replans: int = 3, announce_wait: float = 0.0) -> int:
        """Pull `version` (or the latest) into this replica's buffers; return the version.

        A source that fails mid-read is reported (the coordinator drops its references)
        and only the missing ranges are re-planned from another holder, up to
        `max_replans` times. Raises `CoordinatorError` (unknown model/version, no holder
        left), `TransferError`, `IntegrityError` or `LayoutError`; see the class docstring
        for what a failure leaves behind.

        `announce_wait`: a `version` not announced yet (the trainer has not published it)
        is waited for up to this long, listening to announcements, before the pull's
        `timeout` starts; 0: it fails at once (`CoordinatorError`, "unknown_version")."""
        if isinstance(version, int) and announce_wait > 0:
            self._await_announcement(version, announce_wait)
        deadline = time.monotonic() + timeout
        late_before = self._late_reads()  # a late read landing from here on: verify again
        self.last_pull_patches = []
        if self._patches is not None and self.version is not None and self.part == Part() \
                and not self.whole_items and late_before == self._late_seen:
            # (a read given up earlier that landed since may have changed bytes no patch
            # touches: then only a whole pull rewrites them all)
            patched = self._pull_by_patches(version, deadline, late_before)
            if patched is not None:
                return patched
        warm = self._warm_plan(version)
        self.last_pull_planned = warm is None
        if self.layout is None and (not self.whole_items or self.part.part):
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
        relay = not self.whole_items and not self.staging
        if relay:
            self.session.progress.zero_()  # no byte of an older pull may pass for this one
        if warm is not None:
            log.info("%s: pulling %s v%d from the parents of %s (no plan to wait for)",
                     self.session.name, self.model, warm.version,
                     "its standby" if self.version is None else f"v{self.version}")
        pull = PullSession(self._reader(dest), self.session.worker_id, version,
                           now=time.monotonic(), deadline=deadline, warm=warm,
                           held=self.version, max_replans=max_replans, stall=settings.BEHIND_AFTER,
                           poll_max=settings.POLL_MAX)
        registrations = self.session.registrations
        if warm is None:
            try:
                self._plan(pull, pull.first_request())
            except CoordinatorError as exc:
                # (a layout the coordinator knows but plans no reads from, `layout_unserved`,
                # is no difference of tensors: that refusal says what to do itself)
                if exc.code != "layout_mismatch" or self.layout is None:
                    raise
                raise self._mismatch(version, exc) from None
        plan = pull.plan
        if pull.held_already:
            self._end(pull.end(ok=True))
            return plan.version
        if self.layout is None:
            try:
                self._bind(BoundLayout.allocate(plan.manifest, self._device))
            except BaseException as exc:
                self._end(pull.end(ok=False, error=str(exc)))
                raise
        if plan.layout_id != self.layout.layout_id:
            self._end(pull.end(ok=False, error="layout mismatch"))
            raise self._mismatch(plan.version, LayoutError(
                f"{self.model} v{plan.version} has layout {plan.layout_id}, this replica "
                f"{self.layout.layout_id}"))
        dest = self._staged if self.staging else self.layout.item_bytes
        previous = self.version
        self.session.pulling = lambda: pull.progress(time.monotonic())
        reading = False  # whether a read into `dest` may have begun
        try:
            if not self.staging and previous is not None:
                self.version = None  # from here on our buffers are not a complete version
                self.session.withdraw(self.model, previous, deadline - time.monotonic())
            reading = True

            def read(verifier: Verifier | None) -> None:
                if self.whole_items:
                    self._read_whole(pull, dest, verifier)
                else:
                    StripedReader(self.session, pull, dest, verifier, self.session.call,
                                  lambda done: self._end([done]), registrations).run()

            try:
                pull.stats.verify_seconds = read_verified(plan, dest, read, self.verify)
            except IntegrityError as exc:
                if not exc.items:  # (bad items are named only once everything was read)
                    raise
                self._read_around(pull, dest, list(exc.items), exc, deadline)
        except BaseException as exc:
            self.session.pulling = None
            if relay:
                self.session.progress.zero_()  # our children stop reading from us
            self._end(pull.end(ok=False, error=failure_text(exc)))
            if relay:
                self._stop_serving_partial(plan.version, deadline)
            if not reading and previous is not None and not self.staging:
                self._hold_again(previous)
            raise
        try:
            self._install(previous, dest, deadline)
            # Hold before ending the lease: a reader planned in between then finds us as a
            # holder, rather than a momentarily idle trainer (trees, not stars).
            self.session.offer(pull.hold(self.layout.memory(), self.layout.manifest,
                                         self.part, self.session.transport.endpoint()),
                               self.layout, planned=True)
            self.version = plan.version
            self._checksums, self._late_seen = plan.checksums, late_before
            if relay:
                self._parents = pull.parents(self.session.worker_id)
                if self._parents is not None and self._watcher is None:
                    self._watcher = VersionWatcher(self.session, self.model)
        finally:
            self.session.pulling = None
            self._end(pull.end(ok=self.version == plan.version))
        stats: PullStats = pull.stats
        self.last_pull = stats
        if self.version == plan.version and previous is not None and not self.whole_items:
            # (a first pull's time is mostly setting up: connections, registrations)
            self.patch_costs.pulled_whole(stats.nbytes, stats.seconds)
        self.last_pull_reread = pull.reread_bytes
        self.last_pull_bad_sources = sorted(
            pull.sources[s].name if s in pull.sources else s for s in pull.bad_sources)
        metrics.pulled(self.model, plan.version, stats.nbytes, stats.seconds)
        log.info("%s pulled %s v%d from %s: %.1f MiB in %.3fs (%.2f GB/s)", self.session.name,
                 self.model, plan.version, ",".join(stats.sources), stats.nbytes / 2**20,
                 stats.seconds, stats.gbps)
        return plan.version

    def _await_announcement(self, version: int, wait: float) -> None:
        """Block until `version` (or a newer one) is announced, up to `wait` seconds: a
        reader that asked for a plan again and again instead would cost the coordinator a
        refusal of a few KiB each time, across every link between it and the reader."""
        if self._watcher is None:
            self._watcher = VersionWatcher(self.session, self.model)
        if self._watcher.wait_newer(version - 1, wait) is None:
            latest = self._watcher.latest()
            raise CoordinatorError(
                f"{self.model!r} v{version} was not announced within {wait:g} s (latest: "
                f"{'none' if latest is None else f'v{latest}'}); is the trainer publishing?",
                code="unknown_version")

    def _hold_again(self, version: int) -> None:
        """A pull stopped before any byte of our buffers changed (interrupted while it
        waited for reads of `version` to end, say): we still hold `version` whole, so we
        are on it again and offer it as before."""
        self.version = version
        try:
            self.session.hold(self.model, version, self.layout, self._checksums, self.part)
        except TensorHubError as exc:  # (superseded meanwhile and forgotten: no matter)
            log.log(logging.INFO if exc.code == "unknown_version" else logging.WARNING,
                    "%s: still on %s v%d, not offered to readers again: %s",
                    self.session.name, self.model, version, exc)

    def _mismatch(self, version: int | str, refusal: TensorHubError) -> TensorHubError:
        """A `LayoutError` that says how our tensors differ from the layout `version` is
        published in (its manifest, from the coordinator); `refusal` as it is when the
        published layout is ours or cannot be had."""
        try:
            reply = self.session.call(GetManifest(model=self.model, version=version,
                                                  part=self.part.part))
        except TensorHubError:
            return refusal
        if reply.layout_id == self.layout.layout_id:
            return refusal
        return LayoutError(explain_mismatch(self.model, reply.version, self.layout.manifest,
                                            reply.manifest, self.layout.layout_id,
                                            reply.layout_id))

    def _install(self, previous: int | None, dest: list[torch.Tensor],
                 deadline: float) -> None:
        """A complete, verified version in `dest` becomes our tensors' values: from the
        staging copy, once reads of the version we held have ended."""
        if self.staging:
            if previous is not None:
                self.version = None
                self.session.withdraw(self.model, previous,
                                      max(1.0, deadline - time.monotonic()))
            for live, staged in zip(self.layout.item_bytes, dest, strict=True):
                live.copy_(staged)
        self.layout.scatter()

    def _pull_by_patches(self, version: int | str, deadline: float,
                         late_before: int) -> int | None:
        """Take `version` as the chain of patches from ours, applied to our buffers (the
        staging copy with `staging`) and verified against the version's checksums; None
        when there is no such chain worth taking, or it failed (then the version is pulled
        whole: in place, our buffers are no version any more, and the whole pull rewrites
        every byte)."""
        target = self._patches.target(version, self.version, self.layout.layout_id,
                                      self._watcher)
        try:
            chain = self._patches.chain(self.version, target.version, self.layout.nbytes,
                                        self._watcher) if target is not None else None
        except TensorHubError as exc:
            log.info("%s: no patches to %s v%d (%s)", self.session.name, self.model,
                     target.version, exc)
            return None
        if chain is None:
            return None
        verdict = self.patch_costs.reader_verdict(sum(link.nbytes for link in chain),
                                                  self.layout.nbytes, len(chain))
        self.last_patch_verdict = verdict
        if not verdict.patch:
            log.info("%s: %s v%d whole, not as patches (%s)", self.session.name, self.model,
                     target.version, verdict.why)
            return None
        started = time.monotonic()
        try:
            patches = [self._patches.pull(link, deadline) for link in chain]
        except (TensorHubError, ValueError) as exc:
            log.warning("%s: pulling the patches to %s v%d failed (%s); pulling it whole",
                        self.session.name, self.model, target.version, exc)
            return None
        self.patch_costs.pulled_patches(len(chain), sum(link.nbytes for link in chain),
                                        time.monotonic() - started)
        previous = self.version
        dest = self._staged if self.staging else self.layout.item_bytes
        if self.staging:
            for staged, live in zip(dest, self.layout.item_bytes, strict=True):
                staged.copy_(live)
        else:
            self.version = None  # from here on our buffers are not a complete version
            self.session.withdraw(self.model, previous, deadline - time.monotonic())
        try:
            applied = apply_chain(chain, patches, dest, self.layout.layout_id,
                                  self._checksums, target)
        except (PatchError, IntegrityError) as exc:
            log.warning("%s: the patches to %s v%d do not give its bytes (%s); pulling it "
                        "whole", self.session.name, self.model, target.version, exc)
            return None
        self._install(previous, dest, deadline)
        self.session.hold(self.model, target.version, self.layout, target.checksums)
        self.version = target.version
        self._checksums, self._late_seen = list(target.checksums), late_before
        nbytes = sum(link.nbytes for link in chain)
        self.patch_costs.applied(nbytes, applied.apply_s, applied.checked_bytes,
                                 applied.check_s)
        self.last_pull = PullStats(self.model, target.version, ["patches"], nbytes,
                                   time.monotonic() - started)
        self.last_pull_patches = [link.version for link in chain]
        self.last_pull_planned = True
        metrics.pulled(self.model, target.version, nbytes, self.last_pull.seconds)
        log.info("%s took %s v%d as %d patch(es) from v%d: %.2f MiB (%.4f of the version) "
                 "in %.3fs", self.session.name, self.model, target.version, len(chain),
                 previous, nbytes / 2**20, nbytes / self.layout.nbytes,
                 self.last_pull.seconds)
        return target.version

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
        """A plan for `version` made here, with no coordinator call, from the parents of
        our last striped pull (or of our standby placement), if its announcement allows
        (`Parents.warm_plan`)."""
        p = self._parents
        if p is None or self._watcher is None or self.layout is None or self.staging \
                or p.layout_id != self.layout.layout_id:
            return None
        a = self._watcher.announcement(version)
        return None if a is None else p.warm_plan(a, self.layout.manifest,
                                                  self.session.worker_id, self.version)

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
        placed = p is not None and p.worker_id == self.session.worker_id and p.complete
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
        self._standby_at = time.monotonic() + settings.STANDBY_RETRY
        if self.whole_items or self.staging or self.layout is None or self.part != Part():
            self._standby_at = float("inf")
            return False
        if self._watcher is None:  # (a pull by a placement starts from its announcement)
            self._watcher = VersionWatcher(self.session, self.model)
        try:
            placed: Placement = self.session.call(
                self._reader(self.layout.item_bytes).stand_by(self.session.worker_id))
        except TensorHubError as exc:
            log.info("%s: not on standby for %s (%s); its first pull will ask for a plan",
                     self.session.name, self.model, exc)
            return False
        self._parents = Parents.placed(placed, self.session.worker_id)
        if not self._parents.complete:
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
