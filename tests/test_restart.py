"""The coordinator keeps only soft state: kill it, restart it, and nothing is lost."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tensorhub import Publisher, Replica
from tensorhub.core.checksum import checksum
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import StatusRequest
from tensorhub.tools.synthetic_weights import synthetic_state_dict
from tensorhub_testing.local_fleet import CoordinatorProcess, replica_process
from tensorhub_testing.waits import wait_for

pytestmark = pytest.mark.slow  # (processes per test, or waits on timeouts: not in the fast loop)


@pytest.fixture
def coordinator_proc():
    proc = CoordinatorProcess().start()
    yield proc
    proc.stop()


def holders_by_version(address: str) -> dict[int, set[str]]:
    client = CoordinatorClient(address, timeout=5.0)
    try:
        reply = client.call(StatusRequest())
    finally:
        client.close()
    out: dict[int, set[str]] = {}
    for m in reply.models:
        for v in m.versions:
            out.setdefault(v.version, set()).update(
                h.name for h in v.holders if not h.withdrawn)
    return out


def sums(state) -> dict[str, str]:
    return {n: checksum(t) for n, t in state.items()}


def test_after_a_restart_workers_re_register_and_the_next_version_reaches_all(
        coordinator_proc, transport):
    state = synthetic_state_dict(16, n_tiny=50, seed=3)
    replicas = [replica_process(coordinator_proc.address, f"r{i}", transport) for i in range(2)]
    pids = [r.pid for r in replicas]
    try:
        with Publisher(coordinator_proc.address, "policy", transport=transport) as pub:
            assert pub.publish(state) == 1
            for r in replicas:
                assert r.next_json(timeout=120)["version"] == 1
            coordinator_proc.kill()
            coordinator_proc.start()
            # Soft state comes back from the workers within a few heartbeats.
            wait_for(lambda: holders_by_version(coordinator_proc.address).get(1, set())
                       >= {"r0", "r1"}, 30, "replicas re-announce v1")
            for t in state.values():
                t.add_(1.0)
            assert pub.publish(state) == 2  # version numbers never go back
            for r in replicas:
                event = r.next_json(timeout=120)
                assert (event["event"], event["version"]) == ("pulled", 2)
                assert event["checksums"] == sums(state)
        assert [r.pid for r in replicas] == pids
        assert all(r.proc.poll() is None for r in replicas)  # nobody restarted
    finally:
        for r in replicas:
            r.stop()


def test_a_pull_in_flight_when_the_coordinator_dies_completes_and_is_announced_after(
        coordinator_proc, transport, monkeypatch):
    state = synthetic_state_dict(64, n_tiny=50, seed=4)
    with Publisher(coordinator_proc.address, "policy", transport=transport) as pub, \
            Replica(coordinator_proc.address, "policy", transport=transport,
                    name="reader") as reader:
        pub.publish(state)
        real_read = reader.session.transport.read
        reads = []
        restarted = threading.Event()

        def read_while_the_coordinator_dies(peer, ops, timeout):
            reads.append(1)
            if len(reads) == 1:
                coordinator_proc.kill()
                threading.Thread(target=lambda: (coordinator_proc.start(), restarted.set()),
                                 daemon=True).start()
            return real_read(peer, ops, timeout)

        monkeypatch.setattr(reader.session.transport, "read", read_while_the_coordinator_dies)
        assert reader.pull(timeout=120) == 1
        assert restarted.wait(60)
        assert sums(reader.tensors) == sums(state)
        assert len(reads) >= 2  # the coordinator died mid-pull, the reads went on
        wait_for(lambda: "reader" in holders_by_version(coordinator_proc.address).get(1, set()),
                   30, "the reader announces v1 to the restarted coordinator")


def registered(address: str) -> set[str]:
    client = CoordinatorClient(address, timeout=5.0)
    try:
        return {str(w["worker_id"]) for w in client.call(StatusRequest()).workers}
    finally:
        client.close()


def test_a_coordinator_paused_longer_than_the_ttl_keeps_its_workers(coordinator_proc):
    """SIGSTOP the coordinator for twice its 2 s TTL: the heartbeats sent meanwhile wait in
    its queue, so on waking it must not drop the workers that sent them."""
    replicas = [Replica(coordinator_proc.address, "policy", transport="zmq", name=f"r{i}")
                for i in range(3)]
    try:
        ids = {r.session.worker_id for r in replicas}
        os.kill(coordinator_proc.proc.pid, signal.SIGSTOP)
        time.sleep(4.0)
        os.kill(coordinator_proc.proc.pid, signal.SIGCONT)
        time.sleep(1.0)
        assert registered(coordinator_proc.address) == ids
        assert [r.session.registrations for r in replicas] == [1, 1, 1]
    finally:
        os.kill(coordinator_proc.proc.pid, signal.SIGCONT)
        for r in replicas:
            r.close()


def test_a_publish_while_the_coordinator_is_paused_lands_when_it_resumes(coordinator_proc):
    state = synthetic_state_dict(1, n_tiny=4, seed=2)
    with Publisher(coordinator_proc.address, "policy", transport="zmq", name="trainer",
                   timeout=1.0, coordinator_wait=30.0) as pub:
        published: list[int] = []
        os.kill(coordinator_proc.proc.pid, signal.SIGSTOP)
        try:
            thread = threading.Thread(target=lambda: published.append(pub.publish(state)))
            thread.start()
            time.sleep(3.0)  # three of the publisher's 1 s timeouts
        finally:
            os.kill(coordinator_proc.proc.pid, signal.SIGCONT)
        thread.join(30)
        assert published == [1]
        assert holders_by_version(coordinator_proc.address) == {1: {"trainer"}}


def test_heartbeats_do_not_wait_behind_a_slow_call(coordinator):
    """A plan or withdrawal stuck on the session's connection for longer than the TTL
    (2 s here) must not get a healthy worker evicted."""
    with Replica(coordinator.address, "policy", transport="zmq", name="slow") as rep:
        worker_id = rep.session.worker_id
        with rep.session.client._lock:  # the request connection is busy for 3 s
            time.sleep(3.0)
        assert worker_id in coordinator.table.workers
        assert rep.session.worker_id == worker_id  # never had to register again


def test_a_plan_request_carrying_messages_of_an_older_registration_is_accepted(coordinator):
    from tensorhub.core.data_types import PlanRequest, ReadDone

    state = synthetic_state_dict(4, n_tiny=10, seed=5)
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="r") as rep:
        pub.publish(state)
        stale = ReadDone(worker_id="reader-before-a-restart", lease_id="gone", ok=True)
        plan = rep.session.call(PlanRequest(worker_id=rep.session.worker_id, model="policy",
                                            version=1, done=stale))
        assert plan.ranges  # the old id was restamped, not refused


def test_a_replica_started_before_its_coordinator_registers_once_it_answers():
    """A worker whose first request goes unanswered (the coordinator not up yet, or killed
    with the request in its queue) registers on the next try instead of exiting."""
    from tensorhub.coordinator.server import Coordinator, CoordinatorConfig
    from tensorhub.core.net import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    started: list[Coordinator] = []
    later = threading.Timer(1.5, lambda: started.append(Coordinator(CoordinatorConfig(
        bind=address, announce="tcp://127.0.0.1:0")).start()))
    later.start()
    try:
        with Replica(address, "policy", transport="zmq", timeout=0.5,
                     coordinator_wait=30.0) as replica:
            assert started and replica.session.worker_id in started[0].table.workers
    finally:
        later.join()
        for c in started:
            c.stop()


def test_a_replica_of_another_run_cannot_poison_the_numbering_after_a_restart():
    """After a coordinator restart a replica left over from an earlier job brings back a
    version far past the trainer's (v500). Once the trainer registers again, saying the
    newest it published, that version is dropped: never served, and the trainer's next
    publish is its own next number, which readers get bit-exact. (Heartbeats 5 s apart, so
    the left-over one is almost always first; if the trainer is, its word refuses v500.)"""

    coordinator_proc = CoordinatorProcess(heartbeat_interval=5.0, worker_ttl=30.0).start()
    try:
        _a_replica_of_another_run_cannot_poison_the_numbering(coordinator_proc)
    finally:
        coordinator_proc.stop()


def _a_replica_of_another_run_cannot_poison_the_numbering(coordinator_proc) -> None:
    from tensorhub.core.errors import CoordinatorError

    state = synthetic_state_dict(4, n_tiny=10, seed=21)
    other_run = synthetic_state_dict(4, n_tiny=10, seed=22)
    with Publisher(coordinator_proc.address, "policy", transport="zmq") as pub, \
            Replica(coordinator_proc.address, "policy", transport="zmq",
                    name="current") as current:
        assert pub.publish(state) == 1
        assert current.pull(timeout=30) == 1
        coordinator_proc.kill()
        coordinator_proc.start()
        with Replica(coordinator_proc.address, "policy", other_run, transport="zmq",
                     name="left-over") as left_over:
            left_over.layout.pack()
            try:  # before the trainer is back (accepted, then dropped), or after (refused)
                left_over.session.hold("policy", 500, left_over.layout,
                                       left_over.layout.checksums())
            except CoordinatorError as refused:
                assert refused.code == "unknown_version"
            wait_for(lambda: any(w.startswith("trainer-")
                                 for w in registered(coordinator_proc.address)), 30,
                     "the trainer registering again")
            assert 500 not in holders_by_version(coordinator_proc.address)
            for t in state.values():
                t.add_(1.0)
            assert pub.publish(state) == 2
            assert current.pull(timeout=30) == 2
            assert sums(current.tensors) == sums(state)
