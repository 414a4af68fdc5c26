"""Whole-item plans: which holder a reader pulls every item (or what it misses) from.

The coordinator's handlers are called directly on a fake clock (no sockets, no waiting):
these tests pin the planner's choices, not timing. (Striped plans: test_forest.py,
test_stripes.py.)
"""

from __future__ import annotations

import pytest

from tensorhub.coordinator.dispatch import HANDLERS, as_model
from tensorhub.coordinator.planner import PlannerConfig
from tensorhub.coordinator.state import CoordinatorConfig, CoordinatorState, Reject
from tensorhub.core.chunks import CHUNK_BYTES, chunks_of
from tensorhub.core.data_types import (
    ByteRange,
    Endpoint,
    ErrorReply,
    Hold,
    Manifest,
    MemoryDesc,
    PlanRequest,
    Publish,
    ReadDone,
    ReadPlan,
    Register,
    TensorSpec,
    Unregister,
)
from tensorhub.core.layout import Item, layout_id

ITEM = 4096  # four tensors of one chunk each
MANIFEST = Manifest(tensors=[TensorSpec(name=f"t{i}", dtype="uint8", shape=[ITEM], nbytes=ITEM)
                             for i in range(4)], compact_threshold=1024)
LID = layout_id(MANIFEST)
MEMORY = [MemoryDesc(addr=(k + 1) << 20, nbytes=ITEM) for k in range(4)]
EP = Endpoint(transport="zmq", address="tcp://127.0.0.1:1")


class Fleet:
    def __init__(self, **planner):
        self.now = 0.0
        self.coordinator = CoordinatorState(
            CoordinatorConfig(planner=PlannerConfig(chunk_bytes=ITEM, **planner)),
            clock=lambda: self.now)
        self.trainer = self.join("trainer", "trainer", dc="dc0", node="t")
        self.call(Publish(worker_id=self.trainer, model="m", version=1, manifest=MANIFEST,
                          checksums=["c"] * 4, memory=MEMORY))

    def call(self, request):
        try:
            return as_model(HANDLERS[type(request)](self.coordinator, request))
        except Reject as rej:
            return rej.reply

    def join(self, name, role="replica", **labels) -> str:
        return self.call(Register(name=name, role=role, endpoint=EP, labels=labels)).worker_id

    def plan(self, reader, missing=None):
        return self.call(PlanRequest(worker_id=reader, model="m", version=1, missing=missing))

    def hold(self, worker):
        self.call(Hold(worker_id=worker, model="m", version=1, layout_id=LID, memory=MEMORY))

    def done(self, reader, plan, ok=True):
        self.call(ReadDone(worker_id=reader, lease_id=plan.lease_id, ok=ok))


@pytest.fixture
def fleet_of():
    return Fleet


def source_by_item(plan: ReadPlan) -> dict[int, str]:
    return {r.item: r.source for r in plan.ranges}


def test_chunks_put_the_compact_region_first_and_cut_every_chunk_bytes():
    items = [Item(kind="compact", nbytes=100, tensors=[0], offsets=[0]),
             Item(kind="tensor", nbytes=250, tensors=[1], offsets=[0])]
    chunks = chunks_of(items, 128)
    assert [[(s.item, s.offset, s.nbytes) for s in c.segments] for c in chunks] == [
        [(0, 0, 100), (1, 0, 28)], [(1, 28, 128)], [(1, 156, 94)]]
    assert chunks_of(items, 128) == chunks  # deterministic: both sides agree on numbers
    assert CHUNK_BYTES == 64 << 20


def test_a_plan_that_does_not_opt_in_is_whole_items_from_one_source(fleet_of):
    fleet = fleet_of()
    reader = fleet.join("r")
    plan = fleet.call(PlanRequest(worker_id=reader, model="m", version=1))
    assert [(r.item, r.offset, r.nbytes) for r in plan.ranges] == [(k, 0, ITEM) for k in range(4)]
    assert {r.source for r in plan.ranges} == {fleet.trainer} and plan.complete


def test_replicas_serve_before_the_trainer(fleet_of):
    fleet = fleet_of()
    replica = fleet.join("a", dc="dc0")
    fleet.hold(replica)
    plan = fleet.plan(fleet.join("r", dc="dc0"))
    assert set(source_by_item(plan).values()) == {replica}
    assert [s.worker_id for s in plan.sources] == [replica]


def test_the_least_loaded_holder_serves_and_a_holder_at_its_cap_is_not_planned(fleet_of):
    fleet = fleet_of(max_readers_per_holder=1)
    replica = fleet.join("a", dc="dc0")
    fleet.hold(replica)
    first = fleet.plan(fleet.join("r1", dc="dc0"))
    assert set(source_by_item(first).values()) == {replica}
    second = fleet.plan(fleet.join("r2", dc="dc0"))  # the replica serves its maximum
    assert set(source_by_item(second).values()) == {fleet.trainer}
    third = fleet.plan(fleet.join("r3", dc="dc0"))
    assert isinstance(third, ErrorReply) and third.code == "busy" and third.retry_after > 0
    fleet.done(fleet.coordinator.table.leases[first.lease_id].reader, first)
    assert set(source_by_item(fleet.plan(fleet.join("r4"))).values()) == {replica}


def test_a_replan_reads_only_the_missing_ranges_and_they_must_lie_in_the_layout(fleet_of):
    fleet = fleet_of()
    reader = fleet.join("r")
    missing = [ByteRange(item=2, offset=100, nbytes=50)]
    plan = fleet.plan(reader, missing=missing)
    assert [(r.item, r.offset, r.nbytes) for r in plan.ranges] == [(2, 100, 50)]
    outside = fleet.plan(reader, missing=[ByteRange(item=2, offset=ITEM, nbytes=1)])
    assert isinstance(outside, ErrorReply) and outside.code == "bad_request"


def test_a_holder_the_reader_failed_on_is_avoided_by_that_reader(fleet_of):
    fleet = fleet_of()
    replica = fleet.join("a", dc="dc0")
    fleet.hold(replica)
    reader = fleet.join("r", dc="dc0")
    plan = fleet.plan(reader)
    assert set(source_by_item(plan).values()) == {replica}
    fleet.call(ReadDone(worker_id=reader, lease_id=plan.lease_id, ok=False,
                        failed_holders=[replica]))
    assert set(source_by_item(fleet.plan(reader)).values()) == {fleet.trainer}
    other = fleet.join("o", dc="dc0")  # one reader's report drops nobody
    assert set(source_by_item(fleet.plan(other)).values()) == {replica}


def test_a_version_nobody_holds_any_more_is_no_holder(fleet_of):
    fleet = fleet_of()
    reader = fleet.join("r")
    fleet.call(Unregister(worker_id=fleet.trainer))
    reply = fleet.plan(reader)
    assert isinstance(reply, ErrorReply) and reply.code in ("no_holder", "unknown_model")


