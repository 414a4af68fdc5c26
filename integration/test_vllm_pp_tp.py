"""vLLM with pipeline parallelism 2 and tensor parallelism 2 on one emulated host (real
`vllm serve --pipeline-parallel-size 2 --tensor-parallel-size 2`, four workers, the `mp`
executor): the TP ranks of each stage share one checkpoint copy, their lowest rank's (ranks
0 and 2), so the engine keeps two copies, not four. A version in layer blocks is pulled by
each stage's copy as its own layers, one model's bytes in all, and served with greedy
tokens equal to HF's; a version one stage's layers cannot load is refused before any rank
touches its weights.

(vLLM's CPU build cannot start two workers a node on several nodes,
`docs/notes/vllm-0.32-cpu.md` §7: the stages share this host.)"""

from __future__ import annotations

import pytest

from integration.test_vllm import PLUGIN_ARGS, plugin_env
from integration.test_vllm_pp import PP_SHAPE
from integration.tp_fleet import TOKENS
from integration.two_hosts import (
    VERSIONS,
    engine_on_two_hosts,
    model_bytes,
    pulled,
    wrong_shape_refused,
)
from integration.vllm_server import VLLMServer
from tensorhub_testing.cluster import available

pytestmark = pytest.mark.skipif(available() is not None,
                                reason=f"no emulated hosts here: {available()}")


@pytest.fixture(scope="module")
def pp_tp_engine(tmp_path_factory, vllm_python):
    root = tmp_path_factory.mktemp("vllm-pp-tp")

    def launch(model_dir, address, node0, node1):
        env = {**plugin_env(address), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_HOST_IP": node0.address, "VLLM_CACHE_ROOT": str(root / "vllm-cache")}
        args = [*PLUGIN_ARGS, "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
                "--distributed-executor-backend", "mp"]
        # (stages run only with vLLM's warm-up on CPU: not eager, it compiles at start)
        engine = VLLMServer(vllm_python, model_dir, extra_args=args, env=env,
                            log_path=root / "vllm-pp2-tp2.log", eager=False).on(node0)
        engine.launch()
        return [engine]

    with engine_on_two_hosts(root, launch, healthy_timeout=900, shape=PP_SHAPE) as fleet:
        yield fleet


@pytest.mark.timeout(1500)  # four workers start, and compile
def test_the_tp_ranks_of_each_stage_share_one_copy_which_pulls_the_stage_s_layers(
        pp_tp_engine):
    engine = pp_tp_engine.engine
    engine.wait_serving(1)
    assert engine.greedy(pp_tp_engine.prompts, TOKENS) == pp_tp_engine.expected[0]
    workers = engine.tensorhub_status()["workers"]
    assert sorted(w.rsplit("-", 1)[1] for w in workers) == ["rank0", "rank2"], workers
    state = pp_tp_engine.versions.state(2)
    version = pp_tp_engine.publish_tiled(2, None, kind="blocks")
    engine.wait_serving(version)
    assert engine.greedy(pp_tp_engine.prompts, TOKENS) == pp_tp_engine.expected[1]
    coordinator = pp_tp_engine.fleet.status()
    nbytes, readers = pulled(coordinator, version, workers[0].rsplit("-rank", 1)[0])
    print(f"vLLM PP=2 x TP=2 on one host, layer blocks at the stage edges: v{version}: "
          f"{nbytes} B pulled by {sorted(readers)} ({nbytes / model_bytes(state):.2f} x the "
          f"model)")
    assert nbytes == model_bytes(state), (nbytes, model_bytes(state))
    # (each stage's copy reads its parts as workers of its own name: `<copy>.part<k>`)
    assert {reader.split(".part")[0] for reader in readers} == set(workers), readers


def test_a_version_stage_0_cannot_load_is_refused_before_any_rank_touches_its_weights(
        pp_tp_engine):
    """The wrong shape is in layer 1, which stage 0 runs: its copy refuses the version in
    the check before the pause, and all four ranks keep serving v3 (HF's tokens)."""
    pp_tp_engine.publish(VERSIONS)
    pp_tp_engine.engine.wait_serving(VERSIONS)
    wrong_shape_refused(pp_tp_engine)
