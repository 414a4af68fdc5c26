"""The fleet simulator drives the real coordinator to completion, and survives a death."""

from __future__ import annotations

import math

from tensorhub.coordinator.planner import PlannerConfig
from tensorhub.sim.fleet import SimConfig, simulate
from tensorhub.sim.sweep import optimum_time, ring_time, star_time

SMALL = dict(model_bytes=64 << 20, tensor_bytes=16 << 20, chunk_bytes=4 << 20)


def test_every_worker_completes_near_the_lower_bound_and_beats_the_star():
    config = SimConfig(workers=12, **SMALL)
    result = simulate(config)
    assert sorted(result.finished) == sorted(f"w{i}" for i in range(12))
    assert result.unfinished == [] and result.killed == []
    assert math.isfinite(result.ratio) and 1.0 <= result.ratio < 3.0
    assert result.worst < star_time(config) and result.plans >= 12


def test_the_wire_path_and_several_datacenters_complete_too():
    result = simulate(SimConfig(workers=6, dcs=2, wire=True, **SMALL))
    assert len(result.finished) == 6 and math.isfinite(result.ratio)


def test_a_worker_killed_mid_pull_does_not_stop_the_others():
    config = SimConfig(workers=10, kill=(0, 3), kill_at=0.3, **SMALL)
    result = simulate(config)
    assert result.killed == ["w0", "w3"]
    assert sorted(result.finished) == sorted(f"w{i}" for i in (1, 2, 4, 5, 6, 7, 8, 9))
    assert result.unfinished == []


def test_baselines_grow_with_the_fleet_as_their_formulas_say():
    small, big = SimConfig(workers=8, **SMALL), SimConfig(workers=64, **SMALL)
    assert star_time(big) / star_time(small) > 7.5
    assert ring_time(big) > ring_time(small) > small.lower_bound
    assert PlannerConfig().max_streams_per_remote_dc == 1


def test_holders_multiply_and_stay_busy_so_the_fleet_ends_near_the_lower_bound():
    # 64 chunks, 32 readers: the earlier chunk-first planner (a whole plan per lease, two
    # sources) finished at 1.56x here; idle holders first + one lease per stream: ~1.31x
    config = SimConfig(workers=32, model_bytes=256 << 20, tensor_bytes=32 << 20,
                       chunk_bytes=4 << 20)
    result = simulate(config)
    assert result.unfinished == [] and len(result.finished) == 32
    assert result.ratio < 1.4 and result.median_ratio < 1.35


def test_the_optimum_adds_log2_chunk_times_and_no_simulated_fleet_beats_it():
    chunk = 4 << 20
    one, seven = SimConfig(workers=1, **SMALL), SimConfig(workers=7, **SMALL)
    chunk_time = chunk * 8 / (one.nic_gbps * 1e9)
    assert math.isclose(optimum_time(one), one.lower_bound)
    assert math.isclose(optimum_time(seven) - seven.lower_bound, 2 * chunk_time)
    assert simulate(seven).worst >= optimum_time(seven)
