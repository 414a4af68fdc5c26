"""Prometheus metrics of a real `tensorhub coordinator` process (`--metrics-port`): after a
publish and two pulls, the named series are there with the values the fleet has."""

from __future__ import annotations

import sys
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tensorhub import Publisher, Replica
from tensorhub.core.net import free_port
from tensorhub.tools.child_process import ChildProcess


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def coordinator_with_metrics():
    port, metrics = free_port(), free_port()
    proc = ChildProcess([sys.executable, "-m", "tensorhub.tools.cli", "coordinator", "--bind",
                         f"tcp://127.0.0.1:{port}", "--announce",
                         f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(metrics),
                         "--metrics-addr", "127.0.0.1"], name="coordinator")
    try:
        proc.next_line(timeout=60)  # requests on ...
        assert "metrics: http://127.0.0.1" in proc.next_line(timeout=30)
        yield f"tcp://127.0.0.1:{port}", metrics
    finally:
        proc.stop()


def test_a_coordinator_counts_versions_holders_plans_and_bytes(coordinator_with_metrics):
    address, port = coordinator_with_metrics
    state = {"w": torch.arange(1 << 18, dtype=torch.float32), "b": torch.ones(16)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with Publisher(address, "policy", transport="zmq") as pub:
        assert pub.publish(state) == 1
        readers = [Replica(address, "policy", name=f"r{i}", transport="zmq") for i in range(2)]
        try:
            for r in readers:
                assert r.pull(1, timeout=60) == 1
            deadline = time.monotonic() + 10
            while (got := scrape(port)).get(
                    ("tensorhub_version_holders", (("model", "policy"), ("version", "1")))) != 3:
                assert time.monotonic() < deadline, got
                time.sleep(0.1)  # (the fleet's shape is measured on the expiry walk)
        finally:
            for r in readers:
                r.close()
    assert got[("tensorhub_versions_published_total", (("model", "policy"),))] == 1
    assert got[("tensorhub_latest_version", (("model", "policy"),))] == 1
    assert got[("tensorhub_workers", (("role", "replica"),))] == 2
    assert got[("tensorhub_workers", (("role", "trainer"),))] == 1
    assert got[("tensorhub_plans_total", (("model", "policy"),))] >= 2
    assert got[("tensorhub_plan_latency_seconds_count", ())] >= 2
    served = sum(v for (name, labels), v in got.items()
                 if name == "tensorhub_bytes_served_total")
    assert served == 2 * nbytes  # each reader pulled the version once, whoever from
    assert ("tensorhub_bytes_served_total", (("path", "same_node"), ("source", "trainer"))) \
        in got  # (all on this host: every read is same-node)
    assert got[("tensorhub_reads_in_flight", ())] == 0


def test_a_worker_that_leaves_is_counted_as_an_eviction(coordinator_with_metrics):
    address, port = coordinator_with_metrics
    Replica(address, "policy", name="brief", transport="zmq").close()
    assert scrape(port)[("tensorhub_evictions_total", (("reason", "unregistered"),))] == 1


def test_the_grafana_dashboard_queries_only_series_we_export():
    """Every `tensorhub_...` name in `deploy/grafana/tensorhub.json` is a series of the
    coordinator's registry or of a worker's (a renamed metric would leave a blank panel)."""
    import json
    import re
    from pathlib import Path

    from prometheus_client import REGISTRY

    import tensorhub.metrics  # noqa: F401 - registers the worker series
    from tensorhub.coordinator.metrics import CoordinatorMetrics

    exported = set()
    for registry in (CoordinatorMetrics().registry, REGISTRY):
        for family in registry.collect():
            exported.update(s.name for s in family.samples)
            exported.update(f"{family.name}{suffix}" for suffix in ("", "_total", "_bucket"))
    dashboard = json.loads((Path(__file__).parent.parent / "deploy" / "grafana" /
                            "tensorhub.json").read_text())
    queried = {name for p in dashboard["panels"] for t in p["targets"]
               for name in re.findall(r"tensorhub_[a-z_]+", t["expr"])}
    assert queried and queried <= exported, queried - exported
