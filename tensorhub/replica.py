"""A worker that pulls versions into its own buffers and then serves them to others.

`pull` asks the coordinator for a plan, reads one-sided from the holders it names, verifies
every byte against the version's checksums, and only then reports itself as a holder, so
later readers pull from it instead of the trainer.

In place (default) the replica reads straight into its live buffers: before that it
withdraws its reference to the version it holds and waits for reads of it to end, and a
failed pull leaves it holding nothing (`version is None`). With `staging=True` it reads
into a shadow copy while it keeps serving the old version, and a failed pull leaves it
exactly on its previous version; the price is a second copy of the weights in memory.

Chunked (default): the replica asks for chunk plans, reports each chunk it has finished
(`Progress`) and serves it to other readers at once, while it pulls the next ones, and asks
again until it has every chunk (pipelined replication: a fleet pulls a version in about the
time one reader does). `chunked=False` asks for one whole-item plan per pull instead.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tensorhub.core.announcements import VersionWatcher
from tensorhub.core.chunks import CHUNK_BYTES, ChunkTracker, chunks_of
from tensorhub.core.client import busy_wait
from tensorhub.core.data_types import (
    ByteRange,
    PlanRequest,
    Progress,
    ReadDone,
    ReadPlan,
    ReadRange,
)
from tensorhub.core.errors import CoordinatorError, LayoutError, TensorHubError, TransferError
from tensorhub.core.layout import DEFAULT_COMPACT_THRESHOLD, BoundLayout, manifest_of, plan_items
from tensorhub.core.memory import describe
from tensorhub.core.puller import PullStats, Verifier, read_plan, split
from tensorhub.core.session import WorkerSession
from tensorhub.core.transport import Transport
from tensorhub.publisher import NamedTensors, named_list
from tensorhub.streams import PullStreams, merge_stats

log = logging.getLogger("tensorhub.replica")

NO_HOLDER_GRACE = 3.0  # seconds a plan waits for holders to (re-)appear before giving up
PROGRESS_TIMEOUT = 1.0  # a Progress report is an optimisation: never wait long for it


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
        streams: int = 2,
    ):
        """`named_tensors`: the worker's own buffers (live parameters), in checkpoint layout.
        None: allocate buffers from the manifest of the first version pulled (a worker
        joining with no weights of its own). `streams`: holders a chunked pull reads from at
        once (each its own plan and lease; 1: one plan at a time)."""
        if streams < 1:
            raise ValueError(f"streams must be at least 1, got {streams}")
        self.model = model
        self.staging = staging
        self.verify = verify
        self.chunked = chunked
        self.streams = streams
        self.session = WorkerSession(coordinator, name, "replica", transport, labels, token,
                                     timeout)
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
        self.last_pull: PullStats | None = None
        self._watcher: VersionWatcher | None = None

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

    # ------------------------------------------------------------------ pulling
    def _plan(self, version, deadline: float, missing: list[ByteRange] | None = None,
              progress: Progress | None = None, done: ReadDone | None = None,
              known: ReadPlan | None = None) -> ReadPlan:
        """Ask for a plan (carrying the previous plan's last `progress` and its lease's end,
        `done`; with `known`, an earlier plan of this pull, the manifest and checksums are
        not sent again); wait while holders are busy, and briefly (a few heartbeats, in case
        holders are re-registering with a restarted coordinator) while none is left."""
        no_holder_until = time.monotonic() + NO_HOLDER_GRACE
        while True:
            try:
                plan = self.session.call(PlanRequest(
                    worker_id=self.session.worker_id, model=self.model, version=version,
                    layout_id=self.layout.layout_id if self.layout else None, missing=missing,
                    chunked=self.chunked, progress=progress, done=done,
                    known_manifest=known is not None))
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
                   error: str | None = None, failed: list[str] | None = None) -> ReadDone:
        return ReadDone(worker_id=self.session.worker_id, lease_id=plan.lease_id, ok=ok,
                        nbytes=stats.nbytes if stats else 0,
                        seconds=stats.seconds if stats else 0.0, error=error,
                        failed_holders=failed or [])

    def _end_lease(self, plan: ReadPlan, ok: bool, stats: PullStats | None = None,
                   error: str | None = None, failed: list[str] | None = None) -> None:
        try:
            self.session.call(self._read_done(plan, ok, stats, error, failed))
        except TensorHubError as exc:  # the lease expires on its own
            log.warning("could not end read lease %s: %s", plan.lease_id, exc)

    def _read(self, plan: ReadPlan, dest: list[torch.Tensor], deadline: float,
              max_replans: int, verifier: Verifier | None = None,
              ) -> tuple[ReadPlan, PullStats]:
        """Read plans until every chunk is here (a whole-item plan covers them all at once);
        when chunked, report each finished chunk so other readers can pull it from us
        meanwhile, and read from up to `streams` holders at once (`tensorhub/streams.py`).
        Every plan but the last ends its lease here; the last one's lease is left to the
        caller, to end after `Hold`. A failed source is reported and the bytes not yet read
        are planned again elsewhere, up to `max_replans` failures."""
        tracker = ChunkTracker(chunks_of(plan_items(plan.manifest),
                                         chunk_bytes=plan.chunk_bytes or CHUNK_BYTES))
        done: set[tuple[int, int, int]] = set()
        total = PullStats(self.model, plan.version, [], 0, 0.0)
        # A staging copy is not served: it is overwritten by the next pull with no withdrawal.
        reporter = _ProgressReporter(self.session, plan, dest) \
            if self.chunked and not self.staging else None
        shared = PullStreams(tracker, reporter, verifier, self.model, plan.version)
        first = plan
        started = time.perf_counter()
        failures = 0
        plan_left = 0  # bytes of the current plan not landed yet

        def on_batch(ranges: list[ReadRange]) -> None:
            nonlocal plan_left
            plan_left -= sum(r.nbytes for r in ranges)
            # The plan's last chunks travel with the next plan request instead.
            shared.landed(ranges, report_now=plan_left > 0)

        def ask(missing: list[ByteRange]) -> ReadPlan:  # a further stream's plan: no waiting
            return self._plan(first.version, time.monotonic(), missing, known=first)

        shared.planned(plan.ranges)
        if self.chunked and self.streams > 1 and not plan.complete:
            shared.start(self.streams - 1, lambda: shared.run_stream(
                self.session.transport, dest, deadline, ask, self._end_lease, max_replans),
                self.session.name)
        try:
            while True:
                plan_left = sum(r.nbytes for r in split(plan) if r.key() not in done)
                before = total.nbytes, total.seconds
                carried: ReadDone | None = None
                try:
                    read_plan(self.session.transport, plan, dest,
                              timeout=max(0.001, deadline - time.monotonic()), done=done,
                              stats=total, verifier=verifier, on_batch=on_batch)
                except TransferError as exc:
                    self._end_lease(plan, ok=False, error=str(exc),
                                    failed=[exc.source] if exc.source else None)
                    failures += 1
                    if failures > max_replans or time.monotonic() > deadline:
                        raise
                    unread = [r for r in split(plan) if r.key() not in done]
                    log.warning("%s: reading %s v%d failed (%s); planning the missing %.1f "
                                "MiB again", self.session.name, self.model, plan.version, exc,
                                sum(r.nbytes for r in unread) / 2**20)
                except BaseException as exc:
                    self._end_lease(plan, ok=False, error=str(exc))
                    raise
                else:
                    unread = []
                    carried = self._read_done(plan, ok=True, stats=PullStats(
                        self.model, plan.version, [], total.nbytes - before[0],
                        total.seconds - before[1]))
                    if shared.complete:
                        break
                # One plan request at a time across streams (no chunk is planned twice);
                # the lock is let go before anything waits for the further streams to end.
                with shared.plan_lock:
                    missing = shared.missing(unread)
                    if not missing:  # the rest is in further streams' hands: wait for them
                        shared.report_held_back()  # (serving our last chunks meanwhile)
                        missing = shared.wait_for_work(deadline)
                    finished = shared.complete
                    if not finished and missing and time.monotonic() <= deadline:
                        plan = self._plan(plan.version, deadline, missing,
                                          progress=shared.take_progress(), done=carried,
                                          known=plan)
                        shared.planned(plan.ranges)
                        continue
                if finished:
                    break
                if carried is not None:
                    self._end_lease(plan, ok=True)
                why = "after the pull timeout" if missing else \
                    "with nothing left to plan (a chunk planned and never read)"
                raise TransferError(f"{self.model} v{plan.version}: not complete {why} "
                                    f"({total.nbytes} bytes read by the first stream)")
        finally:  # no further stream may still write into `dest` once we return or fail
            shared.close(timeout=max(1.0, deadline - time.monotonic()))
            if reporter is not None:
                reporter.close()
        # The first stream's stats plus the further streams' bytes; when those read anything,
        # the pull's seconds are its wall time (streams overlap).
        if shared.extra.nbytes:
            merge_stats(total, shared.extra)
            total.seconds = time.perf_counter() - started
        return plan, total

    def pull(self, version: int | str = "latest", timeout: float = 60.0,
             max_replans: int = 3) -> int:
        """Pull `version` (or the latest) into this replica's buffers; return the version.

        A source that fails mid-read is reported (the coordinator drops its references)
        and only the missing ranges are re-planned from another holder, up to
        `max_replans` times. Raises `CoordinatorError` (unknown model/version, no holder
        left), `TransferError`, `IntegrityError` or `LayoutError`; see the class docstring
        for what a failure leaves behind."""
        deadline = time.monotonic() + timeout
        plan = self._plan(version, deadline)
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
        try:
            if not self.staging and previous is not None:
                self.version = None  # from here on our buffers are not a complete version
                self.session.withdraw(self.model, previous, deadline - time.monotonic())
            verifier = Verifier(plan, dest) if self.verify else None
            try:
                plan, stats = self._read(plan, dest, deadline, max_replans, verifier)
            except BaseException:
                if verifier is not None:
                    verifier.close()
                raise
            if verifier is not None:
                stats.verify_seconds = verifier.finish()
        except BaseException as exc:
            self._end_lease(plan, ok=False, error=str(exc))
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
            self.session.hold(self.model, plan.version, self.layout, plan.checksums)
            self.version = plan.version
        finally:
            self._end_lease(plan, ok=self.version == plan.version, stats=stats)
        self.last_pull = stats
        log.info("%s pulled %s v%d from %s: %.1f MiB in %.3fs (%.2f GB/s)", self.session.name,
                 self.model, plan.version, ",".join(stats.sources), stats.nbytes / 2**20,
                 stats.seconds, stats.gbps)
        return plan.version

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

    def wait_for_newer(self, timeout: float) -> int | None:
        """Block until the coordinator knows a version newer than ours; None at the timeout."""
        if self._watcher is None:
            self._watcher = VersionWatcher(self.session, self.model)
        return self._watcher.wait_newer(self.version, timeout)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
        self.session.close()

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ProgressReporter:
    """Tells the coordinator which chunks of a version this reader has finished, so others
    can read them from it at once. Reports go out on a thread of their own while the next
    batch is read; a plan's last chunks are instead carried by the next plan request
    (`take`), which saves a round trip per plan. Best effort: if the coordinator does not
    answer, the pull goes on without further reports (others then wait for our `Hold`)."""

    def __init__(self, session: WorkerSession, plan: ReadPlan, dest: list[torch.Tensor]):
        self.session = session
        self.progress = Progress(worker_id=session.worker_id, model=plan.model,
                                 version=plan.version, layout_id=plan.layout_id,
                                 memory=[describe(b) for b in dest], chunks=[],
                                 endpoint=session.transport.endpoint())
        self.enabled = True
        self._pending: list[int] = []
        self._sending: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tensorhub-progress")

    def report(self, chunks: list[int], now: bool = True) -> None:
        """Report `chunks` (with any held back) unless a report is still in flight; with
        `now=False` hold them back for `take`."""
        self._pending.extend(chunks)
        if not now or not self.enabled or (self._sending and not self._sending.done()):
            return
        message = self._message()
        if message is not None:
            self._sending = self._pool.submit(self._send, message)

    def take(self) -> Progress | None:
        """The chunks not reported yet, as a Progress to carry with the next request (after
        the report in flight, so the coordinator learns of chunks in order)."""
        if self._sending is not None:
            self._sending.result()
            self._sending = None
        return self._message() if self.enabled else None

    def _message(self) -> Progress | None:
        if not self._pending:
            return None
        message = self.progress.model_copy(update={"chunks": self._pending})
        self._pending = []
        # Memory and endpoint are sent once: they only change when memory is registered.
        self.progress = self.progress.model_copy(update={"endpoint": None, "memory": None})
        return message

    def _send(self, message: Progress) -> None:
        try:
            self.session.call(message, timeout=PROGRESS_TIMEOUT)
        except TensorHubError as exc:
            log.warning("%s: could not report progress of %s v%d (%s); not serving its "
                        "chunks before it is complete", self.session.name, message.model,
                        message.version, exc)
            self.enabled = False

    def close(self) -> None:
        self._pool.shutdown(wait=True)
