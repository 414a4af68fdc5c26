"""vLLM with pipeline parallelism 2, one stage on each of two emulated hosts, started as
vLLM documents multi-node serving (`--pipeline-parallel-size 2 --nnodes 2 --node-rank R
--master-addr`, the `mp` executor, `--headless` on node 1), the TensorHub plugin on both:
it joins late at v1 and follows v2 and v3 with greedy tokens equal to HF's, a version its
model cannot load is refused by both stages before either touches its weights, and a
version in layer blocks is pulled by each stage as its own layers: one model per version,
not one per stage.

(vLLM's CPU build runs pipeline stages only with its warm-up, so this engine runs without
`--enforce-eager`: it compiles at start.)"""

from __future__ import annotations

import pytest

from integration.test_vllm_nodes import vllm_on_two_hosts
from integration.tp_fleet import TOKENS
from integration.two_hosts import (
    VERSIONS,
    a_copy_per_node_pulled,
    engine_on_two_hosts,
    model_bytes,
    pulled,
    wrong_shape_refused,
)
from tensorhub_testing.cluster import available

pytestmark = pytest.mark.skipif(available() is not None,
                                reason=f"no emulated hosts here: {available()}")
# (a model deep enough that each stage holds decoder layers of its own)
PP_SHAPE = {"hidden": 128, "heads": 4, "kv_heads": 2, "layers": 4}


@pytest.fixture(scope="module")
def pp_engine(tmp_path_factory, vllm_python):
    root = tmp_path_factory.mktemp("vllm-pp")
    with engine_on_two_hosts(root, vllm_on_two_hosts(vllm_python, root, tp=1, pp=2),
                             healthy_timeout=600, shape=PP_SHAPE) as fleet:
        yield fleet


@pytest.mark.timeout(1200)  # two engine processes start across hosts, and compile
def test_a_pipeline_parallel_engine_across_two_hosts_joins_late_and_follows_versions(
        pp_engine):
    engine = pp_engine.engine
    engine.wait_serving(1)
    assert engine.greedy(pp_engine.prompts, TOKENS) == pp_engine.expected[0]
    for version in range(2, VERSIONS + 1):
        pp_engine.publish(version)
        engine.wait_serving(version)
        assert engine.greedy(pp_engine.prompts, TOKENS) == pp_engine.expected[version - 1]


def test_a_version_published_whole_is_pulled_whole_by_each_stage(pp_engine):
    a_copy_per_node_pulled(pp_engine, "vLLM PP=2")


def test_a_version_the_model_cannot_load_is_refused_by_both_stages(pp_engine):
    wrong_shape_refused(pp_engine)


def test_a_version_in_layer_blocks_is_pulled_by_each_stage_as_its_layers(pp_engine):
    """The trainer publishes versions in layer blocks (`tensorhub/stages.py`): in two, then
    at the engines' stage edges (one layer each here); stage 0 pulls the embeddings and
    layers 0-1, stage 1 layers 2-3 and the head, the model's bytes once in all, and the
    engine serves each with HF's tokens."""
    engine = pp_engine.engine
    prefix = engine.tensorhub_status()["workers"][0].rsplit("-rank", 1)[0]
    for state_of, blocks in ((2, 2), (3, None)):
        state = pp_engine.versions.state(state_of)
        version = pp_engine.publish_tiled(state_of, blocks, kind="blocks")
        engine.wait_serving(version)
        assert engine.greedy(pp_engine.prompts, TOKENS) == pp_engine.expected[state_of - 1]
        nbytes, readers = pulled(pp_engine.fleet.status(), version, prefix)
        print(f"vLLM PP=2 on 2 hosts, layer blocks ({blocks or 'at the stage edges'}): "
              f"v{version}: {nbytes} B pulled by "
              f"{sorted(readers)} ({nbytes / model_bytes(state):.2f} x the model)")
        assert nbytes == model_bytes(state), (nbytes, model_bytes(state))
        # (each stage's copy: a worker per part it pulls, its blocks and its end)
        assert len(readers) == (4 if blocks else 6), readers
