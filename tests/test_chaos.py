"""A bounded chaos run: replicas and the coordinator SIGKILLed while versions are published.

CI runs 30 versions (about a minute); `TENSORHUB_CHAOS_VERSIONS=300` (or
`python -m tensorhub_testing.chaos --versions 300`) runs a longer one.
"""

from __future__ import annotations

import os

import pytest

from tensorhub_testing.chaos import ChaosConfig, run_chaos

pytestmark = pytest.mark.slow  # (processes per test, or waits on timeouts: not in the fast loop)


def test_after_random_kills_every_replica_is_bit_exact_on_the_newest_and_none_read_torn():
    versions = int(os.environ.get("TENSORHUB_CHAOS_VERSIONS", "30"))
    report = run_chaos(ChaosConfig(versions=versions, replicas=4, seed=1))
    assert report.replica_kills > 0 and report.coordinator_restarts > 0  # chaos happened
    assert report.torn_reads == []
    newest = report.versions_published[-1]
    assert report.final == {f"r{i}": newest for i in range(4)}, report
    assert report.versions_published == sorted(set(report.versions_published))  # never back
