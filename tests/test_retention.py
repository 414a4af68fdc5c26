"""Retention: the newest version is never dropped by accident; a lost one fails clearly."""

from __future__ import annotations

import threading

import pytest

from tensorhub import Publisher, Replica
from tensorhub.core.checksum import checksum
from tensorhub.core.errors import CoordinatorError, TensorHubError
from tensorhub.tools.synthetic_weights import synthetic_state_dict


def holders(coordinator, version: int) -> set[str]:
    vrec = coordinator.table.models["policy"].versions.get(version)
    if vrec is None:
        return set()
    return {coordinator.table.workers[h].name
            for layout in vrec.layouts.values() for h, rec in layout.holders.items()
            if not rec.withdrawn}


def sums(tensors) -> dict[str, str]:
    return {n: checksum(t) for n, t in tensors.items()}


@pytest.fixture
def state():
    return synthetic_state_dict(4, n_tiny=10, seed=5)


def test_the_last_holder_of_the_newest_version_may_not_withdraw_it(coordinator, state):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="keeper") as keeper:
        pub.publish(state)
        keeper.pull()
        pub.release()  # a replica holds v1: the trainer may let go of its copy
        assert holders(coordinator, 1) == {"keeper"}
        with pytest.raises(TensorHubError) as refused:
            keeper.session.withdraw("policy", 1, timeout=0.5)
        assert refused.value.code == "last_holder"
        assert holders(coordinator, 1) == {"keeper"}
        keeper.session.withdraw("policy", 1, timeout=0.5, force=True)
        assert holders(coordinator, 1) == set()


def test_release_waits_until_a_replica_holds_the_version(coordinator, state):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="keeper") as keeper:
        pub.publish(state)
        late_pull = threading.Timer(0.5, keeper.pull)
        late_pull.start()
        pub.release(timeout=30)
        # The trainer let go only once the replica held v1: the version was never unheld.
        assert holders(coordinator, 1) == {"keeper"}
        late_pull.join()
        assert sums(keeper.tensors) == sums(state)


def test_closing_the_trainer_waits_until_a_replica_holds_the_newest_version(coordinator, state):
    with Replica(coordinator.address, "policy", transport="zmq", name="keeper") as keeper:
        pub = Publisher(coordinator.address, "policy", transport="zmq")
        pub.publish(state)
        late_pull = threading.Timer(0.5, keeper.pull)
        late_pull.start()
        pub.close()
        late_pull.join()
        assert holders(coordinator, 1) == {"keeper"}
        assert sums(keeper.tensors) == sums(state)


def test_a_holder_of_another_layout_does_not_let_the_trainer_go(coordinator, state):
    """An engine holding the version in its own (native) layout cannot serve readers of the
    trainer's layout: the trainer keeps its copy until one of its layout holds it."""
    native = {f"native.{name}": t.clone() for name, t in state.items()}
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", native, transport="zmq",
                    name="native") as other, \
            Replica(coordinator.address, "policy", transport="zmq", name="keeper") as keeper:
        pub.publish(state)
        other.layout.pack()
        other.session.hold("policy", 1, other.layout, other.layout.checksums())
        assert holders(coordinator, 1) == {"native", coordinator.table.workers[
            pub.session.worker_id].name}
        with pytest.raises(TensorHubError) as kept:
            pub.release(timeout=0.5)
        assert kept.value.code == "last_holder"
        keeper.pull()
        pub.release(timeout=30)
        assert holders(coordinator, 1) == {"native", "keeper"}
        assert sums(keeper.tensors) == sums(state)


def test_release_with_no_replica_anywhere_does_not_wait_for_one(coordinator, state):
    with Publisher(coordinator.address, "policy", transport="zmq", retain_timeout=600) as pub:
        pub.publish(state)
        pub.release()  # would block for 600 s if it waited
        assert holders(coordinator, 1) == set()


def test_a_version_nobody_holds_fails_by_name_and_a_staging_reader_keeps_its_own(
        coordinator):
    v1 = synthetic_state_dict(4, n_tiny=10, seed=1)
    v2 = {name: t + 1 for name, t in v1.items()}
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="reader",
                    staging=True) as reader:
        pub.publish(v1)
        assert reader.pull() == 1
        pub.publish(v2)
        pub.release(force=True)  # the trainer's copy of v2 was its only one
        with pytest.raises(CoordinatorError) as lost:
            reader.pull(timeout=10)
        assert lost.value.code == "no_holder"
        assert "v2" in str(lost.value)
        assert reader.version == 1 and sums(reader.tensors) == sums(v1)
        assert pub.publish(v2) == 3  # the trainer publishes the weights again
        assert reader.pull() == 3 and sums(reader.tensors) == sums(v2)


def test_a_version_withdrawn_before_anyone_held_it_fails_a_pull_by_its_old_parents(
        coordinator):
    """In place, by the parents of the last version (no plan first): the pull learns that
    nobody holds the version from the confirmation it sends as it starts, fails by name,
    and holds nothing (as after any failed in-place pull); the next version is pulled."""
    v1 = synthetic_state_dict(4, n_tiny=10, seed=1)
    v2 = {name: t + 1 for name, t in v1.items()}
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="reader") as reader:
        pub.publish(v1)
        assert reader.pull() == 1
        pub.publish(v2)
        pub.release(force=True)
        assert reader.wait_for_newer(timeout=10) == 2
        with pytest.raises(CoordinatorError) as lost:
            reader.pull(2, timeout=10)
        assert lost.value.code == "no_holder" and not reader.last_pull_planned
        assert reader.version is None
        assert pub.publish(v2) == 3
        # (heard first: "latest" by an announcement not yet heard would be v2, gone now)
        assert reader.wait_for_newer(timeout=10, than=2) == 3
        assert reader.pull() == 3 and sums(reader.tensors) == sums(v2)
