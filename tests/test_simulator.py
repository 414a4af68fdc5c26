"""The simulator drives the real coordinator to completion, survives a death, and no
simulated fleet beats the optimum its baselines are measured against."""

from __future__ import annotations

import math

from tensorhub.sim.config import SimConfig
from tensorhub.sim.swarm import simulate_swarm
from tensorhub.sim.sweep import optimum_time, ring_time, star_time

SMALL = dict(model_bytes=64 << 20, tensor_bytes=16 << 20, chunk_bytes=4 << 20)


def test_every_worker_completes_and_none_beats_the_lower_bound():
    # (how near it comes depends on the coordinator's handlers timed on this machine:
    # the figures are bench/'s)
    result = simulate_swarm(SimConfig(workers=12, **SMALL))
    assert sorted(result.finished) == sorted(f"w{i}" for i in range(12))
    assert result.unfinished == [] and result.killed == []
    assert math.isfinite(result.ratio) and result.ratio >= 1.0
    assert result.reader_messages["striped_plan"] >= 12


def test_several_datacenters_complete_too():
    result = simulate_swarm(SimConfig(workers=6, dcs=2, **SMALL))
    assert len(result.finished) == 6 and math.isfinite(result.ratio)


def test_a_worker_killed_mid_pull_does_not_stop_the_others():
    config = SimConfig(workers=10, kill=(0, 3), kill_at=0.3, **SMALL)
    result = simulate_swarm(config)
    assert result.killed == ["w0", "w3"]
    assert sorted(result.finished) == sorted(f"w{i}" for i in (1, 2, 4, 5, 6, 7, 8, 9))
    assert result.unfinished == []


def test_baselines_grow_with_the_fleet_as_their_formulas_say():
    small, big = SimConfig(workers=8, **SMALL), SimConfig(workers=64, **SMALL)
    assert star_time(big) / star_time(small) > 7.5
    assert ring_time(big) > ring_time(small) > small.lower_bound


def test_the_optimum_adds_log2_chunk_times_and_no_simulated_fleet_beats_it():
    chunk = 4 << 20
    one, seven = SimConfig(workers=1, **SMALL), SimConfig(workers=7, **SMALL)
    chunk_time = chunk * 8 / (one.nic_gbps * 1e9)
    assert math.isclose(optimum_time(one), one.lower_bound)
    assert math.isclose(optimum_time(seven) - seven.lower_bound, 2 * chunk_time)
    assert simulate_swarm(seven).worst >= optimum_time(seven)
