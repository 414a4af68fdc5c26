"""The Ray example (`examples/ray_rl_loop.py`) on a two-node Ray cluster across emulated
hosts: the trainer actor on one node, a `vllm serve` engine actor on the other, the
coordinator a named detached actor both find by name. Every version reaches the engine
across the network, the reward climbs, and the engine answers as HF transformers does on the
trainer's final float32 weights."""

from __future__ import annotations

import re
import sys

import pytest
from safetensors.torch import load_file

from integration.tiny_model import hf_greedy
from tensorhub_testing.cluster import Cluster, available

ray = pytest.importorskip("ray", reason="ray is in requirements/core.txt; this venv lacks it")
pytestmark = pytest.mark.skipif(available() is not None,
                                reason=f"no emulated hosts here: {available()}")
VERSIONS = 3


def _events(driver, timeout: float) -> list[dict]:
    events = []
    while not events or events[-1]["event"] != "done":
        events.append(driver.next_json(timeout))
    return events


def test_an_rl_loop_on_two_ray_nodes_serves_every_version_as_hf_does(tmp_path, vllm_python):
    from tensorhub_testing.ray_cluster import RayCluster

    out = tmp_path / "run"
    with Cluster(2, egress="1gbit") as cluster, \
            RayCluster(cluster, [{"trainer_host": 1}, {"engine_host": 1}],
                       tmp_path / "ray") as ray_cluster:
        h0, h1 = cluster.hosts
        driver = ray_cluster.driver(
            [sys.executable, "-m", "examples.ray_rl_loop", "--address", ray_cluster.address,
             "--engines", "1", "--versions", str(VERSIONS), "--out", str(out),
             "--vllm-python", vllm_python], log_path=tmp_path / "driver.log")
        try:
            events = _events(driver, timeout=600)
            assert driver.wait(120) == 0
        finally:
            driver.stop()
    coordinator, started, *versions, done = events
    assert coordinator["address"].startswith(f"tcp://{h0.address}:")  # on the trainer's node
    assert started["trainer_node"] == h0.address
    assert started["engine_nodes"] == [h1.address]
    [engine] = started["engines"]
    assert [v["version"] for v in versions] == list(range(1, VERSIONS + 1))
    rewards = [v["reward"][engine] for v in versions]
    assert rewards[-1] > rewards[0], rewards  # the engine's answers moved toward the target
    # the engine pulled each new version from the trainer, across the network
    log = (out / "vllm-0.log").read_text()
    for version in range(2, VERSIONS + 1):
        assert re.search(rf"pulled policy v{version} from trainer", log), log[-3000:]
    # HF transformers on the trainer's final weights answers as the engine does
    final = load_file(str(out / "final.safetensors"))
    want = hf_greedy(out / "model", done["probes"], 12, state_dict=final, skip_ties=True)
    before = hf_greedy(out / "model", done["probes"], 12, skip_ties=True)
    compared = [k for k, w in enumerate(want) if w is not None]
    assert len(compared) >= 4, "too many near-ties among the probe prompts"
    assert [done["answers"][engine][k] for k in compared] == [want[k] for k in compared]
    assert any(before[k] != want[k] for k in compared), "training must change the answers"
