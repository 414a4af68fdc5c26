"""Readers that ask for a version at different moments: the publisher uploads one copy.

Striped plans through the coordinator's handlers, on a fake clock (no sockets, no waiting):
readers ask one by one, all at once, or after one whose transport is broken. What is pinned
is where each reader's stripes come from: the publisher has one child per stripe however
the readers arrive, no reader uploads more than one model's worth, and no reader waits for
readers still to come when none are arriving.
"""

from __future__ import annotations

from tensorhub.coordinator.dispatch import HANDLERS, as_model
from tensorhub.coordinator.planner import PlannerConfig
from tensorhub.coordinator.state import CoordinatorConfig, CoordinatorState, Reject
from tensorhub.core.data_types import (
    Endpoint,
    ErrorReply,
    Hold,
    Manifest,
    MemoryDesc,
    Publish,
    ReadDone,
    ReadPlan,
    Register,
    ReplanStripes,
    StripedPlanRequest,
    TensorSpec,
)
from tensorhub.core.layout import layout_id

ITEM = 4096  # eight tensors of one chunk each: four chunks a stripe
MANIFEST = Manifest(tensors=[TensorSpec(name=f"t{i}", dtype="uint8", shape=[ITEM], nbytes=ITEM)
                             for i in range(8)], compact_threshold=1024)
LID = layout_id(MANIFEST)
MEMORY = [MemoryDesc(addr=(k + 1) << 20, nbytes=ITEM) for k in range(8)]
EP = Endpoint(transport="zmq", address="tcp://127.0.0.1:1")
STRIPES = 2


class Fleet:
    """A coordinator with a trainer that published v1 and `readers` registered replicas;
    each reader asks (`ask`), and asks again for stripes still without a parent every
    `pending_retry` as the clock goes on (`advance`), as `PullSession` does."""

    def __init__(self, readers: int):
        self.now = 0.0
        self.config = CoordinatorConfig(stripes=STRIPES, planner=PlannerConfig(
            chunk_bytes=ITEM, min_chunks=1))
        self.coordinator = CoordinatorState(self.config, clock=lambda: self.now)
        self.trainer = self.join("trainer", "trainer")
        self.call(Publish(worker_id=self.trainer, model="m", version=1, manifest=MANIFEST,
                          checksums=["c"] * 8, memory=MEMORY))
        self.readers = [self.join(f"r{i}") for i in range(readers)]
        self.parents: dict[str, list[str | None]] = {}
        self.leases: dict[str, str] = {}

    def call(self, request):
        try:
            return as_model(HANDLERS[type(request)](self.coordinator, request))
        except Reject as rej:
            return rej.reply

    def join(self, name: str, role: str = "replica") -> str:
        return self.call(Register(name=name, role=role, endpoint=EP,
                                  labels={"dc": "dc0", "node": name})).worker_id

    def _take(self, reader: str, reply) -> ReadPlan | ErrorReply:
        if isinstance(reply, ReadPlan):
            self.parents[reader] = list(reply.stripes)
            self.leases[reader] = reply.lease_id
        return reply

    def ask(self, reader: str) -> ReadPlan | ErrorReply:
        return self._take(reader, self.call(StripedPlanRequest(
            worker_id=reader, model="m", version=1, memory=MEMORY, endpoint=EP)))

    def ask_again(self, reader: str, stripes: list[int],
                  failed: tuple[str, ...] = ()) -> ReadPlan | ErrorReply:
        return self._take(reader, self.call(ReplanStripes(
            worker_id=reader, model="m", version=1, stripes=stripes, failed=list(failed),
            known_manifest=True)))

    def advance(self, until: float) -> None:
        """The clock goes on to `until`; readers with a stripe still to place ask again."""
        while self.now < until:
            self.now = min(until, self.now + self.config.pending_retry)
            for reader, parents in self.parents.items():
                pending = [s for s, p in enumerate(parents) if p is None]
                if pending:
                    self.ask_again(reader, pending)

    def arrive(self, moments: list[float]) -> None:
        """Reader k asks at `moments[k]`; afterwards the clock runs until every stripe
        has a parent."""
        for reader, at in zip(self.readers, moments, strict=False):
            self.advance(at)
            self.ask(reader)
        self.advance(self.now + 2 * self.config.pending_grace)

    def give_up(self, reader: str, error: str) -> None:
        """The reader's pull fails (`PullSession.end`): its lease ends, not ok."""
        self.call(ReadDone(worker_id=reader, lease_id=self.leases.pop(reader), ok=False,
                           error=error))
        del self.parents[reader]
        self.readers.remove(reader)

    def trainer_copies(self) -> float:
        """What the publisher uploads: its children over all stripes, in models."""
        return sum(p == self.trainer for ps in self.parents.values() for p in ps) / STRIPES

    def uploads(self) -> dict[str, float]:
        """Per parent, models' worth it serves (one stripe to one child: 1/STRIPES)."""
        out: dict[str, float] = {}
        for ps in self.parents.values():
            for p in ps:
                if p is not None:
                    out[p] = out.get(p, 0.0) + 1 / STRIPES
        return out


def _placed(fleet: Fleet, readers: list[str]) -> bool:
    return all(None not in fleet.parents.get(r, [None]) for r in readers)


def test_readers_asking_one_by_one_half_a_second_apart_get_one_trainer_upload():
    fleet = Fleet(4)
    fleet.arrive([0.0, 0.5, 1.0, 1.5])
    assert _placed(fleet, fleet.readers)
    assert fleet.trainer_copies() == 1.0


def test_readers_asking_one_by_one_upload_at_most_a_model_each():
    fleet = Fleet(8)
    fleet.arrive([k * 0.3 for k in range(8)])
    assert _placed(fleet, fleet.readers)
    assert max(fleet.uploads().values()) == 1.0


def test_readers_asking_all_at_once_get_one_trainer_upload():
    fleet = Fleet(8)
    fleet.arrive([0.0] * 8)
    assert _placed(fleet, fleet.readers)
    assert fleet.trainer_copies() == 1.0


def test_a_reader_asking_alone_takes_every_stripe_before_the_grace_is_over():
    fleet = Fleet(4)  # three more are registered, none of them asking
    fleet.ask(fleet.readers[0])
    fleet.advance(fleet.config.pending_grace / 2)
    assert fleet.parents[fleet.readers[0]] == [fleet.trainer] * STRIPES


def test_a_reader_that_fails_first_does_not_cost_a_second_upload():
    fleet = Fleet(5)
    broken, *good = fleet.readers
    fleet.ask(broken)
    fleet.advance(0.1)  # placed: it reads from the trainer, and fails
    reply = fleet.ask_again(broken, list(range(STRIPES)), failed=(fleet.trainer,))
    assert isinstance(reply, ErrorReply) and reply.code == "unreachable"
    fleet.give_up(broken, reply.message)
    fleet.arrive([0.2, 0.2, 0.2, 0.2])
    assert _placed(fleet, good)
    assert fleet.trainer_copies() == 1.0


def test_readers_placed_under_a_reader_that_fails_first_get_no_second_upload():
    fleet = Fleet(5)
    broken, *good = fleet.readers
    fleet.arrive([0.0, 0.3, 0.6, 0.9, 1.2])  # the broken one first; the rest under it
    under = [r for r in good if broken in fleet.parents[r]]
    assert under
    fleet.ask_again(broken, list(range(STRIPES)), failed=(fleet.trainer,))
    fleet.give_up(broken, "its reads failed")
    for r in under:  # their reads of it fail: each asks for another parent there
        fleet.ask_again(r, [s for s, p in enumerate(fleet.parents[r]) if p == broken],
                        failed=(broken,))
    fleet.advance(fleet.now + 2 * fleet.config.pending_grace)
    assert _placed(fleet, good)
    assert fleet.trainer_copies() == 1.0


def test_a_reader_that_asks_after_the_first_completed_reads_from_it_not_the_trainer():
    fleet = Fleet(2)
    first, late = fleet.readers
    fleet.arrive([0.0])
    fleet.call(Hold(worker_id=first, model="m", version=1, layout_id=LID, memory=MEMORY,
                    endpoint=EP))
    fleet.call(ReadDone(worker_id=first, lease_id=fleet.leases[first], ok=True))
    fleet.readers = [late]
    fleet.arrive([fleet.now + 5.0])
    assert fleet.parents[late] == [first] * STRIPES
