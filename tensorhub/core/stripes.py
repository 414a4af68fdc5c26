"""A striped pull as a state machine with no I/O: what to read, poll or ask next.

The coordinator names one parent per stripe once (`coordinator/forest.py`); from then on
the reader learns what each parent has from the parent's *progress bytes*, a small region
of its registered memory holding one byte per chunk (`progress_tag(version)` once the chunk
has landed), which the reader reads one-sided, and reads each chunk as soon as its parent
has it. The coordinator hears from the reader again only when a parent fails (`failed`),
falls behind (no new chunk for `stall` seconds while this reader waits on it) or was not
named yet (`pending`).

A pull's session (`reader/session.py`) runs it, driven with real reads by `Replica`
(`striped.py`) and with simulated ones by the simulator (`sim/swarm.py`): both run this
logic, so the simulator's figures are this reader's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorhub.core.data_types import ReadPlan

PROGRESS_BYTES = 1 << 16  # a worker's progress region: at most this many chunks a version
POLL_WINDOW = 512  # progress bytes read by one poll (from the next chunk wanted on)


def warm_lease_id(reader: str, model: str, version: int) -> str:
    """The lease the coordinator opens for a reader it expects to pull `version` by the
    parents it had for the previous one (no plan request: the reader ends it by this id)."""
    return f"{reader}@{model}/v{version}"


def holding_of(plan: ReadPlan) -> set[str]:
    """A striped plan's sources that hold every chunk (read at once, never polled)."""
    return set(plan.holding or ())


def progress_tag(version: int, patch: bool = False) -> int:
    """The byte a worker writes for a chunk of `version` it has: never 0 (cleared), and
    different for consecutive versions, so a byte left from an older pull never passes. A
    patch's chunks (`core/patch.py`: version v of the patch model) are marked otherwise
    than v's own, so a reader of v never takes a chunk of the patch for one of v."""
    return (version + (128 if patch else 0)) % 255 + 1


@dataclass(frozen=True)
class Read:
    """Read these chunks (all of one stripe) from `source`."""

    source: str
    stripe: int
    chunks: tuple[int, ...]


@dataclass(frozen=True)
class Poll:
    """Read progress bytes [lo, hi) of `source`."""

    source: str
    stripe: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Replan:
    """Ask the coordinator for parents of `stripes`; `failed`: sources whose reads failed,
    `behind`: sources that stopped getting chunks."""

    stripes: tuple[int, ...]
    failed: tuple[str, ...] = ()
    behind: tuple[str, ...] = ()


Action = Read | Poll | Replan


@dataclass
class _Stripe:
    index: int
    left: list[int]  # chunks of this stripe still to read, ascending
    source: str | None = None
    complete: bool = False  # the source holds every chunk: no polling
    ready: set[int] = field(default_factory=set)  # chunks the source is known to have
    reading: bool = False
    polling: bool = False
    poll_at: float = 0.0
    poll_gap: float = 0.0
    waiting_since: float | None = None  # since when nothing it has is left to read
    replan: str | None = None  # "failed" / "behind" / "pending": ask the coordinator


class StripedPull:
    """One reader's pull of one version: chunk c is in stripe c % stripes."""

    def __init__(self, nchunks: int, stripes: int, version: int, *, batch: int = 1,
                 poll_min: float = 0.001, poll_max: float = 0.05, stall: float = 5.0,
                 confirming: bool = False, tag: int | None = None):
        """`batch`: chunks one read may take from a complete source; `poll_min`..`poll_max`:
        the gap between polls of a parent with nothing new (doubling while nothing comes);
        `stall`: seconds without a new chunk from a parent before it counts as behind;
        `confirming`: a pull begun with no plan (from parents it knew), whose confirming
        plan request is under way: it is not done before that answer (`confirmed`). `tag`:
        the progress byte of a chunk landed (default `progress_tag(version)`)."""
        if nchunks > PROGRESS_BYTES:
            raise ValueError(f"{nchunks} chunks: at most {PROGRESS_BYTES} fit the progress "
                             f"region (use larger chunks)")
        self.nchunks, self.version = nchunks, version
        self.tag = progress_tag(version) if tag is None else tag
        self.batch, self.poll_min, self.poll_max, self.stall = batch, poll_min, poll_max, stall
        self.stripes = [_Stripe(s, list(range(s, nchunks, stripes))) for s in range(stripes)]
        self.landed: set[int] = set()
        self.asking = False  # a Replan is out
        self.ask_at = 0.0  # earliest time for the next Replan (a `retry_after`)
        self.failures = 0
        self.confirming = confirming

    # ------------------------------------------------------------------ state
    @property
    def read_all(self) -> bool:
        return len(self.landed) == self.nchunks

    @property
    def done(self) -> bool:
        """Every chunk read, and the coordinator has answered (a pull it did not plan)."""
        return self.read_all and not self.confirming

    # ------------------------------------------------------------------ inputs
    def assign(self, parents: list[str | None], complete: set[str], now: float,
               retry_after: float | None = None) -> None:
        """The coordinator's answer: a parent per stripe (None: not yet, ask again after
        `retry_after`); `complete`: the parents that hold every chunk."""
        self.asking = False
        self.ask_at = now + (retry_after or 0.0)
        for st, parent in zip(self.stripes, parents, strict=True):
            if st.reading:
                continue  # (a read in flight keeps its source until it ends)
            if parent != st.source or st.replan is not None:
                st.ready.clear()
                st.poll_gap, st.poll_at, st.waiting_since = 0.0, now, None
            st.source, st.complete = parent, parent in complete
            st.replan = None if parent is not None else "pending"

    def confirmed(self, parents: list[str | None], complete: set[str], now: float,
                  retry_after: float | None = None) -> None:
        """The answer to the confirming request: the parents the coordinator holds us
        under from now on (as `assign`)."""
        self.confirming = False
        self.assign(parents, complete, now, retry_after)

    def asked_failed(self, now: float, retry_after: float) -> None:
        """The plan request failed (busy, unreachable coordinator): ask again later."""
        self.asking = False
        self.ask_at = now + retry_after

    def read_done(self, read: Read, ok: bool, now: float) -> None:
        st = self.stripes[read.stripe]
        st.reading = False
        if ok:
            self.landed.update(read.chunks)
            del st.left[:len(read.chunks)]  # (a read takes the stripe's next chunks in order)
            st.ready.difference_update(read.chunks)
            st.waiting_since = None
            return
        self._failed(read.source)

    def _failed(self, source: str) -> None:
        self.failures += 1
        for other in self.stripes:  # every stripe that reads from the failed source
            if other.source == source:
                other.replan, other.ready = "failed", set()

    def polled(self, poll: Poll, progress: bytes | bytearray | memoryview | None,
               now: float) -> None:
        """`progress`: the source's bytes [poll.lo, poll.hi); None: the poll failed."""
        st = self.stripes[poll.stripe]
        st.polling = False
        if st.source != poll.source:
            return  # the stripe moved to another parent meanwhile
        if progress is None:
            self._failed(poll.source)
            return
        stripes = len(self.stripes)
        first = poll.lo + (poll.stripe - poll.lo) % stripes
        new = {c for c in range(first, poll.hi, stripes)
               if progress[c - poll.lo] == self.tag} - st.ready - self.landed
        if new:
            st.ready |= new
            st.poll_gap, st.waiting_since = 0.0, None
        else:
            st.poll_gap = min(self.poll_max, max(self.poll_min, 2 * st.poll_gap))
            if st.waiting_since is None:
                st.waiting_since = now
            elif now - st.waiting_since >= self.stall and st.left:
                st.replan = "behind"
        st.poll_at = now + st.poll_gap

    # ------------------------------------------------------------------ outputs
    def actions(self, now: float) -> list[Action]:
        """What to start now (each action is started once; report its end back)."""
        out: list[Action] = []
        replan = [st for st in self.stripes if self._asks(st) and not st.reading and st.left]
        if replan and not self.asking and now >= self.ask_at:
            self.asking = True
            out.append(Replan(
                tuple(st.index for st in replan),
                failed=tuple(sorted({st.source for st in replan
                                     if st.replan == "failed" and st.source})),
                behind=tuple(sorted({st.source for st in replan
                                     if st.replan == "behind" and st.source}))))
        for st in self.stripes:
            if st.source is None or st.replan is not None or st.reading or not st.left:
                continue
            take: list[int] = []
            for c in st.left[:self.batch]:  # the next chunks in order, as far as it has them
                if not st.complete and c not in st.ready:
                    break
                take.append(c)
            if take:
                st.reading = True
                out.append(Read(st.source, st.index, tuple(take)))
            elif not st.complete and not st.polling and now >= st.poll_at:
                st.polling = True
                lo = st.left[0]
                out.append(Poll(st.source, st.index, lo, min(self.nchunks, lo + POLL_WINDOW)))
        return out

    def _asks(self, st: _Stripe) -> bool:
        """Whether `st` needs a plan request: not one with no parent yet while the
        confirmation is under way (its answer names one)."""
        return st.replan is not None and not (self.confirming and st.replan == "pending")

    def wake_at(self, now: float) -> float | None:
        """When `actions` may have something new without any other input (a poll or a
        plan request coming due); None: only an input can change anything."""
        times = [st.poll_at for st in self.stripes if st.source is not None and not st.polling
                 and not st.reading and not st.complete and st.left and st.replan is None]
        if not self.asking and any(self._asks(st) and not st.reading and st.left
                                   for st in self.stripes):  # (as `actions` asks)
            times.append(self.ask_at)
        return max(now, min(times)) if times else None

