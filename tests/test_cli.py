"""The command line: the demo runs end to end, status shows what the coordinator knows."""

import json
import subprocess
import sys

import pytest
import torch

from tensorhub import Publisher, Replica
from tensorhub.tools.child_process import ChildProcess

pytestmark = pytest.mark.slow  # (processes per test, or waits on timeouts: not in the fast loop)


def _tensorhub(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tensorhub.tools.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_demo_shows_versions_sources_and_rates_and_a_replica_feeding_another():
    out = _tensorhub("--log-level", "WARNING", "demo", "--size-mb", "16", "--versions", "2",
                     "--replicas", "2", "--port", "5755")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for v in (1, 2):
        assert f"version {v}: published" in text
        assert text.count(f" v{v} <- ") == 2
    assert "GB/s" in text
    assert "replica-0 -> replica-1" in text or "replica-1 -> replica-0" in text


def test_status_lists_models_versions_holders_and_pulls(coordinator):
    with Publisher(coordinator.address, "policy", transport="zmq") as pub, \
            Replica(coordinator.address, "policy", transport="zmq", name="r") as rep:
        pub.publish({"w": torch.ones(8)})
        rep.pull(timeout=10)
        out = _tensorhub("status", "--coordinator", coordinator.address)
        assert out.returncode == 0, out.stderr
        assert "model policy: latest v1" in out.stdout
        assert "trainer" in out.stdout and "r[0 reads]" in out.stdout
        assert "r <- trainer: policy v1" in out.stdout
        as_json = json.loads(_tensorhub("status", "--coordinator", coordinator.address,
                                        "--json").stdout)
        assert as_json["models"][0]["latest"] == 1


def test_status_without_a_coordinator_says_so_instead_of_hanging():
    out = _tensorhub("status", "--coordinator", "tcp://127.0.0.1:5799", "--timeout", "1",
                     timeout=30)
    assert out.returncode == 2
    assert "no reply from the coordinator at tcp://127.0.0.1:5799" in out.stderr


def test_help_explains_each_command():
    out = _tensorhub("--help")
    for cmd in ("coordinator", "status", "replica", "demo"):
        assert cmd in out.stdout
    assert "TENSORHUB_TOKEN" in _tensorhub("coordinator", "--help").stdout


def test_a_coordinator_process_stops_cleanly_on_sigterm():
    proc = ChildProcess.tensorhub("coordinator", "--bind", "tcp://127.0.0.1:5798")
    assert "requests on tcp://127.0.0.1:5798" in proc.next_line(timeout=30)
    assert proc.stop(timeout=10) == 0


def test_a_coordinator_refuses_a_busy_retry_that_is_not_positive():
    out = _tensorhub("coordinator", "--busy-retry", "0", timeout=30)
    assert out.returncode == 2
    assert "--busy-retry: must be a positive number" in out.stderr
