"""The live view (`tensorhub status --watch`): a reader's heartbeats carry its pull in
flight to the coordinator's status, long pulls log their progress, and the view draws
versions, holders and pulls with their progress and rate."""

from __future__ import annotations

import logging
import threading

import torch
from rich.console import Console

from tensorhub import Publisher, Replica, settings
from tensorhub.core import puller
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import (
    HolderStatus,
    ModelStatus,
    PullInFlight,
    StatusReply,
    StatusRequest,
    TransferRecord,
    VersionStatus,
)
from tensorhub.tools.live_view import render, watch
from tensorhub_testing.waits import wait_for

MiB = 1 << 20


def _status(address: str) -> StatusReply:
    client = CoordinatorClient(address)
    try:
        return client.call(StatusRequest())
    finally:
        client.close()


def _gated_pull(replica: Replica, block_at_read: int) -> tuple[threading.Thread, threading.Event]:
    """Start `replica.pull()` in a thread whose transport stops before its
    `block_at_read`-th read until the returned event is set."""
    read, calls, release = replica.session.transport.read, [], threading.Event()

    def gated(peer, ops, timeout):
        calls.append(peer)
        if len(calls) == block_at_read:
            release.wait(30)
        read(peer, ops, timeout)

    replica.session.transport.read = gated
    thread = threading.Thread(target=replica.pull, daemon=True)
    thread.start()
    return thread, release


def test_a_pull_in_flight_shows_in_status_with_the_bytes_landed(coordinator, monkeypatch):
    monkeypatch.setattr(puller, "BATCH_BYTES", MiB)  # a 4 MiB pull in four reads
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="slow-reader",
                    whole_items=True) as replica:
        pub.publish({"w": torch.arange(MiB, dtype=torch.float32)})
        thread, release = _gated_pull(replica, block_at_read=3)
        try:  # (a beat before the gate reports less: wait for the one after it)
            pulls = wait_for(lambda: [p for p in _status(coordinator.address).pulls
                                       if p.done == 2 * MiB])
        finally:
            release.set()
            thread.join(30)
        assert replica.version == 1
        [pull] = pulls
        assert (pull.reader, pull.model, pull.version) == ("slow-reader", "policy", 1)
        assert (pull.done, pull.total) == (2 * MiB, 4 * MiB)
        assert pull.seconds > 0
        wait_for(lambda: not _status(coordinator.address).pulls)  # gone once it ended


def test_a_long_pull_logs_its_progress(coordinator, monkeypatch, caplog):
    monkeypatch.setattr(puller, "BATCH_BYTES", MiB)
    monkeypatch.setattr(settings, "PROGRESS_LOG_SECONDS", 0.0)
    caplog.set_level(logging.INFO, logger="tensorhub.session")
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="slow-reader",
                    whole_items=True) as replica:
        pub.publish({"w": torch.arange(MiB, dtype=torch.float32)})
        thread, release = _gated_pull(replica, block_at_read=2)
        try:
            wait_for(lambda: "pulling policy v1: 25% (1.0 of 4.0 MiB)" in caplog.text)
        finally:
            release.set()
            thread.join(30)


def _reply() -> StatusReply:
    holder = HolderStatus(worker_id="w1", name="trainer", role="trainer", active_reads=2,
                          withdrawn=False)
    return StatusReply(
        workers=[{"worker_id": "w1", "name": "trainer", "role": "trainer"},
                 {"worker_id": "w2", "name": "engine-0", "role": "replica"},
                 {"worker_id": "w3", "name": "engine-1", "role": "replica"}],
        models=[ModelStatus(model="policy", latest=3, versions=[
            VersionStatus(version=3, layout_id="L", nbytes=100 * MiB, holders=[holder])])],
        reads_in_flight=2,
        transfers=[TransferRecord(reader="engine-1", source="trainer", model="policy",
                                  version=2, nbytes=100 * MiB, seconds=0.5, ok=True)],
        pulls=[PullInFlight(reader="engine-0", model="policy", version=3, done=50 * MiB,
                            total=100 * MiB, seconds=2.0)])


def test_the_view_draws_versions_holders_and_pulls_with_rate():
    console = Console(record=True, width=160, color_system=None)
    console.print(render(_reply(), "tcp://c:5555"))
    text = console.export_text()
    assert "coordinator tcp://c:5555: 2 replicas, 1 trainer" in text
    assert "v3 (latest)" in text and "trainer [2 reads]" in text
    assert "engine-0" in text and "50.0 MiB / 100.0 MiB" in text and "0.03 GB/s" in text
    assert "engine-1" in text and "0.21 GB/s" in text and "ok" in text


def test_watch_draws_a_live_fleet_and_says_when_the_coordinator_is_gone(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq", name="trainer") as pub:
        pub.publish({"w": torch.ones(4)})
        console = Console(record=True, width=160, color_system=None)
        watch(coordinator.address, interval=0.01, console=console, frames=1)
        assert "v1 (latest)" in console.export_text()
    gone = Console(record=True, width=160, color_system=None)
    watch("tcp://127.0.0.1:9", interval=0.01, timeout=0.5, console=gone, frames=1)
    assert "trying again" in gone.export_text()


def test_a_fleet_of_pulls_shows_the_least_advanced_first():
    pulls = [PullInFlight(reader=f"engine-{i:02d}", model="policy", version=3,
                          done=i * MiB, total=100 * MiB, seconds=1.0) for i in range(30)]
    console = Console(record=True, width=160, color_system=None)
    console.print(render(_reply().model_copy(update={"pulls": pulls}), "tcp://c:5555"))
    text = console.export_text()
    assert "the 20 least advanced of 30 pulls" in text
    assert "engine-19" in text and "engine-20" not in text
