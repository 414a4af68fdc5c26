"""SGLang at TP=4 across two emulated hosts, two ranks on each: on each host the lower rank
pulls and holds the host's checkpoint copy and the other maps it, so the engine keeps two
copies (TP ranks 0 and 2) and pulls at most two models per version, not four; node 0's driver
confirms each version once all four ranks report it, and greedy tokens equal HF's; of a
version in tiles each host pulls its two ranks' share.

(vLLM 0.32 cannot run this on CPU: its multi-node executor counts a node's ranks by the
platform's device count, 1 on CPU, so a second local rank is taken for a remote one.)"""

from __future__ import annotations

import pytest

from integration.test_sglang_nodes import confirmed, sglang_on_two_hosts
from integration.tp_fleet import TOKENS, TP_SHAPE
from integration.two_hosts import VERSIONS, engine_on_two_hosts, holders, model_bytes, pulled
from tensorhub.tiles import tile
from tensorhub_testing.cluster import available

pytestmark = pytest.mark.skipif(available() is not None,
                                reason=f"no emulated hosts here: {available()}")


@pytest.fixture(scope="module")
def shared_engine(tmp_path_factory, sglang_python):
    root = tmp_path_factory.mktemp("sglang-nodes-tp4")
    # (as many KV heads as ranks: SGLang on CPU pads heads TP=4 does not divide, and then
    # takes no tiled share, `worker.tp_reshaped`)
    with engine_on_two_hosts(root, sglang_on_two_hosts(sglang_python, root, 4),
                             healthy_timeout=600, shape={**TP_SHAPE, "kv_heads": 4}) as fleet:
        yield fleet


@pytest.mark.timeout(1200)  # four ranks start across hosts on a small machine
def test_a_tp4_engine_on_two_hosts_keeps_and_pulls_one_copy_per_host(shared_engine):
    engine = shared_engine.engine
    status = confirmed(shared_engine, 1, ranks=4)
    assert engine.greedy(shared_engine.prompts, TOKENS) == shared_engine.expected[0]
    workers = status["workers"]
    assert [w.rsplit("-", 1)[1] for w in workers] == ["tp0", "tp2"]  # each host's lowest
    model = model_bytes(shared_engine.versions.state(VERSIONS))
    for version in range(2, VERSIONS + 1):
        shared_engine.publish(version)
        confirmed(shared_engine, version, ranks=4)
        assert engine.greedy(shared_engine.prompts, TOKENS) == \
            shared_engine.expected[version - 1]
        coordinator = shared_engine.fleet.status()
        nbytes, readers = pulled(coordinator, version, status["name"])
        print(f"SGLang TP=4 on 2 hosts (2 ranks each): v{version}: {nbytes} B pulled by "
              f"{sorted(readers)} ({nbytes / model:.2f} x the model)")
        assert readers <= set(workers) and model <= nbytes <= 2 * model
    assert holders(coordinator, VERSIONS, workers) == set(workers)


def test_a_version_in_tiles_is_pulled_by_each_host_as_its_two_ranks_share(shared_engine):
    """In four tiles: each host's copy pulls the tiles of its two ranks and the part every
    rank loads whole, and its other rank maps that share; tokens equal HF's."""
    engine = shared_engine.engine
    name = engine.tensorhub_status()["name"]
    state = shared_engine.versions.state(2)
    parts = [model_bytes(dict(p.tensors)) for p in tile(state.items(), 4)]
    version = shared_engine.publish_tiled(2, tiles=4)
    confirmed(shared_engine, version, ranks=4)
    assert engine.greedy(shared_engine.prompts, TOKENS) == shared_engine.expected[1]
    nbytes, readers = pulled(shared_engine.fleet.status(), version, name)
    print(f"SGLang TP=4 on 2 hosts, 4 tiles: v{version}: {nbytes} B pulled by "
          f"{sorted(readers)} ({nbytes / model_bytes(state):.2f} x the model)")
    assert nbytes == sum(parts[:4]) + 2 * parts[4]  # (each host: its two tiles, the rest)
