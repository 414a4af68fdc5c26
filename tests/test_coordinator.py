"""Bad input at the coordinator: each gets a clear typed error, and the coordinator serves on."""

import msgpack
import pytest
import torch
import zmq

from tensorhub import CoordinatorError, LayoutError, Publisher, Replica
from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import (
    Endpoint,
    Hold,
    HoldingsRequest,
    Manifest,
    PlanRequest,
    Publish,
    ReadDone,
    Register,
    StatusRequest,
    TensorSpec,
)
from tensorhub.core.transport import grants

STATE = {"w": torch.ones(4, 4), "b": torch.zeros(4)}


def _still_serving(address: str) -> None:
    client = CoordinatorClient(address, timeout=5)
    assert client.call(StatusRequest()).type == "status_reply"
    client.close()


def test_publishing_an_older_or_equal_version_is_refused(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        assert pub.publish(STATE, version=5) == 5
        for stale in (5, 3):
            with pytest.raises(CoordinatorError, match="at version 5") as err:
                pub.publish(STATE, version=stale)
            assert err.value.code == "stale_version"
        assert pub.publish(STATE) == 6  # and it still serves: the next version is fine


def test_a_second_trainer_cannot_go_back_either(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as a:
        a.publish(STATE, version=2)
        client = CoordinatorClient(coordinator.address)
        reg = client.call(Register(name="t2", role="trainer", endpoint=Endpoint(transport="zmq",
                                   address="tcp://127.0.0.1:1")))
        manifest = Manifest(tensors=[TensorSpec(name="x", dtype="float32", shape=[2],
                                                nbytes=8)], compact_threshold=1 << 20)
        with pytest.raises(CoordinatorError) as err:
            client.call(Publish(worker_id=reg.worker_id, model="policy", version=2,
                                manifest=manifest, checksums=["0"], memory=[]))
        assert err.value.code == "unauthorized"  # (the model is the first trainer's)
        with pytest.raises(CoordinatorError) as err:  # and with its credential, stale
            client.call(Publish(worker_id=reg.worker_id, model="policy", version=2,
                                manifest=manifest, checksums=["0"], memory=[],
                                owner=a.session.owners["policy"]))
        assert err.value.code == "stale_version"
        client.close()


def _raw_trainer(address):
    client = CoordinatorClient(address)
    reg = client.call(Register(name="raw", role="trainer",
                               endpoint=Endpoint(transport="zmq", address="tcp://127.0.0.1:1")))
    return client, reg.worker_id


def test_a_manifest_whose_sizes_contradict_its_shapes_is_refused(coordinator):
    client, wid = _raw_trainer(coordinator.address)
    bad = Manifest(tensors=[TensorSpec(name="w", dtype="float32", shape=[4, 4], nbytes=60)],
                   compact_threshold=1 << 20)
    with pytest.raises(CoordinatorError, match="'w': nbytes 60 does not match") as err:
        client.call(Publish(worker_id=wid, model="policy", version=1, manifest=bad,
                            checksums=["x"], memory=[]))
    assert err.value.code == "bad_request"
    client.close()
    _still_serving(coordinator.address)


def test_a_publish_repeated_after_a_lost_answer_is_answered_as_the_first(coordinator):
    from tensorhub.core.data_types import MemoryDesc

    client, wid = _raw_trainer(coordinator.address)
    manifest = Manifest(tensors=[TensorSpec(name="w", dtype="float32", shape=[4], nbytes=16)],
                        compact_threshold=1 << 20)
    publish = Publish(worker_id=wid, model="policy", version=1, manifest=manifest,
                      checksums=["x"], memory=[MemoryDesc(addr=4096, nbytes=64)])
    first, again = client.call(publish), client.call(publish)
    assert (again.version, again.layout_id) == (first.version, first.layout_id)
    assert first.version == 1
    with pytest.raises(CoordinatorError) as err:  # other bytes under the same number: no
        client.call(publish.model_copy(update={"checksums": ["y"], "owner": first.owner}))
    assert err.value.code == "stale_version"
    client.close()


def test_registered_memory_that_does_not_fit_the_layout_is_refused(coordinator):
    from tensorhub.core.data_types import MemoryDesc

    client, wid = _raw_trainer(coordinator.address)
    manifest = Manifest(tensors=[TensorSpec(name="w", dtype="float32", shape=[4], nbytes=16)],
                        compact_threshold=1 << 20)
    with pytest.raises(CoordinatorError, match="item 0: 8 bytes registered") as err:
        client.call(Publish(worker_id=wid, model="policy", version=1, manifest=manifest,
                            checksums=["x"], memory=[MemoryDesc(addr=4096, nbytes=8)]))
    assert err.value.code == "layout_mismatch"
    client.close()


def test_a_replica_whose_tensors_have_another_shape_gets_a_layout_error(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(STATE)
        wrong = {"w": torch.zeros(4, 5), "b": torch.zeros(4)}
        with Replica(coordinator.address, "policy", wrong, transport="zmq") as rep:
            with pytest.raises(LayoutError, match="'w' is float32\\[4, 5\\] here") as err:
                rep.pull(timeout=5)
            assert err.value.code == "layout_mismatch"
            assert rep.version is None


def test_plans_for_an_unknown_model_or_version_say_what_exists(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(STATE, version=3)
        with Replica(coordinator.address, "policy", STATE, transport="zmq") as rep:
            with pytest.raises(CoordinatorError, match="latest is 3") as err:
                rep.pull(version=9, timeout=5)
            assert err.value.code == "unknown_version"
            client = rep.session.client
            with pytest.raises(CoordinatorError, match=r"'nope' has no versions \(known: policy\)"):
                client.call(PlanRequest(worker_id=rep.session.worker_id, model="nope"))


def test_a_workers_session_sends_requests_that_name_no_worker_as_they_are(coordinator):
    with Replica(coordinator.address, "policy", STATE, transport="zmq") as rep:
        status = rep.session.call(StatusRequest())  # (it gains no worker_id: refused)
        assert rep.session.worker_id in {w["worker_id"] for w in status.workers}


def test_requests_from_an_unknown_worker_are_told_to_register(coordinator):
    client = CoordinatorClient(coordinator.address)
    with pytest.raises(CoordinatorError, match="register again") as err:
        client.call(Hold(worker_id="ghost", model="m", version=1, layout_id="x", memory=[]))
    assert err.value.code == "unknown_worker"
    client.close()


@pytest.mark.parametrize("frames", [
    [b"id", b"\xc1\xc1not msgpack"],
    [b"id", msgpack.packb({"request": {"type": "publish", "version": -1}})],
    [b"id", msgpack.packb({"request": {"type": "status"}, "token": ["x"]})],
    [b"only-one-frame"],
    [b"id", b"payload", b"one too many"],
    [b"id", b"\x00" * 100_000],
])
def test_malformed_bytes_on_the_socket_get_an_error_and_the_coordinator_serves_on(
        coordinator, frames):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(coordinator.address)
    sock.send_multipart(frames)
    if len(frames) >= 2:
        assert sock.poll(5000), "no reply to a malformed request"
        reply = msgpack.unpackb(sock.recv_multipart()[-1])
        assert reply["type"] == "error" and reply["code"] == "bad_request"
        assert reply["message"]
    sock.close()
    _still_serving(coordinator.address)


def test_a_coordinator_with_a_token_refuses_clients_without_it():
    c = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", token="s3cret")).start()
    try:
        with pytest.raises(CoordinatorError, match="token") as err:
            CoordinatorClient(c.address, token="wrong", timeout=1.0).call(StatusRequest())
        assert err.value.code == "unauthorized"
        assert CoordinatorClient(c.address, token="s3cret").call(StatusRequest()).workers == []
    finally:
        c.stop()


def test_holdings_name_the_versions_each_worker_holds(coordinator):
    from tensorhub.core.data_types import HoldingsRequest

    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="eng-a") as rep:
        pub.publish(STATE, version=4)
        rep.pull(timeout=10)
        reply = rep.session.client.call(HoldingsRequest(model="policy",
                                                        names=["eng-a", "eng-b"]))
        assert reply.latest == 4
        assert reply.holdings == {"eng-a": [4], "eng-b": []}


def test_the_planners_holder_list_follows_a_swap_of_holders():
    """One holder leaves and another joins: the count is the same, the list is not."""
    from tensorhub.coordinator.table import HolderRec, LayoutRec
    from tensorhub.core.data_types import Manifest

    layout = LayoutRec(Manifest(tensors=[], compact_threshold=1), [], [])
    layout.holders["trainer"] = HolderRec("trainer", ())
    assert layout.serving() == ["trainer"]
    layout.holders["first"] = HolderRec("first", ())
    layout.holders.pop("trainer")
    assert layout.serving() == ["first"]
    del layout.holders["first"]
    layout.holders["second"] = HolderRec("second", ())
    assert layout.serving() == ["second"]


def test_a_plan_request_ends_the_previous_lease_it_carries_but_never_anothers(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(STATE)
        client = CoordinatorClient(coordinator.address)
        ids = [client.call(Register(name=n, role="replica", endpoint=Endpoint(
            transport="zmq", address="tcp://127.0.0.1:1"))).worker_id for n in ("a", "b")]
        plan = client.call(PlanRequest(worker_id=ids[0], model="policy"))
        assert plan.lease_id in coordinator.table.leases
        theirs = ReadDone(worker_id=ids[0], lease_id=plan.lease_id, ok=True)
        with pytest.raises(CoordinatorError, match="carries a read_done of") as err:
            client.call(PlanRequest(worker_id=ids[1], model="policy", done=theirs))
        assert err.value.code == "bad_request"
        assert plan.lease_id in coordinator.table.leases
        client.call(PlanRequest(worker_id=ids[0], model="policy", done=theirs))
        assert plan.lease_id not in coordinator.table.leases


def test_a_later_plan_of_a_pull_leaves_out_the_manifest_the_reader_has(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        version = pub.publish(STATE)
        client = CoordinatorClient(coordinator.address)
        wid = client.call(Register(name="r", role="replica", endpoint=Endpoint(
            transport="zmq", address="tcp://127.0.0.1:1"))).worker_id
        first = client.call(PlanRequest(worker_id=wid, model="policy"))
        assert first.manifest is not None and first.checksums
        later = client.call(PlanRequest(worker_id=wid, model="policy", version=version,
                                        known_manifest=True,
                                        done=ReadDone(worker_id=wid, lease_id=first.lease_id,
                                                      ok=False)))
        assert later.manifest is None and later.checksums is None
        assert later.layout_id == first.layout_id and later.ranges == first.ranges
        latest = client.call(PlanRequest(  # "latest" may have moved on: sent again
            worker_id=wid, model="policy", known_manifest=True,
            done=ReadDone(worker_id=wid, lease_id=later.lease_id, ok=False)))
        assert latest.manifest == first.manifest


def test_a_plan_on_the_socket_is_the_plan_model_encoded():
    """On the socket a plan's manifest and its sources' memory regions are spliced in as
    the table encoded them once: the bytes must be those of the `ReadPlan` model, from a
    complete holder or a partial one (a striped reader's parent), with the manifest or
    without."""
    from tensorhub.coordinator import dispatch
    from tensorhub.coordinator.planner import PlannerConfig
    from tensorhub.coordinator.state import CoordinatorState
    from tensorhub.core.data_types import MemoryDesc, SharedRegion, StripedPlanRequest
    from tensorhub.core.wire import decode_reply, encode

    manifest = Manifest(tensors=[TensorSpec(name=f"t{i}", dtype="uint8", shape=[4096],
                                            nbytes=4096) for i in range(3)],
                        compact_threshold=1024)
    memory = [MemoryDesc(addr=(k + 1) << 40, nbytes=4096, device=k, mem="VRAM")
              for k in range(3)]
    state = CoordinatorState(CoordinatorConfig(
        lease_ttl=30,  # an int: the reply's is a float
        planner=PlannerConfig(chunk_bytes=4096, max_readers_per_holder=1)))

    def call(request):
        return dispatch.HANDLERS[type(request)](state, request)

    def join(name, role="replica"):
        endpoint = Endpoint(transport="nixl", agent_name=name, agent_metadata=b"\0\xff",
                            pid=42, host="h",
                            shared=[SharedRegion(fd=5, inode=7, addr=1 << 40, nbytes=4096)])
        return call(Register(name=name, role=role, endpoint=endpoint, labels={"dc": "a"},
                             grant_key=grants.new_key())).worker_id

    trainer = join("trainer", "trainer")
    call(Publish(worker_id=trainer, model="m", version=1, manifest=manifest,
                 checksums=["a", "b", "c"], memory=memory))
    partial, reader = join("partial"), join("reader")
    requests = [PlanRequest(worker_id=reader, model="m", version=1, known_manifest=known)
                for known in (False, True)]
    requests.append(StripedPlanRequest(worker_id=reader, model="m", version=1,
                                       memory=memory))  # under the partial holder
    sources = set()
    for request in requests:
        if request.type == "striped_plan":  # the partial holder takes the trainer's slots
            call(StripedPlanRequest(worker_id=partial, model="m", version=1, memory=memory))
        reply = call(request)
        plan = dispatch.as_model(reply)
        wire = dispatch.encode_reply(state, reply)
        assert wire == encode(plan) and decode_reply(wire) == plan
        assert all(src.grant and src.grant.startswith(f"{reader}.") for src in plan.sources)
        sources.update(s.worker_id for s in plan.sources)
        if request.type == "plan":
            call(ReadDone(worker_id=reader, lease_id=plan.lease_id, ok=True))
    assert sources == {trainer, partial}  # a complete and a partial holder's regions


def test_a_partial_holders_encoded_regions_follow_its_memory():
    from tensorhub.coordinator.table import PartialHolders, pack_memory

    holders = PartialHolders()
    first, second = ((1, 8, 0, "DRAM"),), ((2, 8, 0, "VRAM"),)
    holders.add("w", first)
    assert holders["w"].packed_memory() == pack_memory(first)
    holders.add("w", second)
    assert holders["w"].packed_memory() == pack_memory(second)


def test_the_transfer_history_reads_back_as_records_and_keeps_the_latest():
    from tensorhub.coordinator.table import Table
    from tensorhub.core.data_types import TransferRecord

    table = Table(max_transfers=3)
    records = [TransferRecord(reader="r", source=f"s{i}", model="m", version=1, nbytes=i,
                              seconds=0.5, ok=i % 2 == 0, error=None if i % 2 == 0 else "x",
                              ended_at=1000.0 + i)
               for i in range(5)]
    for rec in records:
        table.record(rec)
    assert len(table.transfers) == 3
    assert list(table.transfers) == records[2:]
    assert table.transfers[-2:] == records[3:] and table.transfers[0] == records[2]


def test_holdings_carry_a_readers_whole_last_pull_until_it_leaves(coordinator):
    """What an engine's front end counts on its /metrics: the pull, not one source's share."""
    state = {"a": torch.arange(1 << 18, dtype=torch.float32),
             "b": torch.ones(1 << 18, dtype=torch.float32)}
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(state)
        rep = Replica(coordinator.address, "policy", transport="zmq", name="engine-0")
        client = CoordinatorClient(coordinator.address)
        try:
            rep.pull()
            reply = client.call(HoldingsRequest(model="policy", names=["engine-0"]))
            pull = reply.pulls["engine-0"]
            assert (pull.version, pull.nbytes, pull.ok) == (1, 2 << 20, True)
            assert pull.nbytes == rep.last_pull.nbytes
            rep.close()  # it leaves: nothing of it is kept
            reply = client.call(HoldingsRequest(model="policy", names=["engine-0"]))
            assert reply.pulls == {}
        finally:
            client.close()
