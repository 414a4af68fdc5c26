"""The striped simulator: real coordinator handlers in a queue, the reader session `Replica`
runs, simulated links. Structural checks only (its figures are in bench/)."""

from __future__ import annotations

from tensorhub.sim.config import SimConfig
from tensorhub.sim.swarm import simulate_swarm

SMALL = SimConfig(workers=32, model_bytes=1 << 30, tensor_bytes=64 << 20, chunk_bytes=32 << 20)


def test_a_cold_first_version_costs_each_reader_a_plan_a_hold_and_a_read_done():
    result = simulate_swarm(SMALL)
    assert sorted(result.finished) == sorted(f"w{i}" for i in range(32))
    assert result.reader_messages["hold"] == result.reader_messages["read_done"] == 32
    assert result.reader_messages["striped_plan"] >= 32
    assert result.reader_messages["replan_stripes"] > 0  # a leaf's pending stripe asks again
    assert result.standby_seconds == 0.0


def test_readers_on_standby_send_only_a_confirmation_for_the_first_version():
    result = simulate_swarm(SimConfig(**{**SMALL.__dict__, "standby": True}))
    assert len(result.finished) == 32 and not result.unfinished
    assert result.reader_messages == {"confirm_parents": 32, "hold": 32, "read_done": 32}
    assert result.replans == 0
    assert result.standby_seconds > 0 and result.standby_busy > 0  # placed before, apart
    assert all(t > 0 for t in result.finished.values())  # timed from the publish


def test_the_next_version_from_the_same_parents_needs_only_confirmations():
    result = simulate_swarm(SimConfig(**{**SMALL.__dict__, "version": 2}))
    assert len(result.finished) == 32
    assert result.reader_messages == {"confirm_parents": 32, "hold": 32, "read_done": 32}


def test_a_reader_killed_on_standby_mid_pull_leaves_the_others_to_finish():
    config = SimConfig(**{**SMALL.__dict__, "standby": True, "kill": (0, 5), "kill_at": 0.3})
    result = simulate_swarm(config)
    assert sorted(result.killed) == ["w0", "w5"]
    assert not result.unfinished and len(result.finished) == 30


def test_readers_told_one_by_one_after_the_last_one_finished_get_one_trainer_copy():
    config = SimConfig(**{**SMALL.__dict__, "workers": 4, "spread": 1.0})  # 12x the bound
    result = simulate_swarm(config)
    assert sorted(result.finished) == ["w0", "w1", "w2", "w3"]
    assert result.trainer_copies == 1.0  # the later ones read from those that hold it


def test_a_reader_that_reaches_no_one_asking_first_costs_no_second_trainer_copy():
    result = simulate_swarm(SimConfig(**{**SMALL.__dict__, "workers": 8,
                                         "failing_first": True}))
    assert sorted(result.finished) == sorted(f"w{i}" for i in range(8))
    assert result.trainer_copies == 1.0
