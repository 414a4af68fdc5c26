"""Real processes, real transports: a trainer and three replica processes, three versions."""

from __future__ import annotations

import pytest
import torch

from tensorhub import Publisher
from tensorhub.core.checksum import checksum
from tensorhub.tools.child_process import ChildProcess
from tensorhub.tools.synthetic_weights import synthetic_state_dict

pytestmark = pytest.mark.slow  # (processes per test, or waits on timeouts: not in the fast loop)


def _replica(address: str, name: str, transport: str, versions: int) -> ChildProcess:
    return ChildProcess.tensorhub(
        "--log-level", "WARNING", "replica", "--coordinator", address, "--name", name,
        "--transport", transport, "--json", "--checksums", "--versions", str(versions),
        "--linger", "--timeout", "180", name=name)


def test_three_replica_processes_follow_three_versions_bit_exact_and_feed_each_other(
        coordinator, transport):
    state = synthetic_state_dict(64, n_tiny=500, seed=7)
    replicas = [_replica(coordinator.address, f"r{i}", transport, 3) for i in range(3)]
    try:
        with Publisher(coordinator.address, "policy", transport=transport) as pub:
            for v in (1, 2, 3):
                if v > 1:
                    with torch.no_grad():
                        for t in state.values():
                            t.mul_(1.5).add_(0.25)
                assert pub.publish(state) == v
                expected = {name: checksum(t) for name, t in state.items()}
                for r in replicas:
                    event = r.next_json(timeout=120)
                    assert event["event"] == "pulled", event
                    assert event["version"] == v
                    assert event["checksums"] == expected, f"{r.name} differs at v{v}"
            pulls = [t for t in coordinator.table.transfers if t.ok and t.nbytes > 0]
            # every replica read every version (a pull may be a few chunk plans, one record
            # each)
            assert {(t.reader, t.version) for t in pulls} == \
                {(f"r{i}", v) for i in range(3) for v in (1, 2, 3)}
            from_replicas = [t for t in pulls if t.source.startswith("r")]
            assert from_replicas, "every replica pulled from the trainer: a star, not a tree"
            assert {t.source for t in pulls} - {"trainer", "r0", "r1", "r2"} == set()
    finally:
        for r in replicas:
            assert r.stop() is not None
