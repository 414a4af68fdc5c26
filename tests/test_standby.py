"""A fleet's first version: readers that stood by pull it with no plan request."""

from __future__ import annotations

import pytest
import torch

from tensorhub import Publisher, Replica
from tensorhub.coordinator import status
from tensorhub.coordinator.standby import StandingForests
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import PUBLISHER, MemoryDesc, StandBy
from tensorhub.core.errors import CoordinatorError
from tensorhub.core.stripes import Read, Replan, StripedPull
from tensorhub.engines.checkpoint_copy import CheckpointCopy
from tensorhub.tools.synthetic_weights import synthetic_state_dict
from tensorhub_testing.waits import wait_for
from tests.test_warm_pulls import (
    _buffers,
    _pull_all,
    counting_plans,
    replica_fleet,
    spy,
    sums,
)

pytestmark = pytest.mark.slow  # (waits for declarations and late versions: not in the fast loop)


def _stand_by(replicas: list[Replica]) -> None:
    """Until every replica has a parent in each stripe (a leaf waits out the grace)."""
    waiting = list(replicas)

    def placed() -> bool:
        waiting[:] = [r for r in waiting if not r.stand_by()]
        return not waiting

    wait_for(placed, timeout=10, what="every replica placed", interval=0.2)


def test_readers_on_standby_pull_the_first_version_with_no_plan_bit_exact(
        coordinator, monkeypatch, transport):
    v1 = synthetic_state_dict(32, n_tiny=30, seed=11)
    with Publisher(coordinator.address, "policy", transport=transport) as pub, \
            replica_fleet(coordinator.address, _buffers(v1), 4, transport) as replicas:
        _stand_by(replicas)
        placed = [r._parents.stripes for r in replicas]
        assert any(PUBLISHER in stripes for stripes in placed)  # the trees' tops
        assert any(PUBLISHER not in stripes for stripes in placed)  # read from readers
        asked = counting_plans(monkeypatch)
        pub.publish(v1)
        _pull_all(replicas, 1)
        # one confirmation each, sent as it started reading; no plan waited for
        assert asked == ["confirm_parents"] * 4 and not any(r.last_pull_planned for r in replicas)
        for r in replicas:
            assert sums(r.tensors) == sums(v1)
        assert not [lease for lease in coordinator.table.leases.values()
                    if lease.version == 1]
        # and the next version grows from the first one's forest, as ever
        v2 = {n: t + 1 for n, t in v1.items()}
        pub.publish(v2)
        _pull_all(replicas, 2)
        assert asked[4:] == ["confirm_parents"] * 4
        for r in replicas:
            assert sums(r.tensors) == sums(v2)


def test_a_reader_on_standby_whose_parent_left_still_pulls_bit_exact(coordinator):
    v1 = synthetic_state_dict(16, n_tiny=10, seed=12)
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            replica_fleet(coordinator.address, _buffers(v1), 3, "zmq") as replicas:
        _stand_by(replicas)
        gone = next(r for r in replicas
                    if any(r.session.worker_id in o._parents.stripes for o in replicas))
        gone.close()
        replicas.remove(gone)
        assert coordinator.standby.get("policy", gone.layout.layout_id) is not None
        assert gone.session.worker_id not in \
            coordinator.standby.get("policy", gone.layout.layout_id).memory
        pub.publish(v1)
        _pull_all(replicas, 1)
        for r in replicas:
            assert sums(r.tensors) == sums(v1)


def test_a_replica_waiting_for_a_first_version_stands_by_by_itself(coordinator):
    v1 = synthetic_state_dict(4, n_tiny=4, seed=13)
    with Publisher(coordinator.address, "policy", transport="zmq"), \
            Replica(coordinator.address, "policy", _buffers(v1), name="r",
                    transport="zmq") as r:
        assert r.wait_for_newer(timeout=0.1) is None
        standing = coordinator.standby.get("policy", r.layout.layout_id)
        assert standing is not None and r.session.worker_id in standing.memory
        assert r._parents is not None and r._parents.stripes == (PUBLISHER, PUBLISHER)
        status.measure_fleet(coordinator.state)
        assert coordinator.metrics.registry.get_sample_value("tensorhub_standby_readers") == 1


def _stand_by_request(coordinator, memory: list[MemoryDesc], model: str = "policy"):
    from tensorhub.core.data_types import Endpoint, Register

    client = CoordinatorClient(coordinator.address)
    try:
        wid = client.call(Register(name="raw", role="replica",
                                   endpoint=Endpoint(transport="zmq",
                                                     address="tcp://127.0.0.1:1"))).worker_id
        return client.call(StandBy(worker_id=wid, model=model, layout_id="L",
                                   memory=memory))
    finally:
        client.close()


def test_regions_that_do_not_fit_the_layouts_readers_are_refused(coordinator):
    placed = _stand_by_request(coordinator, [MemoryDesc(addr=4096, nbytes=100)])
    assert placed.stripes == [PUBLISHER, PUBLISHER] and placed.chunk_bytes > 0
    with pytest.raises(CoordinatorError) as err:
        _stand_by_request(coordinator, [MemoryDesc(addr=4096, nbytes=200)])
    assert err.value.code == "layout_mismatch" and "do not fit layout L" in str(err.value)


def test_standing_by_once_a_version_is_out_is_refused(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(synthetic_state_dict(2, n_tiny=2, seed=14))
        with pytest.raises(CoordinatorError) as err:
            _stand_by_request(coordinator, [MemoryDesc(addr=4096, nbytes=100)])
    assert err.value.code == "stale_version" and "pull it" in str(err.value)


def test_starting_over_forgets_the_readers_on_standby_with_the_table(coordinator):
    _stand_by_request(coordinator, [MemoryDesc(addr=4096, nbytes=100)])
    coordinator.start_over()
    assert len(coordinator.standby) == 0
    # a reader standing by now is placed among the workers the new table knows
    placed = _stand_by_request(coordinator, [MemoryDesc(addr=4096, nbytes=100)])
    assert placed.stripes == [PUBLISHER, PUBLISHER] and len(coordinator.standby) == 1


def test_a_reader_standing_by_again_after_its_parent_left_gets_another():
    forests = StandingForests(stripes=2, fanout=2, grace=0.0)

    def place(worker: str, now: float = 0.0) -> list[str | None]:
        return forests.place("m", "L", worker, "dc", (100,), ((4096, 100),), 6, now,
                             lambda: "dc")

    for w in "abcdef":
        place(w)
    members = forests.get("m", "L").forest.members
    child = next(w for w in "bcdef" if "a" in members[w].parents)
    forests.forget("a")
    parents = place(child, 1.0)
    assert "a" not in parents and None not in parents


def test_a_stripe_with_no_parent_yet_waits_for_the_confirmation_not_a_plan_request():
    pull = StripedPull(4, 2, version=1, confirming=True)
    pull.assign(["p", None], {"p"}, now=0.0)
    first = pull.actions(0.0)
    assert not [a for a in first if isinstance(a, Replan)]
    pull.confirmed(["p", "q"], {"p", "q"}, now=0.1)
    reads = [a for a in first + pull.actions(0.1) if isinstance(a, Read)]
    assert {(r.source, r.stripe) for r in reads} == {("p", 0), ("q", 1)}


def test_a_placed_replica_waits_for_the_version_without_asking_again(coordinator):
    v1 = synthetic_state_dict(4, n_tiny=4, seed=15)
    with Publisher(coordinator.address, "policy", transport="zmq"), \
            Replica(coordinator.address, "policy", _buffers(v1), name="r",
                    transport="zmq") as r:
        assert r.stand_by()
        r._standby_at = 0.0  # (long placed: its retry time is past)
        waits, real = [], r._watcher.wait_newer

        def wait_newer(than, timeout):
            waits.append(timeout)
            return real(than, timeout)

        r._watcher.wait_newer = wait_newer
        assert r.wait_for_newer(timeout=0.3) is None
        assert len(waits) == 1 and waits[0] > 0.2  # one wait to the deadline, no spinning


def _standing(coordinator, n: int) -> bool:
    return len(coordinator.standby) == n


def test_an_engine_copy_stands_by_on_a_declared_layout_and_needs_no_plan(
        coordinator, monkeypatch, transport):
    v1 = synthetic_state_dict(16, n_tiny=12, seed=16)
    with Publisher(coordinator.address, "policy", transport=transport) as pub:
        assert pub.declare(v1)
        holder = CheckpointCopy(coordinator.address, "policy", "engine-rank0",
                                transport=transport)  # (follows, as an engine's does)
        try:
            wait_for(lambda: _standing(coordinator, 1), timeout=10, what="on standby")
            asked = counting_plans(monkeypatch)
            pub.publish(v1)
            wait_for(lambda: holder.version == 1, timeout=30, what="v1 held")
            assert asked == ["confirm_parents"]  # no plan waited for
            assert not holder.replica.replicas[0].last_pull_planned
            assert sums(holder.replica.tensors) == sums(v1)
        finally:
            holder.close()


def test_an_engine_copy_waiting_before_the_declaration_stands_by_once_it_comes(
        coordinator, monkeypatch):
    from tensorhub.core.data_types import GetDeclared

    v1 = synthetic_state_dict(8, n_tiny=6, seed=18)
    asked_declared = []
    spy(monkeypatch, GetDeclared, asked_declared)
    holder = CheckpointCopy(coordinator.address, "policy", "engine-rank0", transport="zmq")
    try:
        with Publisher(coordinator.address, "policy", transport="zmq") as pub:
            wait_for(lambda: asked_declared, timeout=10, what="the copy asked (in vain)")
            assert pub.declare(v1)
            wait_for(lambda: _standing(coordinator, 1), timeout=20, what="on standby")
            asked = counting_plans(monkeypatch)
            pub.publish(v1)
            wait_for(lambda: holder.version == 1, timeout=30, what="v1 held")
            assert asked == ["confirm_parents"] and sums(holder.replica.tensors) == sums(v1)
    finally:
        holder.close()


def test_a_first_version_unlike_its_declaration_is_still_pulled_bit_exact(coordinator):
    declared = synthetic_state_dict(8, n_tiny=6, seed=17)
    v1 = {**declared, "extra": declared[next(iter(declared))].clone() + 1}
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        assert pub.declare(declared)
        holder = CheckpointCopy(coordinator.address, "policy", "engine-rank0",
                                transport="zmq")
        try:
            wait_for(lambda: _standing(coordinator, 1), timeout=10, what="on standby")
            pub.publish(v1)
            wait_for(lambda: holder.version == 1, timeout=30, what="v1 held")
            assert sums(holder.replica.tensors) == sums(v1)  # into new buffers, planned
            assert holder.replica.replicas[0].last_pull_planned
        finally:
            holder.close()


def test_a_declaration_once_a_version_is_out_is_declined(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish({"w": torch.ones(4)})
        assert not pub.declare({"w": torch.ones(4)})
        assert coordinator.standby.declared("policy") is None
