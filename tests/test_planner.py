"""Chunked plans: striping, pipelining from partial holders, topology, partial plans.

The coordinator's handlers are called directly on a fake clock (no sockets, no waiting):
these tests pin the planner's choices, not timing.
"""

from __future__ import annotations

import pytest

from tensorhub.coordinator.planner import PlannerConfig
from tensorhub.coordinator.server import Coordinator, CoordinatorConfig, Reject
from tensorhub.core.chunks import CHUNK_BYTES, chunks_in, chunks_of, merge
from tensorhub.core.data_types import (
    ByteRange,
    Endpoint,
    ErrorReply,
    Hold,
    Item,
    Manifest,
    MemoryDesc,
    PlanRequest,
    Progress,
    Publish,
    ReadDone,
    ReadPlan,
    Register,
    TensorSpec,
    Unregister,
)
from tensorhub.core.layout import layout_id

ITEM = 4096  # four tensors of one chunk each
MANIFEST = Manifest(tensors=[TensorSpec(name=f"t{i}", dtype="uint8", shape=[ITEM], nbytes=ITEM)
                             for i in range(4)], compact_threshold=1024)
LID = layout_id(MANIFEST)
MEMORY = [MemoryDesc(addr=(k + 1) << 20, nbytes=ITEM) for k in range(4)]
EP = Endpoint(transport="zmq", address="tcp://127.0.0.1:1")


class Fleet:
    def __init__(self, **planner):
        self.now = 0.0
        self.coordinator = Coordinator(
            CoordinatorConfig(bind="tcp://127.0.0.1:0", announce="tcp://127.0.0.1:0",
                              planner=PlannerConfig(chunk_bytes=ITEM, **planner)),
            clock=lambda: self.now)
        self.trainer = self.join("trainer", "trainer", dc="dc0", node="t")
        self.call(Publish(worker_id=self.trainer, model="m", version=1, manifest=MANIFEST,
                          checksums=["c"] * 4, memory=MEMORY))

    def call(self, request):
        try:
            return self.coordinator._handlers[type(request)](request)
        except Reject as rej:
            return rej.reply

    def join(self, name, role="replica", **labels) -> str:
        return self.call(Register(name=name, role=role, endpoint=EP, labels=labels)).worker_id

    def plan(self, reader, missing=None):
        return self.call(PlanRequest(worker_id=reader, model="m", version=1, chunked=True,
                                     missing=missing))

    def progress(self, worker, chunks):
        return self.call(Progress(worker_id=worker, model="m", version=1, layout_id=LID,
                                  memory=MEMORY, chunks=chunks))

    def hold(self, worker):
        self.call(Hold(worker_id=worker, model="m", version=1, layout_id=LID, memory=MEMORY))

    def done(self, reader, plan, ok=True):
        self.call(ReadDone(worker_id=reader, lease_id=plan.lease_id, ok=ok))

    def close(self):
        self.coordinator.stop()


@pytest.fixture
def fleet_of():
    made = []

    def make(**planner):
        made.append(Fleet(**planner))
        return made[-1]

    yield make
    for f in made:
        f.close()


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
    pieces = chunks_in(chunks, [ByteRange(item=1, offset=20, nbytes=20)])
    assert [(i, r.offset, r.nbytes) for i, r in pieces] == [(0, 20, 8), (1, 28, 12)]
    assert merge([ByteRange(item=1, offset=28, nbytes=128), ByteRange(item=1, offset=0,
                  nbytes=28)]) == [ByteRange(item=1, offset=0, nbytes=156)]
    with pytest.raises(ValueError):
        chunks_in(chunks, [ByteRange(item=1, offset=200, nbytes=100)])


def test_a_plan_that_does_not_opt_in_is_whole_items_from_one_source(fleet_of):
    fleet = fleet_of()
    reader = fleet.join("r")
    plan = fleet.call(PlanRequest(worker_id=reader, model="m", version=1))
    assert [(r.item, r.offset, r.nbytes) for r in plan.ranges] == [(k, 0, ITEM) for k in range(4)]
    assert {r.source for r in plan.ranges} == {fleet.trainer} and plan.complete


def test_chunks_are_striped_over_replicas_before_the_trainer(fleet_of):
    fleet = fleet_of(rarest_first=False, max_sources_per_plan=2, max_chunks_per_source=2,
                     max_chunks_from_idle_source=2)
    a, b = fleet.join("a", dc="dc0"), fleet.join("b", dc="dc0")
    fleet.hold(a)
    fleet.hold(b)
    reader = fleet.join("r", dc="dc0")
    plan = fleet.plan(reader)
    assert plan.complete
    by_item = source_by_item(plan)  # which replica comes first rotates with the plan count
    assert by_item[0] == by_item[1] and by_item[2] == by_item[3]
    assert {by_item[0], by_item[2]} == {a, b}
    assert {s.worker_id for s in plan.sources} == {a, b}


def test_by_default_a_plan_is_one_holder_and_a_reader_stripes_with_two_leases(fleet_of):
    fleet = fleet_of(rarest_first=False, max_chunks_per_source=2, max_chunks_from_idle_source=2)
    a, b = fleet.join("a", dc="dc0"), fleet.join("b", dc="dc0")
    fleet.hold(a)
    fleet.hold(b)
    reader = fleet.join("r", dc="dc0")
    first = fleet.plan(reader)
    one = set(source_by_item(first).values())
    assert one in ({a}, {b}) and not first.complete and set(source_by_item(first)) == {0, 1}
    left = [ByteRange(item=k, offset=0, nbytes=ITEM) for k in range(4)
            if k not in source_by_item(first)]
    second = fleet.plan(reader, missing=left)  # the second stream: the other holder
    assert set(source_by_item(second).values()) == {a, b} - one
    assert set(source_by_item(second)) == {2, 3} and second.complete


def test_idle_holders_come_before_busy_ones(fleet_of):
    fleet = fleet_of(max_sources_per_plan=1, max_chunks_per_source=2)
    busy, idle = fleet.join("busy", dc="dc0"), fleet.join("idle", dc="dc0")
    fleet.progress(busy, [0, 1, 2])
    fleet.progress(idle, [1, 2])
    hog = fleet.join("hog", dc="dc0")
    hogging = fleet.plan(hog, missing=[ByteRange(item=0, offset=0, nbytes=ITEM)])
    assert set(source_by_item(hogging).values()) == {busy}  # the only holder of chunk 0
    reader = fleet.join("r", dc="dc0")
    plan = fleet.plan(reader)
    # `busy` has more to offer, but `idle`'s upload is the one the fleet is wasting
    assert set(source_by_item(plan).values()) == {idle}
    assert list(source_by_item(plan)) == [1, 2]


def test_an_empty_reader_waiting_goes_before_a_second_stream(fleet_of):
    fleet = fleet_of(max_readers_per_holder=2, rarest_first=False,
                     max_chunks_from_idle_source=2)
    a = fleet.join("a", dc="dc0")
    fleet.hold(a)
    ahead = fleet.join("ahead", dc="dc0")
    first = fleet.plan(ahead)
    assert set(source_by_item(first).values()) == {a}  # replicas before the trainer
    e0, e1, e2, e3 = (fleet.join(f"e{i}", dc="dc0") for i in range(4))
    assert set(source_by_item(fleet.plan(e0)).values()) == {a}  # a is full now
    e1_plan = fleet.plan(e1)
    e2_plan = fleet.plan(e2)
    assert {r.source for p in (e1_plan, e2_plan) for r in p.ranges} == {fleet.trainer}
    assert fleet.plan(e3).code == "busy"  # an empty reader, reading nothing, waits
    fleet.done(e2, e2_plan)  # one trainer slot frees
    rest = [ByteRange(item=k, offset=0, nbytes=ITEM) for k in range(4)
            if k not in source_by_item(first)]
    assert fleet.plan(ahead, missing=rest).code == "busy"  # kept for e3
    assert set(source_by_item(fleet.plan(e3)).values()) == {fleet.trainer}
    fleet.done(e1, e1_plan)
    fleet.now += 1.0  # nobody empty waits any more: a second stream is fine
    assert set(source_by_item(fleet.plan(ahead, missing=rest)).values()) == {fleet.trainer}


def test_a_partial_holder_serves_the_chunks_it_finished_before_the_trainer(fleet_of):
    fleet = fleet_of(rarest_first=False, max_sources_per_plan=2, max_chunks_per_source=2)
    ahead = fleet.join("ahead", dc="dc0")
    assert fleet.progress(ahead, [0, 1]).type == "ack"
    reader = fleet.join("r", dc="dc0")
    plan = fleet.plan(reader)
    assert source_by_item(plan) == {0: ahead, 1: ahead, 2: fleet.trainer, 3: fleet.trainer}
    memory = {s.worker_id: s.memory for s in plan.sources}
    assert memory[ahead] == MEMORY  # the partial holder's registered destination regions


def test_a_busy_trainer_leaves_a_partial_plan_then_the_rest_follows(fleet_of):
    fleet = fleet_of(max_readers_per_holder=1, max_chunks_per_source=4)
    ahead = fleet.join("ahead", dc="dc0")
    fleet.progress(ahead, [0])
    other = fleet.join("other", dc="dc0")
    hogging = fleet.call(PlanRequest(worker_id=other, model="m", version=1))  # trainer's slot
    reader = fleet.join("r", dc="dc0")
    first = fleet.plan(reader)
    assert not first.complete
    assert source_by_item(first) == {0: ahead}
    fleet.progress(reader, [0])
    fleet.done(reader, first)
    # missing=None: everything this reader has not reported; nobody free has chunks 1..3
    assert fleet.plan(reader).code == "busy"
    fleet.done(other, hogging)
    rest = fleet.plan(reader, missing=[ByteRange(item=k, offset=0, nbytes=ITEM)
                                       for k in (1, 2, 3)])
    assert rest.complete
    assert source_by_item(rest) == {1: fleet.trainer, 2: fleet.trainer, 3: fleet.trainer}


def test_a_holder_at_its_reader_cap_is_not_planned(fleet_of):
    fleet = fleet_of(max_readers_per_holder=1, rarest_first=False, max_chunks_per_source=4)
    a = fleet.join("a", dc="dc0")
    fleet.hold(a)
    first, second = fleet.join("r1", dc="dc0"), fleet.join("r2", dc="dc0")
    p1 = fleet.plan(first)
    p2 = fleet.plan(second)
    assert set(source_by_item(p1).values()) == {a}
    assert set(source_by_item(p2).values()) == {fleet.trainer}


def test_topology_prefers_same_node_then_same_dc_then_remote(fleet_of):
    fleet = fleet_of(max_readers_per_holder=1, max_sources_per_plan=1)
    remote = fleet.join("remote", dc="dc9", node="n9")
    same_dc = fleet.join("same-dc", dc="dc1", node="n2")
    same_node = fleet.join("same-node", dc="dc1", node="n1")
    for h in (remote, same_dc, same_node):
        fleet.hold(h)
    chosen = []
    for i in range(3):
        reader = fleet.join(f"r{i}", dc="dc1", node="n1")
        plan = fleet.plan(reader)
        chosen.append(plan.ranges[0].source)
    assert chosen == [same_node, same_dc, remote]


def test_one_stream_into_a_remote_dc_whose_reader_then_seeds_it(fleet_of):
    fleet = fleet_of(max_readers_per_holder=8, rarest_first=False)
    first, second = fleet.join("r1", dc="far"), fleet.join("r2", dc="far")
    p1 = fleet.plan(first)
    assert set(source_by_item(p1).values()) == {fleet.trainer}
    reply = fleet.plan(second)
    assert isinstance(reply, ErrorReply) and reply.code == "busy"  # the one stream is taken
    fleet.progress(first, [0, 1])
    p2 = fleet.plan(second)
    assert source_by_item(p2) == {0: first, 1: first} and not p2.complete
    fleet.done(first, p1)
    p3 = fleet.plan(second, missing=[ByteRange(item=2, offset=0, nbytes=ITEM)])
    assert source_by_item(p3) == {2: fleet.trainer}  # the stream is free again


def test_progress_is_checked_and_a_reader_that_gives_up_serves_nothing(fleet_of):
    fleet = fleet_of(rarest_first=False)
    quitter = fleet.join("quitter", dc="dc0")
    bad = fleet.call(Progress(worker_id=quitter, model="m", version=1, layout_id=LID,
                              memory=MEMORY, chunks=[7]))
    assert bad.code == "bad_request" and "4 chunks" in bad.message
    short = fleet.call(Progress(worker_id=quitter, model="m", version=1, layout_id=LID,
                                memory=MEMORY[:2], chunks=[0]))
    assert short.code == "layout_mismatch"
    own = fleet.plan(quitter)
    fleet.progress(quitter, [0])
    fleet.done(quitter, own, ok=False)  # gave up: its buffers may be reused
    reader = fleet.join("r", dc="dc0")
    assert set(source_by_item(fleet.plan(reader)).values()) == {fleet.trainer}


def test_a_reader_with_every_chunk_gets_an_empty_complete_plan(fleet_of):
    fleet = fleet_of()
    reader = fleet.join("r", dc="dc0")
    fleet.progress(reader, [0, 1, 2, 3])
    plan = fleet.plan(reader)
    assert plan.ranges == [] and plan.complete


def test_a_contended_source_gives_one_chunk_a_plan_so_the_reader_soon_replans(fleet_of):
    fleet = fleet_of(rarest_first=False, max_chunks_from_idle_source=2)
    busy = fleet.join("busy", dc="dc0")
    assert source_by_item(fleet.plan(busy)) == {0: fleet.trainer, 1: fleet.trainer}
    reader = fleet.join("r", dc="dc0")  # the trainer is serving someone now
    plan = fleet.plan(reader)  # max_chunks_per_source=1 by default
    assert source_by_item(plan) == {2: fleet.trainer}
    assert not plan.complete  # when peers free up, the rest may come from them


def test_a_busy_sole_publisher_sends_only_chunks_nobody_has_or_is_reading(fleet_of):
    fleet = fleet_of(rarest_first=False, max_chunks_from_idle_source=4)
    busy = fleet.join("busy", dc="dc0")
    assert len(fleet.plan(busy).ranges) == 4  # every chunk is on its way to `busy`
    reader = fleet.join("r", dc="dc0")
    refused = fleet.plan(reader)  # a copy from the trainer would slow `busy` down
    assert refused.code == "busy"
    fleet.progress(busy, [0])  # `busy` serves chunk 0 as soon as it has it
    assert set(source_by_item(fleet.plan(reader)).values()) == {busy}


def test_an_idle_holder_gives_more_chunks_while_no_reader_waits_for_a_first(fleet_of):
    fleet = fleet_of(rarest_first=False, max_chunks_from_idle_source=3)
    reader = fleet.join("r", dc="dc0")
    plan = fleet.plan(reader)  # the trainer has nobody else to serve: fewer round trips
    assert source_by_item(plan) == {0: fleet.trainer, 1: fleet.trainer, 2: fleet.trainer}


def test_a_reader_already_reading_gets_one_chunk_even_from_an_idle_lone_holder(fleet_of):
    # its first stream holds a lease on `a`; a long lease from the trainer for the second
    # stream would leave the first nothing to plan when it comes back: no striping
    fleet = fleet_of(rarest_first=False, max_chunks_from_idle_source=3)
    a = fleet.join("a", dc="dc0")
    fleet.hold(a)
    reader = fleet.join("r", dc="dc0")
    first = fleet.plan(reader)
    assert set(source_by_item(first).values()) == {a}
    left = [ByteRange(item=k, offset=0, nbytes=ITEM) for k in range(4)
            if k not in source_by_item(first)]
    second = fleet.plan(reader, missing=left)
    assert set(source_by_item(second).values()) == {fleet.trainer}
    assert len(source_by_item(second)) == 1


def test_a_readers_memory_comes_with_its_first_progress_report_only(fleet_of):
    fleet = fleet_of(rarest_first=False)
    reader = fleet.join("r", dc="dc0")
    first = fleet.call(Progress(worker_id=reader, model="m", version=1, layout_id=LID,
                                chunks=[0]))
    assert first.code == "bad_request" and "must carry the reader's memory" in first.message
    fleet.progress(reader, [0])
    fleet.call(Progress(worker_id=reader, model="m", version=1, layout_id=LID, chunks=[1]))
    other = fleet.join("o", dc="dc0")
    plan = fleet.plan(other, missing=[ByteRange(item=1, offset=0, nbytes=ITEM)])
    assert source_by_item(plan) == {1: reader}  # served from the memory reported first
    assert {s.worker_id: s.memory for s in plan.sources}[reader] == MEMORY


def test_readers_that_only_have_each_other_are_told_no_holder_once_the_last_copy_is_gone(
        fleet_of):
    """The trainer dies mid-fan-out: two readers hold chunks {0, 1} and {1, 2}; nobody has
    chunk 3, so neither can finish. They are told so, not to wait (`busy`) until their
    timeouts."""
    fleet = fleet_of()
    a, b = fleet.join("a", dc="dc0"), fleet.join("b", dc="dc0")
    fleet.progress(a, [0, 1])
    fleet.progress(b, [1, 2])
    assert fleet.plan(a).type == "read_plan"  # the trainer still holds everything
    fleet.call(Unregister(worker_id=fleet.trainer))
    for reader in (a, b):
        reply = fleet.plan(reader)
        assert isinstance(reply, ErrorReply) and reply.code == "no_holder"


def test_readers_whose_chunks_together_make_the_version_still_read_from_each_other(fleet_of):
    fleet = fleet_of()
    a, b = fleet.join("a", dc="dc0"), fleet.join("b", dc="dc0")
    fleet.progress(a, [0, 1])
    fleet.progress(b, [2, 3])
    fleet.call(Unregister(worker_id=fleet.trainer))
    plan = fleet.plan(a)
    assert plan.type == "read_plan" and set(source_by_item(plan).values()) == {b}
