"""vLLM at TP=2 with one rank on each of two emulated hosts, started as vLLM documents
multi-node serving (`--nnodes 2 --node-rank R --master-addr` with the `mp` executor,
`--headless` on node 1), the TensorHub plugin on both: it joins late at v1 and follows v2
and v3 with greedy tokens equal to HF's, pulling one copy per node per version, a version
its model cannot load is refused by both nodes before either touches its weights, and a
version in tiles is pulled by each node as its rank's share."""

from __future__ import annotations

import pytest

from integration.test_vllm import PLUGIN_ARGS, plugin_env
from integration.tp_fleet import TOKENS
from integration.two_hosts import (
    VERSIONS,
    a_copy_per_node_pulled,
    engine_on_two_hosts,
    tiles_pulled_as_shares,
    wrong_shape_refused,
)
from integration.vllm_server import VLLMServer
from tensorhub_testing.cluster import available

pytestmark = pytest.mark.skipif(available() is not None,
                                reason=f"no emulated hosts here: {available()}")
# (below 20000: the engines' HTTP ports are drawn from 20000 up, `net.free_port`, and one
# that came out 29501 collided with torch's default master port on node 0's host)
MASTER_PORT = "19501"


def vllm_on_two_hosts(vllm_python: str, root, tp: int, pp: int = 1):
    """How `engine_on_two_hosts` starts a vLLM engine of `tp` * `pp` ranks, half on each
    host (with `pp` 2, a pipeline stage on each)."""

    def launch(model_dir, address, node0, node1):
        engines = []
        for rank, host in enumerate((node0, node1)):
            env = {**plugin_env(address), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0",
                   "VLLM_HOST_IP": host.address, "MASTER_ADDR": node0.address,
                   # (stages compile: their cache goes with the test's folder)
                   **({"VLLM_CACHE_ROOT": str(root / f"vllm-cache{rank}")} if pp > 1 else {})}
            args = [*PLUGIN_ARGS, "--tensor-parallel-size", str(tp),
                    "--pipeline-parallel-size", str(pp), "--nnodes", "2",
                    "--node-rank", str(rank), "--master-addr", node0.address,
                    "--master-port", MASTER_PORT, "--distributed-executor-backend", "mp",
                    *(["--headless"] if rank else [])]
            engines.append(VLLMServer(vllm_python, model_dir, extra_args=args, env=env,
                                      log_path=root / f"vllm-node{rank}.log",
                                      eager=pp == 1).on(host))
        for engine in engines:
            engine.launch()
        return engines

    return launch


@pytest.fixture(scope="module")
def nodes_engine(tmp_path_factory, vllm_python):
    root = tmp_path_factory.mktemp("vllm-nodes")
    with engine_on_two_hosts(root, vllm_on_two_hosts(vllm_python, root, 2),
                             healthy_timeout=480) as fleet:
        yield fleet


@pytest.mark.timeout(900)  # two engine processes start across hosts
def test_a_vllm_engine_across_two_hosts_joins_late_and_follows_versions(nodes_engine):
    engine = nodes_engine.engine
    engine.wait_serving(1)
    assert engine.greedy(nodes_engine.prompts, TOKENS) == nodes_engine.expected[0]
    for version in range(2, VERSIONS + 1):
        nodes_engine.publish(version)
        engine.wait_serving(version)
        assert engine.greedy(nodes_engine.prompts, TOKENS) == nodes_engine.expected[version - 1]


def test_a_vllm_engine_across_two_hosts_pulls_one_copy_per_node(nodes_engine):
    """One rank per node: each node's rank keeps its own copy, so the engine pulls at most
    two models' bytes per version (its nodes), and holds two copies."""
    a_copy_per_node_pulled(nodes_engine, "vLLM TP=2")


def test_a_version_the_model_cannot_load_is_refused_across_the_hosts(nodes_engine):
    """A tensor of the wrong shape: each node's copy finds it before the pause (the check
    every rank answers across the hosts), the engine names the tensor, keeps serving the
    version before with HF's tokens, and never tries it again."""
    wrong_shape_refused(nodes_engine)


def test_a_version_in_tiles_is_pulled_by_each_node_as_its_share(nodes_engine):
    """The trainer publishes versions in two tiles (`tensorhub/tiles.py`): each node's copy
    pulls its rank's tile and the part every rank loads whole, not the whole model, and
    the engine serves each with HF's tokens."""
    engine = nodes_engine.engine
    prefix = engine.tensorhub_status()["workers"][0].rsplit("-rank", 1)[0]
    tiles_pulled_as_shares(nodes_engine, prefix, engine.wait_serving, "vLLM TP=2")
