"""vLLM and SGLang serving a small mixture of experts (Qwen3-MoE, 4 routed experts) at TP=2,
one rank on each of two emulated hosts, the TensorHub plugin on both: each follows versions with
greedy tokens equal to HF's; a version in tiles with its experts split as a dense MLP's is
pulled by each node as its rank's share of every expert, one model per version in all; a
version with its experts placed for expert-parallel engines is pulled whole by each node
(a tensor-parallel rank loads a slice of every expert) and served all the same."""

from __future__ import annotations

import pytest

from integration.test_sglang_nodes import confirmed, sglang_on_two_hosts
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


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def moe_engine(request, tmp_path_factory):
    """The engine on two hosts, with `serving(version)`: returns once it serves it (SGLang:
    confirmed by both ranks)."""
    root = tmp_path_factory.mktemp(f"{request.param}-moe-nodes")
    python = request.getfixturevalue(f"{request.param}_python")
    on_two_hosts = vllm_on_two_hosts if request.param == "vllm" else sglang_on_two_hosts
    with engine_on_two_hosts(root, on_two_hosts(python, root, 2), healthy_timeout=480,
                             shape=MOE_SHAPE) as fleet:
        fleet.serving = fleet.engine.wait_serving if request.param == "vllm" else \
            lambda version: confirmed(fleet, version)
        fleet.kind = request.param
        yield fleet


@pytest.mark.timeout(900)  # two engine processes start across hosts
def test_a_mixture_of_experts_across_two_hosts_follows_versions(moe_engine):
    engine = moe_engine.engine
    moe_engine.serving(1)
    assert engine.greedy(moe_engine.prompts, TOKENS) == moe_engine.expected[0]
    for version in range(2, VERSIONS + 1):
        moe_engine.publish(version)
        moe_engine.serving(version)
        assert engine.greedy(moe_engine.prompts, TOKENS) == moe_engine.expected[version - 1]


@pytest.mark.parametrize("experts", ["split", "placed"])
def test_each_node_pulls_what_its_rank_loads_of_the_experts(moe_engine, experts):
    """Split: each node pulls its tile (its half of the attention and of every expert) and
    the part every rank loads whole, the model once in all. Placed (whole experts, in the
    tile of the expert-parallel rank that would run them): each node pulls every part."""
    engine = moe_engine.engine
    status = engine.tensorhub_status()
    prefix = status["name"] if moe_engine.kind == "sglang" else \
        status["workers"][0].rsplit("-rank", 1)[0]
    state = moe_engine.versions.state(2)
    parts = [model_bytes(dict(p.tensors)) for p in tile(state.items(), 2, experts=experts)]
    version = moe_engine.publish_tiled(2, tiles=2, experts=experts)
    moe_engine.serving(version)
    assert engine.greedy(moe_engine.prompts, TOKENS) == moe_engine.expected[1]
    nbytes, readers = pulled(moe_engine.fleet.status(), version, prefix)
    print(f"{moe_engine.kind} TP=2 MoE on 2 hosts, 2 tiles, experts {experts}: v{version}: "
          f"{nbytes} B pulled by {sorted(readers)} "
          f"({nbytes / model_bytes(state):.2f} x the model)")
    if experts == "split":
        assert nbytes == parts[0] + parts[1] + 2 * parts[2]
    else:
        assert nbytes == 2 * model_bytes(state)
