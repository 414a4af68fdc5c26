"""vLLM at tensor parallelism 2 (real `vllm serve --tensor-parallel-size 2` on CPU): it
follows versions published by one trainer and by two trainer ranks together, with greedy
tokens equal to HF; a version one rank refuses is applied on neither rank.

Each TP rank still keeps and pulls a whole checkpoint copy (issue 17 is not done there)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from integration.sharded import publish_in_two_ranks
from integration.test_vllm import MODEL, PLUGIN_ARGS, TOKENS, plugin_env, wait_serving
from integration.tiny_model import Versions, pick_stable_prompts
from integration.vllm_server import VLLMServer
from tensorhub import Publisher
from tensorhub.engines.holder import REFUSE_ENV

REFUSED = 3  # rank 1's copy of this version "fails verification"


@pytest.fixture(scope="module")
def tp_engine(tmp_path_factory, vllm_python, coordinator_process):
    root = tmp_path_factory.mktemp("vllm-tp")
    # heads split over 2 ranks; head_dim 32 (the CPU attention kernels take no 16)
    versions = Versions(root, count=4, hidden=128, heads=4, kv_heads=2)
    prompts, expected = pick_stable_prompts(versions.dir, 6, 12, TOKENS,
                                            state_dicts=versions.states)
    address = coordinator_process.address
    pub = Publisher(address, MODEL, name="trainer")
    pub.publish(versions.state(1))
    engine = VLLMServer(
        vllm_python, versions.dir, extra_args=[*PLUGIN_ARGS, "--tensor-parallel-size", "2"],
        env={**plugin_env(address), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
             REFUSE_ENV: f"{REFUSED}@-rank1"},
        log_path=root / "engine-tp2.log").launch()
    try:
        engine.wait_healthy(480)
        yield SimpleNamespace(versions=versions, prompts=prompts, expected=expected, pub=pub,
                              engine=engine, address=address)
    finally:
        engine.stop()
        pub.close()


def test_a_tp2_engine_joins_the_published_version(tp_engine):
    wait_serving(tp_engine.engine, 1)
    assert tp_engine.engine.greedy(tp_engine.prompts, TOKENS) == tp_engine.expected[0]


def test_a_tp2_engine_follows_a_version_published_by_two_trainer_ranks(tp_engine):
    publish_in_two_ranks(tp_engine.address, MODEL, tp_engine.versions.state(2), 2)
    wait_serving(tp_engine.engine, 2)
    assert tp_engine.engine.greedy(tp_engine.prompts, TOKENS) == tp_engine.expected[1]


def test_a_version_one_rank_refuses_is_applied_on_neither_and_the_next_one_is(tp_engine):
    engine = tp_engine.engine
    assert tp_engine.pub.publish(tp_engine.versions.state(REFUSED)) == REFUSED
    deadline = time.monotonic() + 120
    while f"refusing v{REFUSED}" not in engine.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the engine never tried to apply v3"
        time.sleep(0.5)
    assert engine.request("/tensorhub/status")["serving_version"] == 2
    assert engine.greedy(tp_engine.prompts, TOKENS) == tp_engine.expected[1]  # v2, whole
    assert tp_engine.pub.publish(tp_engine.versions.state(4)) == 4
    wait_serving(engine, 4)
    assert engine.greedy(tp_engine.prompts, TOKENS) == tp_engine.expected[3]
