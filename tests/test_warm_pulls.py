"""A steady fleet: the next version is pulled from the same parents, with no plan request."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from tensorhub import Publisher, Replica, TensorHubError
from tensorhub.coordinator import dispatch, holdings
from tensorhub.core.checksum import checksum
from tensorhub.core.data_types import ConfirmParents, Envelope, LatestRequest
from tensorhub.core.errors import TransferError
from tensorhub.core.wire import encode
from tensorhub.tools.synthetic_weights import synthetic_state_dict
from tensorhub_testing.waits import wait_for

pytestmark = pytest.mark.slow  # (parents that leave, leases that end: not in the fast loop)


def sums(tensors) -> dict[str, str]:
    return {n: checksum(t) for n, t in tensors.items()}


def _pull_all(replicas: list[Replica], version: int) -> None:
    errors = []

    def pull(r: Replica) -> None:
        try:
            assert r.wait_for_newer(timeout=30) == version
            assert r.pull(version, timeout=60) == version
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=pull, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _buffers(state) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in state.items()}


def spy(monkeypatch, kind: type, seen: list) -> None:
    """From now on, every request of `kind` the coordinator answers also goes to `seen`."""
    real = dispatch.HANDLERS[kind]
    monkeypatch.setitem(dispatch.HANDLERS, kind,
                        lambda state, req: seen.append(req) or real(state, req))


def counting_plans(monkeypatch) -> list:
    """From now on, the kind of every plan request the coordinator answers, in order."""
    asked = []
    for kind in dispatch.PLANS:
        real = dispatch.HANDLERS[kind]
        monkeypatch.setitem(dispatch.HANDLERS, kind, lambda state, req, real=real:
                            asked.append(req.type) or real(state, req))
    return asked


@contextlib.contextmanager
def replica_fleet(address: str, buffers: dict[str, torch.Tensor], n: int,
                  transport: str) -> Iterator[list[Replica]]:
    """`n` replicas with buffers like `buffers`, closed at the end (but for any a test
    closed and took out of the list)."""
    replicas = [Replica(address, "policy", {k: t.clone() for k, t in buffers.items()},
                        name=f"r{i}", transport=transport) for i in range(n)]
    try:
        yield replicas
    finally:
        for r in replicas:
            r.close()


def test_the_second_version_needs_no_plan_request_and_is_bit_exact(coordinator, monkeypatch,
                                                                    transport):
    v1 = synthetic_state_dict(32, n_tiny=30, seed=1)
    v2 = {n: t + 1 for n, t in v1.items()}
    with Publisher(coordinator.address, "policy", transport=transport) as pub, \
            replica_fleet(coordinator.address, _buffers(v1), 3, transport) as replicas:
        pub.publish(v1)
        _pull_all(replicas, 1)
        assert all(r.last_pull_planned for r in replicas)  # the first: one plan each
        asked = counting_plans(monkeypatch)
        pub.publish(v2)
        _pull_all(replicas, 2)
        # one confirmation each, sent as it started reading, and no plan waited for
        assert asked == ["confirm_parents"] * 3 and not any(r.last_pull_planned for r in replicas)
        for r in replicas:
            assert sums(r.tensors) == sums(v2)
        # each ended the lease the coordinator opened for it by its known id
        assert not [lease for lease in coordinator.table.leases.values()
                    if lease.version == 2]


def test_a_publisher_whose_memory_moved_makes_readers_plan_again(coordinator):
    v1 = synthetic_state_dict(8, n_tiny=10, seed=2)
    v2 = {n: t * 2 for n, t in v1.items()}
    with Publisher(coordinator.address, "policy", transport="zmq", zero_copy=True) as pub, \
            Replica(coordinator.address, "policy", _buffers(v1), name="r",
                    transport="zmq") as r:
        pub.publish(v1)
        _pull_all([r], 1)
        pub.publish(v2)  # zero copy: the new tensors are the publisher's memory now
        _pull_all([r], 2)
        assert r.last_pull_planned and sums(r.tensors) == sums(v2)


def test_a_parent_that_left_between_versions_is_replaced(coordinator):
    v1 = synthetic_state_dict(16, n_tiny=10, seed=3)
    v2 = {n: t - 1 for n, t in v1.items()}
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            replica_fleet(coordinator.address, _buffers(v1), 3, "zmq") as replicas:
        pub.publish(v1)
        _pull_all(replicas, 1)
        parents = {r.session.name: set(r._parents.stripes) for r in replicas}
        gone = next(r for r in replicas
                    if any(r.session.worker_id in p for p in parents.values()))
        gone.close()
        replicas.remove(gone)
        pub.publish(v2)
        _pull_all(replicas, 2)
        for r in replicas:
            assert sums(r.tensors) == sums(v2)


def test_the_fallback_answers_with_the_announcement(coordinator):
    from tensorhub.core.client import CoordinatorClient

    state = synthetic_state_dict(4, n_tiny=10, seed=4)
    with Publisher(coordinator.address, "policy", transport="zmq") as pub:
        pub.publish(state)
        client = CoordinatorClient(coordinator.address)
        try:
            latest = client.call(LatestRequest(model="policy"))
        finally:
            client.close()
        assert latest.version == 1 and latest.publisher == pub.session.worker_id
        layout = coordinator.table.models["policy"].versions[1].layouts[latest.layout_id]
        assert latest.checksums == layout.checksums
        assert latest.manifest == layout.manifest  # what a reader with no buffers needs
        assert [t.name for t in latest.manifest.tensors] == list(state)
        # encoded once: the socket's bytes and the handler's model are the same reply
        assert coordinator.handle(encode(Envelope(request=LatestRequest(model="policy")))) \
            == latest


def test_a_reader_with_no_buffers_allocates_them_from_the_announcement(coordinator, monkeypatch):
    """A fleet's first version: a reader that heard the announcement asks for no manifest
    before its first plan (every reader's first message waits in the coordinator's queue)."""
    from tensorhub.core.data_types import GetManifest

    state = synthetic_state_dict(8, n_tiny=10, seed=5)
    asked = []
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", name="cold", transport="zmq") as r:
        pub.publish(state)
        spy(monkeypatch, GetManifest, asked)
        _pull_all([r], 1)
        assert asked == [] and sums(r.tensors) == sums(state)


def test_an_engine_copy_learns_each_version_from_its_announcement(coordinator, monkeypatch):
    """An engine's checkpoint copy (`PartedReplica`) takes a version's parts and layout
    from its announcement: per version it sends the coordinator what a replica sends."""
    from tensorhub.core.data_types import GetManifest
    from tensorhub.parted import PartedReplica

    v1 = synthetic_state_dict(8, n_tiny=10, seed=6)
    v2 = {n: t + 1 for n, t in v1.items()}
    manifests, before = [], []
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            PartedReplica(coordinator.address, "policy", name="engine",
                          transport="zmq") as copy:
        pub.publish(v1)
        spy(monkeypatch, GetManifest, before)
        _pull_all([copy], 1)
        assert before == []
        with monkeypatch.context() as publishing:  # (the publisher asks for the latest)
            publishing.setitem(dispatch.HANDLERS, GetManifest, holdings.manifest)
            pub.publish(v2)
        spy(monkeypatch, GetManifest, manifests)
        asked = counting_plans(monkeypatch)
        _pull_all([copy], 2)
        assert manifests == [] and asked == ["confirm_parents"]  # only the confirmation
        assert sums(copy.tensors) == sums(v2)


def test_a_warm_pull_that_fails_after_a_coordinator_restart_leaves_no_read_behind(coordinator):
    """The pull began by its last parents under its old worker id; the coordinator then
    restarted, and the confirmation opened a lease under the new id; the reads fail. The
    pull ends that lease too, not only its first plan's (unknown by then): the
    trainer's next publish finds no read of the old version in flight and goes on."""
    state = synthetic_state_dict(8, n_tiny=50, seed=1)
    with Publisher(coordinator.address, "policy", transport="zmq", retain_timeout=1.0,
                   release_timeout=3.0) as pub, \
            Replica(coordinator.address, "policy", name="r0", transport="zmq") as r:
        pub.publish(state)
        assert r.wait_for_newer(5) == 1 and r.pull(timeout=10) == 1
        pub.publish({k: v + 1 for k, v in state.items()})
        assert r.wait_for_newer(5) == 2
        old_id = r.session.worker_id

        real_call = r.session.call

        def confirm_after_restart(request, timeout=None):
            if isinstance(request, ConfirmParents):
                coordinator.start_over()  # (a restart, sockets kept)
                wait_for(lambda: r.session.worker_id != old_id
                         and pub.session.registrations == 2,
                         timeout=10, what="both registered again")
                wait_for(lambda: "policy" in coordinator.table.models, timeout=10,
                         what="the trainer's v2 held again")
            return real_call(request, timeout)

        def failing_read(peer, ops, timeout):
            raise TransferError(f"no bytes from {peer.worker_id}", peer.worker_id)

        r.session.call = confirm_after_restart
        r.session.transport.read = failing_read
        with pytest.raises(TensorHubError):
            r.pull(timeout=10)
        assert coordinator.table.leases == {}
        assert pub.publish({k: v + 2 for k, v in state.items()}) == 3
