"""The closed-form baselines the simulated fleets are compared with (`sim/sweep.py`)."""

from __future__ import annotations

import math

from tensorhub.sim.fleet import SimConfig
from tensorhub.sim.sweep import optimum_time, ring_time, star_time

SMALL = dict(model_bytes=64 << 20, tensor_bytes=16 << 20, chunk_bytes=4 << 20)


def test_baselines_grow_with_the_fleet_as_their_formulas_say():
    small, big = SimConfig(workers=8, **SMALL), SimConfig(workers=64, **SMALL)
    assert star_time(big) / star_time(small) > 7.5
    assert ring_time(big) > ring_time(small) > small.lower_bound


def test_the_optimum_adds_log2_chunk_times():
    chunk = 4 << 20
    one, seven = SimConfig(workers=1, **SMALL), SimConfig(workers=7, **SMALL)
    chunk_time = chunk * 8 / (one.nic_gbps * 1e9)
    assert math.isclose(optimum_time(one), one.lower_bound)
    assert math.isclose(optimum_time(seven) - seven.lower_bound, 2 * chunk_time)
