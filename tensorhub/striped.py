"""A replica's striped pull over a real transport: `core/stripes.py` driven by real reads.

The state machine says what to read, poll or ask; this runs each read and poll on a small
pool of threads (reads from different parents overlap), marks each chunk in our own
progress bytes once it has landed (so our children in the forest can read it from us at
once), feeds the checksum verifier, and asks the coordinator again only when the state
machine says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from tensorhub import settings
from tensorhub.core.chunks import CHUNK_BYTES, Chunk, chunks_of
from tensorhub.core.data_types import MemoryDesc, ReadPlan, Source
from tensorhub.core.errors import CoordinatorError, TransferError
from tensorhub.core.layout import plan_items
from tensorhub.core.puller import PullStats, Verifier, read_op
from tensorhub.core.session import WorkerSession
from tensorhub.core.stripes import Poll, Read, Replan, StripedPull, holding_of
from tensorhub.core.transport import Peer, ReadOp

log = logging.getLogger("tensorhub.striped")

# A parent with no new chunk for this long, while we wait on it, counts as behind: at
# least this, or a few chunk times at the rate seen so far.
BEHIND_AFTER = 5.0
# The longest gap between polls of a parent that has nothing new: a poll is one small
# one-sided read, and each hop of a stripe's tree may lag its parent by this much.
POLL_MAX = 0.01
# A poll reads a few hundred bytes: a parent that does not answer one in this long is gone
# (or hung), and the stripe goes elsewhere.
POLL_TIMEOUT = 2.0
# How long a pull asks again for a version the coordinator does not know (holders register
# again within a few heartbeats of a coordinator restart) before it fails.
UNKNOWN_GRACE = 15.0


class StripedReader:
    def __init__(self, session: WorkerSession, plan: ReadPlan, dest: list[torch.Tensor],
                 relay: bool, verifier: Verifier | None,
                 ask: Callable[[Replan], ReadPlan], confirm: Future | None = None):
        """`relay`: mark landed chunks in our progress bytes (a staging copy serves none);
        `ask`: the coordinator round trip for a `Replan` (raises `CoordinatorError`);
        `confirm`: a plan request under way while we read (a pull with no plan to wait
        for): its plan is taken when it comes, and the pull ends only once it came."""
        self.session, self.dest, self.relay, self.verifier, self.ask = (
            session, dest, relay, verifier, ask)
        self.confirm = confirm
        self.plan = plan
        chunk_bytes = plan.chunk_bytes or CHUNK_BYTES
        self.chunks: list[Chunk] = chunks_of(plan_items(plan.manifest), chunk_bytes)
        self.state = StripedPull(len(self.chunks), len(plan.stripes or [None]), plan.version,
                                 # a relay marks a chunk once its read ends: one chunk
                                 # a read, or its children would wait for whole batches
                                 batch=1 if relay else max(1, CHUNK_BYTES // chunk_bytes),
                                 stall=BEHIND_AFTER,
                                 poll_max=POLL_MAX, confirming=confirm is not None)
        self.sources: dict[str, Source] = {}
        self.stats = PullStats(plan.model, plan.version, [], 0, 0.0)
        self.by_source: dict[str, int] = {}  # worker id -> bytes
        self._unknown_since: float | None = None  # asked again for an unknown version since
        self._take(plan)

    def _take(self, plan: ReadPlan, confirming: bool = False) -> None:
        self.plan = plan
        self.sources.update({s.worker_id: s for s in plan.sources})
        take = self.state.confirmed if confirming else self.state.assign
        take(list(plan.stripes or []), holding_of(plan), time.monotonic(), plan.retry_after)

    def run(self, deadline: float, max_replans: int) -> ReadPlan:
        """Pull every chunk; return the last plan (its lease is the caller's to end)."""
        started = time.perf_counter()
        pool = ThreadPoolExecutor(2 * len(self.state.stripes) + 1,
                                  thread_name_prefix=f"tensorhub-pull-{self.session.name}")
        running: dict[Future, Read | Poll] = {}
        try:
            while not self.state.done:
                if self.confirm is not None and self.confirm.done():
                    confirmed, self.confirm = self.confirm.result(), None  # (raises)
                    self._take(confirmed, confirming=True)
                    continue
                if self.state.read_all:  # everything read: only the confirmation is left
                    self.confirm.result(timeout=max(0.001, deadline - time.monotonic()))
                    continue
                now = time.monotonic()
                if now > deadline:
                    raise TransferError(f"{self.plan.model} v{self.plan.version}: "
                                        f"{len(self.state.landed)} of {len(self.chunks)} "
                                        f"chunks after the pull timeout")
                if self.state.failures > max_replans:
                    raise TransferError(f"{self.plan.model} v{self.plan.version}: "
                                        f"{self.state.failures} failed reads (at most "
                                        f"{max_replans} re-plans)")
                for action in self.state.actions(now):
                    if isinstance(action, Replan):
                        self._replan(action)
                    else:
                        run = self._read if isinstance(action, Read) else self._poll
                        running[pool.submit(run, action, deadline)] = action
                wake = self.state.wake_at(time.monotonic())
                wait_for = min(1.0, deadline - time.monotonic()) if wake is None \
                    else max(0.0, wake - time.monotonic())
                if not running:
                    time.sleep(min(wait_for, 0.05))
                    continue
                finished, _ = wait(running, timeout=wait_for, return_when=FIRST_COMPLETED)
                for future in finished:
                    action = running.pop(future)
                    self._land(action, future.result(), time.monotonic())
        finally:
            # No read may still write into `dest` once we return or raise.
            pool.shutdown(wait=True, cancel_futures=True)
        self.stats.seconds = time.perf_counter() - started
        return self.plan

    # ------------------------------------------------------------------ actions
    def _replan(self, action: Replan) -> None:
        try:
            self._take(self.ask(action))
            self._unknown_since = None
        except CoordinatorError as exc:
            # `no_holder` (after `_plan`'s grace): no copy is left that could finish this
            # version; the pull fails now rather than at its timeout, and the caller can
            # take a newer version. A version the coordinator does not know is asked again
            # (a restarted coordinator, its holders registering again), for a while only:
            # one whose holders all left is gone.
            if exc.code not in ("busy", "unknown_model", "unknown_version"):
                raise
            now = time.monotonic()
            if exc.code != "busy":
                self._unknown_since = self._unknown_since or now
                if now - self._unknown_since > UNKNOWN_GRACE:
                    raise
            self.state.asked_failed(now, exc.retry_after or 0.2)

    def _read(self, action: Read, deadline: float) -> BaseException | None:
        src = self.sources[action.source]
        ops = [read_op(self.dest, src.memory, seg.item, seg.offset, seg.nbytes)
               for c in action.chunks for seg in self.chunks[c].segments]
        try:
            self.session.transport.read(
                Peer(src.worker_id, src.endpoint, src.grant), ops,
                timeout=max(0.001, min(settings.STALL_TIMEOUT.get(), deadline - time.monotonic())))
        except TransferError as exc:
            self.session.transport.forget_peer(src.worker_id)
            return exc
        return None

    def _poll(self, action: Poll, deadline: float) -> bytes | BaseException:
        src = self.sources[action.source]
        if src.progress is None:  # (no progress bytes: it can only hold everything)
            return bytes([self.state.tag]) * (action.hi - action.lo)
        buf = self.session.poll_buffer(action.stripe)[:action.hi - action.lo]
        try:
            self.session.transport.read(
                Peer(src.worker_id, src.endpoint, src.grant),
                [ReadOp(local=buf, remote=MemoryDesc(addr=src.progress.addr + action.lo,
                                                     nbytes=action.hi - action.lo))],
                timeout=max(0.001, min(POLL_TIMEOUT, deadline - time.monotonic())))
        except TransferError as exc:
            self.session.transport.forget_peer(src.worker_id)
            return exc
        return bytes(buf.numpy())

    def _land(self, action: Read | Poll, result, now: float) -> None:
        if isinstance(action, Poll):
            if isinstance(result, BaseException):
                log.warning("%s: polling %s failed (%s)", self.session.name,
                            self.sources[action.source].name, result)
                result = None
            self.state.polled(action, result, now)
            return
        if isinstance(result, BaseException):
            log.warning("%s: reading %s v%d from %s failed (%s); asking for another parent",
                        self.session.name, self.plan.model, self.plan.version,
                        self.sources[action.source].name, result)
            self.state.read_done(action, False, now)
            return
        nbytes = 0
        for c in action.chunks:
            for seg in self.chunks[c].segments:
                nbytes += seg.nbytes
                if self.verifier is not None:
                    self.verifier.add(seg.item, seg.nbytes)
            if self.relay:
                self.session.progress[c] = self.state.tag  # after its bytes: children may read it
        name = self.sources[action.source].name
        if name not in self.stats.by_source:
            self.stats.sources.append(name)
        self.stats.by_source[name] = self.stats.by_source.get(name, 0) + nbytes
        self.by_source[action.source] = self.by_source.get(action.source, 0) + nbytes
        self.stats.nbytes += nbytes
        self.state.read_done(action, True, now)
