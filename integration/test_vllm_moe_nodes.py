"""vLLM serving a small mixture of experts (Qwen3-MoE, 4 routed experts) at TP=2, one rank
on each of two emulated hosts, the TensorHub plugin on both: it follows versions with
greedy tokens equal to HF's; a version in tiles with its experts split as a dense MLP's is
pulled by each node as its rank's share of every expert, one model per version in all; a
version with its experts placed for expert-parallel engines is pulled whole by each node
(a tensor-parallel rank loads a slice of every expert) and served all the same."""

from __future__ import annotations

import pytest

from integration.test_vllm_nodes import vllm_on_two_hosts
from integration.tp_fleet import TOKENS
from integration.two_hosts import VERSIONS, engine_on_two_hosts, model_bytes, pulled
from tensorhub.tiles import tile
from tensorhub_testing.cluster import available

pytestmark = pytest.mark.skipif(available() is not None,
                                reason=f"no emulated hosts here: {available()}")
# (an expert's intermediate size split over 2 ranks stays a multiple of the 32 vLLM's CPU
# MoE kernel pads to)
MOE_SHAPE = {"arch": "qwen3_moe", "hidden": 128, "heads": 4, "kv_heads": 2, "layers": 2,
             "intermediate": 64, "experts": 4}


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory, vllm_python):
    root = tmp_path_factory.mktemp("vllm-moe-nodes")
    with engine_on_two_hosts(root, vllm_on_two_hosts(vllm_python, root, 2),
                             healthy_timeout=480, shape=MOE_SHAPE) as fleet:
        yield fleet


@pytest.mark.timeout(900)  # two engine processes start across hosts
def test_a_mixture_of_experts_across_two_hosts_follows_versions(moe_engine):
    engine = moe_engine.engine
    engine.wait_serving(1)
    assert engine.greedy(moe_engine.prompts, TOKENS) == moe_engine.expected[0]
    for version in range(2, VERSIONS + 1):
        moe_engine.publish(version)
        engine.wait_serving(version)
        assert engine.greedy(moe_engine.prompts, TOKENS) == moe_engine.expected[version - 1]


@pytest.mark.parametrize("experts", ["split", "placed"])
def test_each_node_pulls_what_its_rank_loads_of_the_experts(moe_engine, experts):
    """Split: each node pulls its tile (its half of the attention and of every expert) and
    the part every rank loads whole, the model once in all. Placed (whole experts, in the
    tile of the expert-parallel rank that would run them): each node pulls every part."""
    engine = moe_engine.engine
    prefix = engine.tensorhub_status()["workers"][0].rsplit("-rank", 1)[0]
    state = moe_engine.versions.state(2)
    parts = [model_bytes(dict(p.tensors)) for p in tile(state.items(), 2, experts=experts)]
    version = moe_engine.publish_tiled(2, tiles=2, experts=experts)
    engine.wait_serving(version)
    assert engine.greedy(moe_engine.prompts, TOKENS) == moe_engine.expected[1]
    nbytes, readers = pulled(moe_engine.fleet.status(), version, prefix)
    print(f"vLLM TP=2 MoE on 2 hosts, 2 tiles, experts {experts}: v{version}: {nbytes} B "
          f"pulled by {sorted(readers)} ({nbytes / model_bytes(state):.2f} x the model)")
    if experts == "split":
        assert nbytes == parts[0] + parts[1] + 2 * parts[2]
    else:
        assert nbytes == 2 * model_bytes(state)
