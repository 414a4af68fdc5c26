"""One reader's pull as a protocol, with no I/O: the messages it sends and what it does with
the answers.

A pull begins with a plan request (or, in a steady fleet, with no request at all: a plan made
here from the parents of the last pull, `Parents.warm_plan`, and a confirmation sent while it
reads); a striped pull then asks again only for stripes whose parent failed, fell behind or
was not named yet (`core/stripes.py` says when); it ends with `Hold` (on success) and
`ReadDone` for every lease it was given. `Replica` drives a `PullSession` with real I/O
(`replica.py`, `striped.py`), the simulator on its clock and links (`sim/swarm.py`): each
message is built here once, so both send the same ones.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tensorhub import settings
from tensorhub.core.chunks import CHUNK_BYTES, Chunk, chunks_of
from tensorhub.core.data_types import (
    PUBLISHER,
    Announcement,
    ByteRange,
    ConfirmParents,
    Endpoint,
    Hold,
    Manifest,
    MemoryDesc,
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
from tensorhub.core.errors import CoordinatorError, TransferError
from tensorhub.core.layout import plan_items
from tensorhub.core.memory import regions_digest
from tensorhub.core.patch import is_patch_model
from tensorhub.core.puller import PullStats
from tensorhub.core.stripes import (
    Poll,
    Read,
    Replan,
    StripedPull,
    holding_of,
    progress_tag,
    warm_lease_id,
)

# A busy reply's retry_after is scaled by 1 +- this (uniform): readers refused together
# (every reader asks at once when a version is announced) ask again out of step, so a
# holder whose slot frees is taken at once, not at the next common tick.
BUSY_RETRY_JITTER = 0.5


def failure_text(exc: BaseException) -> str:
    """How a failed pull is recorded (the coordinator's status shows it): Ctrl-C as
    "interrupted", never an empty text."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return str(exc) or type(exc).__name__


def busy_wait(retry_after: float, jitter: float = BUSY_RETRY_JITTER,
              rng: random.Random | None = None) -> float:
    """How long a reader refused as busy waits before asking again (the simulator passes its
    own seeded `rng` and jitter)."""
    return retry_after * (1 + jitter * (rng or random).uniform(-1.0, 1.0))


@dataclass(frozen=True)
class Reader:
    """What a reader's requests say of it: its model, its layout (None: it has no buffers
    yet), its destination regions and its endpoint (sent in a plan request only when it
    serves what it pulls: `relay`; a staging copy serves nothing)."""

    model: str
    layout_id: str | None
    memory: list[MemoryDesc] | None
    endpoint: Endpoint | None = None
    relay: bool = True
    whole_items: bool = False

    def stand_by(self, worker_id: str) -> StandBy:
        """Ask to be placed in the forest of the model's first version (`Placement`)."""
        return StandBy(worker_id=worker_id, model=self.model, layout_id=self.layout_id,
                       memory=self.memory, endpoint=self.endpoint)


@dataclass(frozen=True)
class Parents:
    """The parents a striped pull ended with, or a standby placement named (`PUBLISHER` for
    the coming version's publisher): the next version of the same layout is pulled from
    them, with no plan request, if its announcement allows (`warm_plan`)."""

    layout_id: str
    stripes: tuple[str | None, ...]
    sources: dict[str, Source]
    chunk_bytes: int
    worker_id: str  # the reader's when it had them (the coordinator's leases name it)

    @classmethod
    def placed(cls, placement: Placement, worker_id: str) -> Parents:
        return cls(placement.layout_id, tuple(placement.stripes),
                   {s.worker_id: s for s in placement.sources}, placement.chunk_bytes,
                   worker_id)

    @property
    def complete(self) -> bool:
        """Every stripe has a parent."""
        return None not in self.stripes

    def warm_plan(self, a: Announcement, manifest: Manifest, worker_id: str,
                  held: int | None) -> ReadPlan | None:
        """A plan for the announced version made here, with no coordinator call, if the
        announcement says the layout, the chunking and (where a parent is the publisher)
        the publisher's memory are as they were. The coordinator carried the same parents
        over and holds a lease for us by a known id (`warm_lease_id`)."""
        if worker_id != self.worker_id or a.version == held or a.layout_id != self.layout_id \
                or not a.checksums or a.chunk_bytes != self.chunk_bytes:
            return None
        for sid, src in self.sources.items():
            if src.role == "trainer" and (sid != a.publisher
                                          or regions_digest(src.memory) != a.memory_digest):
                return None
        sources, stripes = dict(self.sources), list(self.stripes)
        if PUBLISHER in stripes:  # placed on standby under whoever would publish
            if a.source is None or a.source.worker_id != a.publisher or a.parts != 1:
                return None
            sources[a.publisher] = a.source
            stripes = [a.publisher if s == PUBLISHER else s for s in stripes]
        return ReadPlan(model=a.model, version=a.version, layout_id=a.layout_id,
                        manifest=manifest, checksums=a.checksums,
                        lease_id=warm_lease_id(worker_id, a.model, a.version),
                        lease_ttl=0.0, sources=list(sources.values()), ranges=[],
                        chunk_bytes=self.chunk_bytes, stripes=stripes,
                        holding=[sid for sid in sources if sid == a.publisher])


@dataclass(frozen=True)
class Ask:
    """A striped re-ask to send: for `replan.stripes` (none: the confirmation of a pull
    begun with no plan). Its answer goes to `PullSession.answered`, a refusal to
    `PullSession.refused`."""

    request: ReplanStripes | ConfirmParents
    replan: Replan

    @property
    def confirmation(self) -> bool:
        return not self.replan.stripes


Action = Read | Poll | Ask


class PullSession:
    """One reader's pull of one version: its requests, what it makes of the answers, and
    (striped) what to read, poll or ask next."""

    def __init__(self, reader: Reader, worker_id: str, version: int | str, *, now: float,
                 deadline: float, warm: ReadPlan | None = None, held: int | None = None,
                 max_replans: int = 3, stall: float = 5.0, poll_min: float = 0.001,
                 poll_max: float = 0.05, chunks: list[Chunk] | None = None,
                 rng: random.Random | None = None):
        """`warm`: a plan made here (`Parents.warm_plan`): reading starts at once, and the
        pull is not done before the coordinator confirmed it. `held`: the version the
        reader holds (a plan for it: nothing to read). `stall`, `poll_min`, `poll_max`: as
        `StripedPull`'s; `chunks`: the version's, if the caller has them cut already;
        `rng`: for the busy retries' jitter (the simulator's is seeded)."""
        self.reader, self.worker_id, self.version = reader, worker_id, version
        self.deadline, self.held, self.max_replans = deadline, held, max_replans
        self._timing = {"stall": stall, "poll_min": poll_min, "poll_max": poll_max}
        self._chunks, self._rng = chunks, rng
        self.started = now
        self.warm = warm is not None
        # the coordinator may not know our memory: after a warm start (it may not have
        # carried us over) or once it forgot us (`forgotten`), every re-ask carries it
        self._memory_owed = self.warm
        self.plan: ReadPlan | None = None  # the latest
        self.stats: PullStats | None = None
        self.by_source: dict[str, int] = {}  # worker id -> bytes
        self.sources: dict[str, Source] = {}
        self.stripes: StripedPull | None = None
        self.chunks: list[Chunk] = []
        self.failures = 0  # whole-item reads failed
        # Who served what (for naming the source of bytes that fail their checksums):
        # chunk -> source (striped), or (item, offset, nbytes) -> source (whole items).
        self.served_chunks: dict[int, str] = {}
        self.served_ranges: dict[tuple[int, int, int], str] = {}
        self.bad_sources: set[str] = set()  # served bytes that failed, found by a re-read
        self.reread_bytes = 0  # read again from another holder after a failed checksum
        self._repair_leases: list[str] = []
        self._refused: dict[str, float] = {}  # refusal kind -> since when, in a row
        self._confirm_at: float | None = None  # (re)send the confirmation then
        self._leases: list[str] = []  # every lease this pull was given, in order
        self._ended: set[str] = set()
        self.ended = False
        self._error = ""
        if warm is not None:
            self._take(warm, now)
            self._confirm_at = now

    # ------------------------------------------------------------------ requests
    def first_request(self) -> PlanRequest | StripedPlanRequest:
        """The pull's plan request (none for a warm pull): a striped one carries our
        memory, when we serve what we pull."""
        r = self.reader
        if r.whole_items:
            return PlanRequest(worker_id=self.worker_id, model=r.model, version=self.version,
                               layout_id=r.layout_id)
        return self._striped(StripedPlanRequest, self.version, r.relay)

    def missing_request(self, unread: list[ByteRange]) -> PlanRequest:
        """A whole-item pull's re-plan after a failed source: only what is still unread."""
        return PlanRequest(worker_id=self.worker_id, model=self.reader.model,
                           version=self.plan.version, layout_id=self.plan.layout_id,
                           missing=[ByteRange(item=r.item, offset=r.offset, nbytes=r.nbytes)
                                    for r in unread], known_manifest=True)

    def _ask(self, replan: Replan) -> Ask:
        """A striped re-ask: parents for `replan.stripes`, or (none named) the confirmation
        of a pull begun with no plan; our memory again only if the coordinator may not know
        it."""
        if not replan.stripes:
            return Ask(self._striped(ConfirmParents, self.plan.version, self._memory_owed,
                                     known_manifest=True), replan)
        return Ask(self._striped(ReplanStripes, self.plan.version, self._memory_owed,
                                 known_manifest=True, stripes=list(replan.stripes),
                                 failed=list(replan.failed), behind=list(replan.behind)),
                   replan)

    def _striped(self, kind: type[StripedRequest], version: int | str, with_memory: bool,
                 **fields) -> StripedRequest:
        r = self.reader
        memory = with_memory and r.relay
        return kind(worker_id=self.worker_id, model=r.model, version=version,
                    layout_id=r.layout_id, relay=r.relay, memory=r.memory if memory else None,
                    endpoint=r.endpoint if memory else None, **fields)

    def _read_done(self, lease_id: str, ok: bool, error: str | None = None,
                   failed: list[str] | None = None, stats: bool = False) -> ReadDone:
        self._ended.add(lease_id)
        s = self.stats if stats else None
        return ReadDone(worker_id=self.worker_id, lease_id=lease_id, ok=ok,
                        nbytes=s.nbytes if s else 0, seconds=s.seconds if s else 0.0,
                        error=error, failed_holders=failed or [],
                        by_source=self.by_source if s else {},
                        bad_bytes=sorted(self.bad_sources) if s else [])

    def hold(self, memory: list[MemoryDesc], manifest: Manifest | None,
             part: Part | None = None, endpoint: Endpoint | None = None) -> Hold:
        """We hold the pulled version completely (verified) and serve reads of it.
        `endpoint`: the reader's now, when buffers were registered since the pull began
        (a transport's endpoint describes the memory registered when it was taken)."""
        part = part or Part()
        return Hold(worker_id=self.worker_id, model=self.reader.model,
                    version=self.plan.version, layout_id=self.plan.layout_id, memory=memory,
                    endpoint=endpoint or self.reader.endpoint, manifest=manifest,
                    checksums=self.plan.checksums, part=part.part, parts=part.parts)

    def progress(self, now: float) -> PullProgress:
        """How far this pull is, for the reader's heartbeats."""
        total = sum(c.nbytes for c in self.chunks) if self.chunks else \
            sum(it.nbytes for it in plan_items(self.plan.manifest))
        return PullProgress(model=self.reader.model, version=self.plan.version,
                            done=min(self.stats.nbytes, total), total=total,
                            seconds=max(0.0, now - self.started))

    def end(self, ok: bool, error: str | None = None) -> list[ReadDone]:
        """The pull is over: end its last lease (with what was read, when it read
        everything: no `error`); a failed pull ends every lease it was given (its first
        plan's, its last, and a confirmation's that comes later: `answered`), else each
        would count against its sources as a read in flight until it expires (a trainer
        withdrawing waits for them)."""
        self.ended, self._error = True, error or "the pull ended before this plan came"
        if self.plan is None:
            return []
        if error is None:
            return [self._read_done(self.plan.lease_id, ok, stats=True)]
        return [self._read_done(lease, False, error)
                for lease in reversed(self._leases + self._repair_leases)
                if lease not in self._ended]

    def forgotten(self) -> None:
        """The coordinator forgot us (it restarted; we registered again): it knows neither
        our memory nor our place in the forest, so every later re-ask carries them."""
        self._memory_owed = True

    # ------------------------------------------------------------------ answers
    def planned(self, plan: ReadPlan, now: float) -> None:
        """The answer to `first_request` or `missing_request`."""
        self._take(self._completed(plan), now)
        self._refused.clear()

    @property
    def held_already(self) -> bool:
        """The version planned is the one we hold: nothing to read."""
        return self.plan is not None and self.plan.version == self.held

    def answered(self, ask: Ask, plan: ReadPlan, now: float) -> ReadDone | None:
        """The answer to a re-ask; after the pull ended, the `ReadDone` of a lease it
        brought (else it would stay open)."""
        if self.ended:
            return None if plan.lease_id in self._ended else \
                self._read_done(plan.lease_id, False, self._error)
        if self.done and not ask.confirmation:
            # every chunk landed while this re-ask was out: nothing will be read under
            # its lease, and the pull's plan and parents stay those it was read by
            return self._read_done(plan.lease_id, True)
        plan = self._completed(plan)
        self._refused.clear()
        self._lease(plan.lease_id)
        self.plan = plan
        self.sources.update({s.worker_id: s for s in plan.sources})
        take = self.stripes.confirmed if ask.confirmation else self.stripes.assign
        take(list(plan.stripes or []), holding_of(plan), now, plan.retry_after)
        return None

    def refused(self, code: str, retry_after: float | None, now: float,
                ask: Ask | None = None) -> float | None:
        """The coordinator refused a request (`ask`, or the plan request of this pull):
        seconds to wait before asking again, or None: the pull fails with that error.
        Busy holders are waited for until the deadline; no holder left, briefly (holders
        may be registering again with a restarted coordinator); a version the coordinator
        does not know, for a while, once this pull has a plan (the same reason)."""
        if code == "busy" and retry_after is not None:
            wait, limit = busy_wait(retry_after, rng=self._rng), self.deadline
        elif code == "no_holder" and retry_after is not None:
            since = self._refused.setdefault(code, now)
            wait, limit = retry_after, min(self.deadline, since + settings.NO_HOLDER_GRACE)
        elif code in ("unknown_model", "unknown_version") and self.plan is not None:
            since = self._refused.setdefault("unknown", now)
            wait, limit = settings.UNKNOWN_RETRY, min(self.deadline, since + settings.UNKNOWN_GRACE)
        else:
            return None
        if now + wait > limit:
            return None
        if ask is not None and ask.confirmation:
            self._confirm_at = now + wait
        elif ask is not None:
            self.stripes.asked_failed(now, wait)
        return wait

    def _completed(self, plan: ReadPlan) -> ReadPlan:
        """A later plan of this pull leaves out the manifest and checksums it has."""
        if plan.manifest is not None and plan.checksums is not None:
            return plan
        known = self.plan
        if known is None or plan.layout_id != known.layout_id:
            raise CoordinatorError(f"a plan for {plan.model} v{plan.version} came without "
                                   f"its manifest", code="bad_reply")
        return plan.model_copy(update={"manifest": known.manifest,
                                       "checksums": known.checksums})

    def _lease(self, lease_id: str) -> None:
        if lease_id not in self._leases:
            self._leases.append(lease_id)

    def _take(self, plan: ReadPlan, now: float) -> None:
        first = self.plan is None
        self.plan = plan
        self._lease(plan.lease_id)
        if plan.stripes is None:
            self.sources.update({s.worker_id: s for s in plan.sources})
        if first:
            self.stats = PullStats(plan.model, plan.version, [], 0, 0.0)
        if plan.stripes is None or not first:
            return
        chunk_bytes = plan.chunk_bytes or CHUNK_BYTES
        self.chunks = self._chunks or chunks_of(plan_items(plan.manifest), chunk_bytes)
        self.sources.update({s.worker_id: s for s in plan.sources})
        relay = self.reader.relay
        self.stripes = StripedPull(
            len(self.chunks), len(plan.stripes or [None]), plan.version,
            # a relay marks a chunk once its read ends: one chunk a read, or its children
            # would wait for whole batches
            batch=1 if relay else max(1, CHUNK_BYTES // chunk_bytes),
            confirming=self.warm,
            tag=progress_tag(plan.version, patch=is_patch_model(plan.model)), **self._timing)
        self.stripes.assign(list(plan.stripes), holding_of(plan), now, plan.retry_after)

    # ------------------------------------------------------------------ a striped pull
    @property
    def done(self) -> bool:
        return self.stripes is not None and self.stripes.done

    def actions(self, now: float) -> list[Action]:
        """What to start now: reads, polls and re-asks (each is started once; report its
        end back). Raises `TransferError` once the pull cannot succeed."""
        st = self.stripes
        if now > self.deadline:
            raise TransferError(f"{self.plan.model} v{self.plan.version}: {len(st.landed)} "
                                f"of {len(self.chunks)} chunks after the pull timeout"
                                + (" (not confirmed)" if st.read_all else ""))
        if st.failures > self.max_replans:
            raise TransferError(f"{self.plan.model} v{self.plan.version}: {st.failures} "
                                f"failed reads (at most {self.max_replans} re-plans)")
        out: list[Action] = []
        if self._confirm_at is not None and now >= self._confirm_at:
            self._confirm_at = None
            out.append(self._ask(Replan(())))
        for action in st.actions(now):
            out.append(self._ask(action) if isinstance(action, Replan) else action)
        return out

    def wake_at(self, now: float) -> float | None:
        """When `actions` may have something new with no other input (None: only an input
        can change anything)."""
        times = [t for t in (self.stripes.wake_at(now), self._confirm_at) if t is not None]
        return max(now, min(times)) if times else None

    def landed(self, read: Read, ok: bool, now: float) -> int:
        """A read ended; return the bytes it brought."""
        self.stripes.read_done(read, ok, now)
        if not ok:
            return 0
        nbytes = sum(self.chunks[c].nbytes for c in read.chunks)
        for c in read.chunks:
            self.served_chunks[c] = read.source
        name = self.sources[read.source].name
        if name not in self.stats.by_source:
            self.stats.sources.append(name)
        self.stats.by_source[name] = self.stats.by_source.get(name, 0) + nbytes
        self.by_source[read.source] = self.by_source.get(read.source, 0) + nbytes
        self.stats.nbytes += nbytes
        return nbytes

    def polled(self, poll: Poll, progress: bytes | None, now: float) -> None:
        """A poll of a parent's progress bytes ended (None: it failed)."""
        self.stripes.polled(poll, progress, now)

    def parents(self, worker_id: str | None = None) -> Parents | None:
        """The parents this pull ended with, for the next version (`Parents.warm_plan`);
        `worker_id`: ours now, if we registered again since the pull began."""
        stripes = self.plan.stripes
        if not stripes or None in stripes or self.reader.layout_id is None:
            return None
        return Parents(self.reader.layout_id, tuple(stripes),
                       {sid: self.sources[sid] for sid in set(stripes)},
                       self.plan.chunk_bytes or 0, worker_id or self.worker_id)

    # ------------------------------------------------------------------ a whole-item pull
    def source_failed(self, error: str, source: str | None) -> ReadDone:
        """A whole-item read failed: the plan's lease ends naming the source (the bytes
        not read are planned again elsewhere: `missing_request`)."""
        self.failures += 1
        return self._read_done(self.plan.lease_id, False, error,
                               failed=[source] if source else None)

    def served(self, ranges) -> None:
        """Ranges (`ReadRange`s) of a whole-item plan have landed, each from its source."""
        for r in ranges:
            self.served_ranges[(r.item, r.offset, r.nbytes)] = r.source

    # ------------------------------------------------------------------ bad bytes
    def pieces(self, items: list[int]) -> list[tuple[int, int, int, str]]:
        """The pieces (item, offset, nbytes, source) the bytes of `items` were read in, by
        who served each: what a re-read compares to name the source of bad bytes."""
        wanted = set(items)
        out = [(k, o, n, src) for (k, o, n), src in self.served_ranges.items() if k in wanted]
        for c, src in self.served_chunks.items():
            out.extend((seg.item, seg.offset, seg.nbytes, src)
                       for seg in self.chunks[c].segments if seg.item in wanted)
        return sorted(out)

    def reread_request(self, items: list[int], avoid: set[str]) -> PlanRequest:
        """A whole-item plan for `items` (they failed their checksums), from a holder not
        in `avoid` (the sources of their bytes): the publisher only when nobody else
        holds the version."""
        sizes = plan_items(self.plan.manifest)
        return PlanRequest(worker_id=self.worker_id, model=self.reader.model,
                           version=self.plan.version, layout_id=self.plan.layout_id,
                           missing=[ByteRange(item=k, offset=0, nbytes=sizes[k].nbytes)
                                    for k in items],
                           known_manifest=True, avoid=sorted(avoid)[:64])

    def reread_planned(self, plan: ReadPlan) -> ReadPlan:
        """The answer to `reread_request`: its lease is this pull's to end."""
        plan = self._completed(plan)
        if plan.lease_id not in self._repair_leases:
            self._repair_leases.append(plan.lease_id)
        self.sources.update({s.worker_id: s for s in plan.sources})
        return plan

    def reread_done(self, plan: ReadPlan, ok: bool, error: str | None = None,
                    failed: str | None = None) -> ReadDone:
        """The re-read's lease ends (`failed`: its source, if the read of it failed)."""
        nbytes = sum(r.nbytes for r in plan.ranges)
        if ok:
            self.reread_bytes += nbytes
        self._ended.add(plan.lease_id)
        return ReadDone(worker_id=self.worker_id, lease_id=plan.lease_id, ok=ok,
                        nbytes=nbytes if ok else 0, error=error,
                        failed_holders=[failed] if failed else [],
                        by_source={r.source: nbytes for r in plan.ranges[:1]} if ok else {})

    def blame(self, pieces: list[tuple[int, int, int, str]], before: list[str],
              after: list[str]) -> set[str]:
        """The sources whose pieces changed when read again (and then passed): they served
        bytes the version does not have."""
        bad = {src for (_, _, _, src), b, a in zip(pieces, before, after, strict=True)
               if b != a}
        self.bad_sources |= bad
        return bad
