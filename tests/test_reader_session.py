"""One pull as messages, with no I/O (`reader/session.py`): what `Replica` and the simulator
both send, and what they do with the answers."""

from __future__ import annotations

from tensorhub import settings
from tensorhub.core.data_types import (
    PUBLISHER,
    Announcement,
    ConfirmParents,
    Endpoint,
    Manifest,
    MemoryDesc,
    Placement,
    ReadPlan,
    Source,
    StripedPlanRequest,
    TensorSpec,
)
from tensorhub.core.memory import regions_digest
from tensorhub.core.stripes import Poll, Read, warm_lease_id
from tensorhub.reader.session import Ask, Parents, PullSession, Reader

MIB = 1 << 20
MANIFEST = Manifest(tensors=[TensorSpec(name="w", dtype="uint8", shape=[4 * MIB],
                                        nbytes=4 * MIB)], compact_threshold=MIB)
ENDPOINT = Endpoint(transport="zmq", address="tcp://r:1")
MEMORY = [MemoryDesc(addr=1 << 30, nbytes=4 * MIB)]
READER = Reader("m", "L", MEMORY, ENDPOINT)


def _source(worker_id: str, role: str = "replica", addr: int = 1 << 32) -> Source:
    return Source(worker_id=worker_id, name=worker_id, role=role, endpoint=ENDPOINT,
                  memory=[MemoryDesc(addr=addr, nbytes=4 * MIB)])


def _plan(stripes: list[str | None], lease: str = "lease-1", version: int = 1,
          known: bool = False) -> ReadPlan:
    return ReadPlan(model="m", version=version, layout_id="L",
                    manifest=None if known else MANIFEST,
                    checksums=None if known else ["c"], lease_id=lease, lease_ttl=60.0,
                    sources=[_source(s) for s in set(stripes) if s], ranges=[],
                    chunk_bytes=MIB, stripes=stripes,
                    holding=[s for s in set(stripes) if s])  # (parents with every chunk)


def _cold(**kw) -> PullSession:
    pull = PullSession(READER, "me", 1, now=0.0, deadline=60.0, **kw)
    pull.planned(_plan(["a", "b"]), now=0.0)
    return pull


def _read_everything(pull: PullSession) -> list[Ask]:
    """Every read lands, every poll sees every chunk there; the asks made meanwhile."""
    asks = []
    while not pull.stripes.read_all:
        for action in pull.actions(0.0):
            if isinstance(action, Read):
                pull.landed(action, ok=True, now=0.0)
            elif isinstance(action, Poll):
                pull.polled(action, bytes([pull.stripes.tag]) * (action.hi - action.lo), 0.0)
            else:
                asks.append(action)
    return asks


def _asks(pull: PullSession, now: float) -> list[Ask]:
    return [a for a in pull.actions(now) if isinstance(a, Ask)]


def test_only_the_first_request_carries_our_memory_until_the_coordinator_forgets_us():
    pull = PullSession(READER, "me", "latest", now=0.0, deadline=60.0)
    first = pull.first_request()
    assert isinstance(first, StripedPlanRequest)
    assert first.memory == MEMORY and first.endpoint == ENDPOINT
    pull.planned(_plan(["a", "b"]), now=0.0)
    reads = [a for a in pull.actions(0.0) if isinstance(a, Read)]
    pull.landed(reads[0], ok=False, now=0.1)
    [ask] = _asks(pull, 0.1)
    assert ask.request.failed == [reads[0].source] and ask.request.memory is None
    assert ask.request.known_manifest and ask.request.version == 1
    pull.answered(ask, _plan(["c", "b"], known=True), now=0.2)
    pull.forgotten()  # (a restarted coordinator: we registered again)
    pull.landed(next(a for a in pull.actions(0.2) if isinstance(a, Read)), ok=False, now=0.3)
    [again] = _asks(pull, 0.3)
    assert again.request.memory == MEMORY and again.request.endpoint == ENDPOINT


def test_a_staging_copy_serves_nothing_so_it_sends_no_memory():
    staging = PullSession(Reader("m", "L", None, ENDPOINT, relay=False), "me", 1, now=0.0,
                          deadline=60.0)
    request = staging.first_request()
    assert not request.relay and request.memory is None and request.endpoint is None


def test_busy_holders_are_waited_for_until_the_deadline_a_lost_version_briefly():
    pull = PullSession(READER, "me", 1, now=0.0, deadline=10.0)
    assert 0.0 < pull.refused("busy", 1.0, now=5.0) < 2.0
    assert pull.refused("busy", 1.0, now=9.9) is None
    assert pull.refused("no_holder", 1.0, now=0.0) == 1.0
    assert pull.refused("no_holder", 1.0, now=settings.NO_HOLDER_GRACE) is None
    assert pull.refused("unknown_version", None, now=0.0) is None  # (no plan yet: it is)
    assert pull.refused("bad_request", None, now=0.0) is None
    pull.planned(_plan(["a", "b"]), now=0.0)
    assert pull.refused("unknown_version", None, now=1.0) is not None  # (a restart)


def test_a_failed_pull_ends_every_lease_even_one_answered_after_it_failed():
    pull = _cold()
    reads = [a for a in pull.actions(0.0) if isinstance(a, Read)]
    pull.landed(reads[0], ok=False, now=0.1)
    [ask] = _asks(pull, 0.1)
    pull.answered(ask, _plan(["c", "b"], lease="lease-2", known=True), now=0.2)
    pull.landed(next(a for a in pull.actions(0.2) if isinstance(a, Read)), ok=False, now=0.3)
    [late] = _asks(pull, 0.3)
    ended = pull.end(ok=False, error="gone")
    assert [(d.lease_id, d.ok) for d in ended] == [("lease-2", False), ("lease-1", False)]
    done = pull.answered(late, _plan(["d", "b"], lease="lease-3", known=True), now=0.4)
    assert done is not None and (done.lease_id, done.ok) == ("lease-3", False)


def test_a_pull_that_read_everything_ends_its_last_lease_with_what_it_read():
    pull = _cold()
    assert _read_everything(pull) == [] and pull.done
    [done] = pull.end(ok=True)
    assert done.ok and done.nbytes == 4 * MIB and done.by_source == {"a": 2 * MIB,
                                                                     "b": 2 * MIB}
    assert pull.parents().stripes == ("a", "b")
    assert pull.hold(MEMORY, MANIFEST).checksums == ["c"]


def _announcement(**kw) -> Announcement:
    trainer = _source("t", role="trainer", addr=1 << 40)
    fields = dict(model="m", version=2, layout_id="L", checksums=["c2"], chunk_bytes=MIB,
                  publisher="t", memory_digest=regions_digest(trainer.memory),
                  source=trainer)
    return Announcement(**{**fields, **kw})


def test_the_next_version_is_planned_here_from_the_last_parents_if_nothing_moved():
    parents = Parents("L", ("t", "a"), {"t": _source("t", role="trainer", addr=1 << 40),
                                        "a": _source("a")}, MIB, "me")
    warm = parents.warm_plan(_announcement(), MANIFEST, "me", held=1)
    assert warm.lease_id == warm_lease_id("me", "m", 2) and warm.stripes == ["t", "a"]
    assert warm.holding == ["t"] and warm.checksums == ["c2"]
    moved = _announcement(memory_digest="moved")
    assert parents.warm_plan(moved, MANIFEST, "me", held=1) is None
    assert parents.warm_plan(_announcement(chunk_bytes=2 * MIB), MANIFEST, "me", 1) is None
    assert parents.warm_plan(_announcement(), MANIFEST, "someone else", 1) is None


def test_a_warm_pull_reads_at_once_and_is_done_only_once_confirmed_with_our_memory():
    placed = Placement(model="m", layout_id="L", chunk_bytes=MIB,
                       stripes=[PUBLISHER, "a"], sources=[_source("a")])
    warm = Parents.placed(placed, "me").warm_plan(_announcement(), MANIFEST, "me", None)
    assert warm.stripes == ["t", "a"]
    pull = PullSession(READER, "me", 2, now=0.0, deadline=60.0, warm=warm)
    [confirm] = _read_everything(pull)
    assert confirm.confirmation and isinstance(confirm.request, ConfirmParents)
    assert confirm.request.memory == MEMORY
    assert not pull.done
    pull.answered(confirm, _plan(["t", "a"], lease=warm.lease_id, version=2, known=True), 0.1)
    assert pull.done
