"""Striping a chunked pull over several holders at once: a replica's further streams.

A chunked pull's first stream is `Replica._read`'s loop (plan, read, carry the lease's end
on the next plan request). Each further stream is a thread that asks for a plan of its own
covering chunks no stream has planned yet, reads it, ends its lease at once (freeing that
holder's slot), and asks again. The coordinator gives one stream per holder (a reader's
open leases name different holders), so the streams read from different holders at once:
the striping the fleet simulator's workers do (`tensorhub/sim/fleet.py`, `streams`).

What the streams share is guarded here: plan requests go one at a time (`plan_lock`), so no
chunk is ever planned twice (a chunk read twice would count its bytes twice toward the
checksum of its item); the tracker, the progress reporter and the verifier are touched
under `lock`; `changed` wakes the first stream when a further one ends or fails (its unread
bytes are owed again and must be planned by someone).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from tensorhub.core.chunks import ChunkTracker
from tensorhub.core.client import busy_wait
from tensorhub.core.data_types import ByteRange, ReadPlan, ReadRange
from tensorhub.core.errors import CoordinatorError, TensorHubError, TransferError
from tensorhub.core.puller import PullStats, Verifier, read_plan, split
from tensorhub.core.transport import Transport

log = logging.getLogger("tensorhub.streams")

IDLE_WAIT = 0.05  # a further stream with nothing to plan looks again after this long


class PullStreams:
    """The state a chunked pull's streams share (see the module docstring)."""

    def __init__(self, tracker: ChunkTracker, reporter, verifier: Verifier | None,
                 model: str, version: int):
        self.tracker = tracker
        self.reporter = reporter  # _ProgressReporter or None
        self.verifier = verifier
        self.extra = PullStats(model, version, [], 0, 0.0)  # what further streams read
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.plan_lock = threading.Lock()
        self.in_flight = 0  # plans further streams are reading now
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ shared updates
    def landed(self, ranges: list[ReadRange], report_now: bool = True) -> None:
        """A batch of some stream landed: mark its chunks, report the finished ones."""
        with self.lock:
            finished = self.tracker.landed(ranges)
            if self.reporter is not None and finished:
                self.reporter.report(finished, now=report_now)
            self.changed.notify_all()

    def missing(self, unread: list[ByteRange]) -> list[ByteRange]:
        with self.lock:
            return self.tracker.missing(unread)

    def take_progress(self):
        """The chunks not reported yet, as a Progress for the first stream's next plan
        request (None if none, or no reporter)."""
        with self.lock:
            return self.reporter.take() if self.reporter is not None else None

    def report_held_back(self) -> None:
        """Report now the chunks the first stream held back for its next plan request."""
        with self.lock:
            if self.reporter is not None:
                self.reporter.report([], now=True)

    def planned(self, ranges: list[ReadRange]) -> None:
        with self.lock:
            self.tracker.planned(ranges)

    @property
    def complete(self) -> bool:
        with self.lock:
            return self.tracker.complete

    def wait_for_work(self, deadline: float) -> list[ByteRange]:
        """Block until there is something to plan, or the pull is complete (returns []), or
        no further stream reads any more (returns what is missing, maybe [])."""
        with self.lock:
            while True:
                missing = self.tracker.missing([])
                if missing or self.tracker.complete or self.in_flight == 0:
                    return missing
                left = deadline - time.monotonic()
                if left <= 0:
                    return missing
                self.changed.wait(min(left, 1.0))

    # ------------------------------------------------------------------ further streams
    def start(self, count: int, run: Callable[[], None], name: str) -> None:
        for k in range(count):
            t = threading.Thread(target=run, daemon=True, name=f"{name}-stream{k + 2}")
            t.start()
            self._threads.append(t)

    def close(self, timeout: float) -> None:
        """Stop the further streams and wait for their reads to end (no read may still
        write into our buffers after the pull returns or fails)."""
        self.stop.set()
        with self.lock:
            self.changed.notify_all()
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("streams %s did not end within %.1fs", alive, timeout)

    def run_stream(self, transport: Transport, dest: list[torch.Tensor], deadline: float,
                   ask: Callable[[list[ByteRange]], ReadPlan],
                   end_lease: Callable[..., None], max_failures: int) -> None:
        """One further stream: plan what nobody has planned, read it, end the lease, again.
        `ask(missing)` returns a plan or raises `CoordinatorError` (busy: try again later).
        Any failure leaves the stream's unread bytes owed, for some stream to plan again."""
        failures = 0
        while not self.stop.is_set() and time.monotonic() < deadline:
            wait = IDLE_WAIT
            plan = None
            with self.plan_lock:
                if self.stop.is_set() or self.complete:
                    return
                missing = self.missing([])
                if missing:
                    try:
                        plan = ask(missing)
                    except CoordinatorError as exc:
                        if exc.code != "busy":
                            log.info("a further stream stops: %s", exc)
                            return
                        wait = busy_wait(exc.retry_after or IDLE_WAIT)
                    except TensorHubError as exc:
                        log.info("a further stream stops: %s", exc)
                        return
                    if plan is not None and plan.ranges:
                        with self.lock:
                            self.tracker.planned(plan.ranges)
                            self.in_flight += 1
            if plan is None or not plan.ranges:
                if plan is not None:
                    end_lease(plan, ok=True)
                self.stop.wait(wait)
                continue
            failures += not self._read(transport, plan, dest, deadline, end_lease)
            if failures > max_failures:
                return

    def _read(self, transport: Transport, plan: ReadPlan, dest: list[torch.Tensor],
              deadline: float, end_lease: Callable[..., None]) -> bool:
        done: set[tuple[int, int, int]] = set()
        stats = PullStats(plan.model, plan.version, [], 0, 0.0)
        ok, error, failed = False, None, None
        try:
            read_plan(transport, plan, dest, timeout=max(0.001, deadline - time.monotonic()),
                      done=done, stats=stats, verifier=self.verifier, on_batch=self.landed)
            ok = True
        except TransferError as exc:
            error, failed = str(exc), ([exc.source] if exc.source else None)
            log.warning("a further stream's read of %s v%d failed (%s); its bytes are "
                        "planned again", plan.model, plan.version, exc)
        except BaseException as exc:  # whatever it was, the first stream plans the rest
            error = str(exc)
            log.warning("a further stream failed: %s", exc)
        end_lease(plan, ok=ok, stats=stats, error=error, failed=failed)
        with self.lock:
            if not ok:
                self.tracker.missing([r for r in split(plan) if r.key() not in done])
            merge_stats(self.extra, stats)
            self.in_flight -= 1
            self.changed.notify_all()
        return ok


def merge_stats(into: PullStats, more: PullStats) -> None:
    """Add `more`'s bytes and sources to `into` (not its seconds: streams overlap)."""
    into.nbytes += more.nbytes
    for name, n in more.by_source.items():
        if name not in into.by_source:
            into.sources.append(name)
        into.by_source[name] = into.by_source.get(name, 0) + n
