"""vLLM at TP=2 on a model of one K/V head, one rank on each of two emulated hosts, the
TensorHub plugin on both. Both ranks load that head's K/V rows, which lie in both tiles
of a version in tiles, so each node pulls both tiles (the model twice per version);
published with its K/V by head in a part of its own (`TiledPublisher(kv_heads=)`) each
node pulls its own tile, the part every rank loads whole and the K/V part, and serves it
with HF's tokens. (SGLang's CPU build pads a model's K/V heads up to its TP size,
`adjust_config_with_unaligned_cpu_tp`, so its ranks do not load by TP rank there and its
copy pulls every part, as the plugin logs.)"""

from __future__ import annotations

import pytest

from integration.test_vllm_nodes import vllm_on_two_hosts
from integration.tp_fleet import TOKENS
from integration.two_hosts import engine_on_two_hosts, model_bytes, pulled
from tensorhub.tiles import tile
from tensorhub_testing.cluster import available

pytestmark = pytest.mark.skipif(available() is not None,
                                reason=f"no emulated hosts here: {available()}")
ONE_KV_HEAD = {"hidden": 128, "heads": 4, "kv_heads": 1}


@pytest.fixture(scope="module")
def one_head_engine(vllm_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-kv-nodes")
    with engine_on_two_hosts(root, vllm_on_two_hosts(vllm_python, root, 2),
                             healthy_timeout=480, shape=ONE_KV_HEAD) as fleet:
        yield fleet


@pytest.mark.timeout(900)  # two engine processes start across hosts
@pytest.mark.parametrize("by_head", [False, True], ids=["kv-in-the-tiles", "kv-by-head"])
def test_nodes_sharing_a_kv_head_pull_their_own_tiles_when_it_is_split_by_head(
        one_head_engine, by_head):
    fleet = one_head_engine
    engine = fleet.engine
    status = engine.tensorhub_status()
    prefix = status["workers"][0].rsplit("-rank", 1)[0]
    state = fleet.versions.state(2 + by_head)
    heads = 1 if by_head else None
    parts = [model_bytes(dict(p.tensors)) for p in tile(state.items(), 2, kv_heads=heads)]
    version = fleet.publish_tiled(2 + by_head, tiles=2, kv_heads=heads)
    engine.wait_serving(version)
    assert engine.greedy(fleet.prompts, TOKENS) == fleet.expected[1 + by_head]
    nbytes, readers = pulled(fleet.fleet.status(), version, prefix)
    print(f"vLLM TP=2, one K/V head, on 2 hosts, 2 tiles"
          f"{', K/V by head' if by_head else ''}: v{version}: {nbytes} B pulled by "
          f"{sorted(readers)} ({nbytes / model_bytes(state):.2f} x the model)")
    if by_head:
        assert len(parts) == 4
        assert nbytes == parts[0] + parts[1] + 2 * (parts[2] + parts[3])
    else:
        assert nbytes == 2 * model_bytes(state)
