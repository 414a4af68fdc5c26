"""Across emulated hosts (own network, PID and hostname each; shaped links), default settings:
real coordinator, trainer and replica processes, real NIXL over TCP between namespaces."""

from __future__ import annotations

import time

import pytest

from tensorhub_testing.cluster import Cluster, HostSpec, available
from tensorhub_testing.fleet import Fleet
from tensorhub_testing.waits import wait_for

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(available() is not None,
                                 reason=f"no emulated hosts here: {available()}")]


def _pulled(proc, timeout: float = 180.0, retries: int = 0) -> dict:
    """The replica's next pull; with `retries`, up to that many failed pulls before it (the
    replica process pulls again by itself) are tolerated."""
    for _ in range(retries + 1):
        event = proc.next_json(timeout)
        if event["event"] != "error" or event["code"] != "transfer_failed":
            break
    assert event["event"] == "pulled", event
    return event


def test_every_host_gets_the_version_bit_exact_with_default_settings(tmp_path):
    with Cluster(4, egress="400mbit") as cluster, \
            Fleet(cluster, log_dir=tmp_path) as fleet:
        h0, *readers = cluster.hosts
        replicas = [fleet.replica(h) for h in readers]
        trainer = fleet.trainer(h0, 64, wait_replicas=3)
        published = trainer.next_json(60)
        events = [_pulled(r) for r in replicas]
        assert trainer.next_json(120)["event"] == "held"
        for e in events:
            assert e["checksums"] == published["checksums"]
        # a tree, not a star: replicas on other hosts served some of it
        assert any(set(e["by_source"]) - {"trainer"} for e in events)
        model = published["nbytes"]
        assert h0.traffic().sent < 2.0 * model  # a star out of h0 would send 3 copies


def test_a_host_that_dies_mid_pull_leaves_the_others_bit_exact(tmp_path):
    with Cluster(5, egress="200mbit") as cluster, \
            Fleet(cluster, log_dir=tmp_path,
                  env={"TENSORHUB_STALL_TIMEOUT": "5"}) as fleet:
        h0, doomed, *others = cluster.hosts
        replicas = [fleet.replica(h) for h in (doomed, *others)]
        trainer = fleet.trainer(h0, 96)
        published = trainer.next_json(60)
        time.sleep(1.5)  # ~40% of one copy at 200 Mbit/s: everyone is mid-pull
        doomed.set_link(False)  # falls silent, as a host losing power does...
        doomed.kill()  # ...and every process on it is gone
        for r in replicas[1:]:  # (a survivor whose reads failed too often pulls again)
            assert _pulled(r, retries=1)["checksums"] == published["checksums"]


def test_a_reader_sent_to_a_holder_that_just_fell_silent_reads_from_another(tmp_path):
    """The coordinator still lists a holder whose host fell silent a moment ago, so a reader
    is planned onto it: its connect to that holder returns at once (UCX_TCP_CONN_NB), the
    read makes no progress and is given up after the stall timeout, and the version comes
    from the trainer, well inside a pull timeout shorter than a blocking connect's ~2 min."""
    with Cluster(3, egress="800mbit") as cluster, \
            Fleet(cluster, log_dir=tmp_path, env={"TENSORHUB_STALL_TIMEOUT": "5"}) as fleet:
        h0, h1, h2 = cluster.hosts
        holder = fleet.replica(h1)
        trainer = fleet.trainer(h0, 32)
        published = trainer.next_json(60)
        assert _pulled(holder)["checksums"] == published["checksums"]
        reader = fleet.replica(h2, on_demand=True, pull_timeout=60)
        wait_for(lambda: any(w["name"] == "h2" for w in fleet.status()["workers"]),
                 timeout=60, what="the reader registered")
        h1.set_link(False)  # silent: SYNs to it go unanswered...
        h1.kill()  # ...and its processes are gone, heartbeats with them
        reader.send_line(str(published["version"]))  # (before the coordinator expires h1)
        event = _pulled(reader)
        assert event["checksums"] == published["checksums"]
        assert set(event["by_source"]) == {"trainer"}, event["by_source"]


def test_a_reader_that_cannot_reach_other_hosts_takes_no_version_away(tmp_path):
    with Cluster(4, egress="800mbit") as cluster, \
            Fleet(cluster, log_dir=tmp_path) as fleet:
        h0, h1, h2, h3 = cluster.hosts
        trainer = fleet.trainer(h0, 32)
        published = trainer.next_json(60)
        # a replica whose UCX may use loopback only, on a host with a network
        broken = fleet.replica(h1, env={"UCX_NET_DEVICES": "lo"})
        event = broken.next_json(120)
        assert event["event"] == "error" and event["code"] == "unreachable", event
        assert "transport is the likely fault" in event["message"]
        for h in (h2, h3):
            assert _pulled(fleet.replica(h))["checksums"] == published["checksums"]
        holders = {h["name"] for v in fleet.status()["models"][0]["versions"]
                   for h in v["holders"]}
        assert {"trainer", "h2", "h3"} <= holders


def test_the_zmq_fallback_serves_across_hosts(tmp_path):
    with Cluster(3, egress="800mbit") as cluster, \
            Fleet(cluster, log_dir=tmp_path,
                  env={"TENSORHUB_TRANSPORT": "zmq"}) as fleet:
        h0, h1, h2 = cluster.hosts
        trainer = fleet.trainer(h0, 32)
        published = trainer.next_json(60)
        for h in (h1, h2):
            assert _pulled(fleet.replica(h))["checksums"] == published["checksums"]


def test_about_one_copy_crosses_the_wan_per_version(tmp_path):
    specs = [HostSpec("a0", dc=0), *(HostSpec(f"b{i}", dc=1) for i in range(3))]
    with Cluster(specs, egress="2gbit", wan="200mbit") as cluster, \
            Fleet(cluster, log_dir=tmp_path) as fleet:
        a0, *far = cluster.hosts
        replicas = [fleet.replica(h) for h in far]
        trainer = fleet.trainer(a0, 64, wait_replicas=3)
        published = trainer.next_json(60)
        before = cluster.wan_traffic(1)
        for r in replicas:
            assert _pulled(r)["checksums"] == published["checksums"]
        crossed = (cluster.wan_traffic(1) - before).received
        # every reader crossing the WAN would be 3 copies; the far side seeds itself
        assert crossed < 1.5 * published["nbytes"], crossed / published["nbytes"]


def test_a_sparse_step_crosses_the_wan_once_as_a_patch_and_lands_bit_exact(tmp_path):
    specs = [HostSpec("a0", dc=0), *(HostSpec(f"b{i}", dc=1) for i in range(3))]
    with Cluster(specs, egress="2gbit", wan="200mbit") as cluster, \
            Fleet(cluster, log_dir=tmp_path) as fleet:
        a0, *far = cluster.hosts
        replicas = [fleet.replica(h, versions=2) for h in far]
        trainer = fleet.trainer(a0, 32, versions=2, wait_replicas=3,
                                extra=("--dtype", "bfloat16", "--density", "0.01"))
        first = trainer.next_json(60)
        for r in replicas:
            assert _pulled(r)["checksums"] == first["checksums"]
        assert trainer.next_json(120)["event"] == "held"
        before = cluster.wan_traffic(1)
        second = trainer.next_json(60)
        events = [_pulled(r) for r in replicas]
        crossed = (cluster.wan_traffic(1) - before).received
        assert all(e["checksums"] == second["checksums"] for e in events)
        assert all(e["patches"] == [second["version"]] for e in events)
        patch = second["patch"]["nbytes"]
        assert patch < 0.02 * second["nbytes"]
        # one copy of the patch crosses, and the coordinator's messages; two would not fit
        assert crossed < 1.5 * patch + (64 << 10), (crossed, patch)


def test_readers_that_pull_on_demand_one_after_another_take_one_copy_from_the_trainer(
        tmp_path):
    with Cluster(4, egress="800mbit") as cluster, \
            Fleet(cluster, log_dir=tmp_path) as fleet:
        h0, *hosts = cluster.hosts
        readers = [fleet.replica(h, on_demand=True) for h in hosts]
        trainer = fleet.trainer(h0, 64)
        published = trainer.next_json(60)
        sent = h0.traffic().sent
        for r in readers:  # each told once the one before holds it (`pull(version=1)`)
            r.send_line(str(published["version"]))
            assert _pulled(r)["checksums"] == published["checksums"]
        # the later ones read from those that hold it; the trainer again would be 3 copies
        assert h0.traffic().sent - sent < 1.5 * published["nbytes"]


def test_a_pull_in_flight_survives_a_coordinator_kill_and_restart(tmp_path):
    with Cluster(3, egress="200mbit") as cluster, Fleet(cluster, log_dir=tmp_path) as fleet:
        _, h1, h2 = cluster.hosts  # the coordinator's host, the trainer's, the reader's
        replica = fleet.replica(h2, pull_timeout=180)
        trainer = fleet.trainer(h1, 64)  # 8 chunks, ~2.8 s at 200 Mbit/s
        published = trainer.next_json(60)
        time.sleep(0.8)  # a few chunks in
        fleet.restart_coordinator()  # kill -9, then a new one at the same address
        event = _pulled(replica)
        assert event["checksums"] == published["checksums"]
