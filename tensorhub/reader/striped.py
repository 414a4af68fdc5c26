"""A replica's striped pull over a real transport: a `PullSession` driven by real reads.

The session says what to read, poll or ask; this runs each read and poll on a small pool of
threads (reads from different parents overlap) and each re-ask on a thread of its own,
marks each chunk in our own progress bytes once it has landed (so our children in the
forest can read it from us at once), and feeds the checksum verifier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from tensorhub import settings
from tensorhub.core.data_types import MemoryDesc, ReadDone, ReadPlan, StripedRequest
from tensorhub.core.errors import CoordinatorError, TransferError
from tensorhub.core.puller import Verifier, read_op
from tensorhub.core.session import WorkerSession
from tensorhub.core.stripes import Poll, Read
from tensorhub.core.transport import Peer, ReadOp
from tensorhub.reader.session import Ask, PullSession

log = logging.getLogger("tensorhub.reader.striped")


class StripedReader:
    def __init__(self, session: WorkerSession, pull: PullSession, dest: list[torch.Tensor],
                 verifier: Verifier | None, ask: Callable[[StripedRequest], ReadPlan],
                 end: Callable[[ReadDone], None], registrations: int):
        """`ask`: the coordinator round trip for a plan request (raises
        `CoordinatorError`); `end`: sends a `ReadDone` (of a lease a re-ask brought after
        the pull ended); `registrations`: the session's when the pull began (another
        number: the coordinator forgot us since)."""
        self.session, self.pull, self.dest, self.verifier = session, pull, dest, verifier
        self.ask, self.end = ask, end
        self.relay = pull.reader.relay
        self._registrations = registrations
        self._asking: dict[Future, Ask] = {}

    def run(self) -> None:
        """Pull every chunk (leases are the caller's to end: `PullSession.end`)."""
        pull = self.pull
        started = time.perf_counter()
        pool = ThreadPoolExecutor(2 * len(pull.stripes.stripes),
                                  thread_name_prefix=f"tensorhub-pull-{self.session.name}")
        running: dict[Future, Read | Poll] = {}
        try:
            while not pull.done:
                if self.session.registrations != self._registrations:
                    pull.forgotten()
                for future in [f for f in self._asking if f.done()]:
                    self._answered(self._asking.pop(future), future)
                now = time.monotonic()
                for action in pull.actions(now):
                    if isinstance(action, Ask):
                        self._asking[self._send(action)] = action
                    else:
                        run = self._read if isinstance(action, Read) else self._poll
                        running[pool.submit(run, action)] = action
                wake = pull.wake_at(time.monotonic())
                wait_for = min(1.0, pull.deadline - time.monotonic()) if wake is None \
                    else max(0.0, wake - time.monotonic())
                waiting = [*running, *self._asking]
                if not waiting:
                    time.sleep(max(0.0, min(wait_for, 0.05)))
                    continue
                finished, _ = wait(waiting, timeout=max(0.0, wait_for),
                                   return_when=FIRST_COMPLETED)
                for future in finished:
                    if future in running:
                        self._land(running.pop(future), future.result(), time.monotonic())
        finally:
            # No read may still write into `dest` once we return or raise.
            pool.shutdown(wait=True, cancel_futures=True)
            for future, ask in self._asking.items():  # answered after the pull ended
                future.add_done_callback(lambda f, a=ask: self._answered_late(a, f))
        pull.stats.seconds = time.perf_counter() - started

    # ------------------------------------------------------------------ asks
    def _send(self, ask: Ask) -> Future:
        """The re-ask on a thread of its own: reads go on meanwhile."""
        future: Future = Future()
        log.debug("%s: asking for stripes %s (failed %s, behind %s)", self.session.name,
                  list(ask.replan.stripes) or "none: confirming", list(ask.replan.failed),
                  list(ask.replan.behind))

        def send() -> None:
            try:
                future.set_result(self.ask(ask.request))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=send, daemon=True,
                         name=f"tensorhub-ask-{self.session.name}").start()
        return future

    def _answered(self, ask: Ask, future: Future) -> None:
        now = time.monotonic()
        try:
            plan = future.result()
        except CoordinatorError as exc:
            if self.pull.ended or self.pull.refused(exc.code, exc.retry_after, now,
                                                    ask) is not None:
                return
            raise
        except BaseException:
            if self.pull.ended:
                return
            raise
        log.debug("%s: parents now %s", self.session.name, plan.stripes)
        done = self.pull.answered(ask, plan, now)
        if done is not None:
            self.end(done)

    def _answered_late(self, ask: Ask, future: Future) -> None:
        try:
            self._answered(ask, future)
        except Exception as exc:  # (nothing is left to fail)
            log.debug("%s: a plan request answered after the pull: %s", self.session.name,
                      exc)

    # ------------------------------------------------------------------ reads
    def _read(self, action: Read) -> BaseException | None:
        src = self.pull.sources[action.source]
        ops = [read_op(self.dest, src.memory, seg.item, seg.offset, seg.nbytes)
               for c in action.chunks for seg in self.pull.chunks[c].segments]
        try:
            self.session.transport.read(
                Peer(src.worker_id, src.endpoint, src.grant), ops,
                timeout=max(0.001, min(settings.STALL_TIMEOUT.get(),
                                       self.pull.deadline - time.monotonic())))
        except TransferError as exc:
            self.session.transport.forget_peer(src.worker_id)
            return exc
        return None

    def _poll(self, action: Poll) -> bytes | BaseException:
        src = self.pull.sources[action.source]
        if src.progress is None:  # (no progress bytes: it can only hold everything)
            return bytes([self.pull.stripes.tag]) * (action.hi - action.lo)
        buf = self.session.poll_buffer(action.stripe)[:action.hi - action.lo]
        try:
            self.session.transport.read(
                Peer(src.worker_id, src.endpoint, src.grant),
                [ReadOp(local=buf, remote=MemoryDesc(addr=src.progress.addr + action.lo,
                                                     nbytes=action.hi - action.lo))],
                timeout=max(0.001, min(settings.POLL_TIMEOUT,
                                       self.pull.deadline - time.monotonic())))
        except TransferError as exc:
            self.session.transport.forget_peer(src.worker_id)
            return exc
        return bytes(buf.numpy())

    def _land(self, action: Read | Poll, result, now: float) -> None:
        name = self.pull.sources[action.source].name
        if isinstance(action, Poll):
            if isinstance(result, BaseException):
                log.warning("%s: polling %s failed (%s)", self.session.name, name, result)
                result = None
            self.pull.polled(action, result, now)
            return
        if isinstance(result, BaseException):
            log.warning("%s: reading %s v%d from %s failed (%s); asking for another parent",
                        self.session.name, self.pull.plan.model, self.pull.plan.version, name,
                        result)
            self.pull.landed(action, False, now)
            return
        for c in action.chunks:
            if self.verifier is not None:
                for seg in self.pull.chunks[c].segments:
                    self.verifier.add(seg.item, seg.nbytes)
            if self.relay:  # (after its bytes: children may read it)
                self.session.progress[c] = self.pull.stripes.tag
        self.pull.landed(action, True, now)
