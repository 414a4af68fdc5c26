"""vLLM at tensor parallelism 2 (real `vllm serve --tensor-parallel-size 2` on CPU): it
follows versions published by one trainer and by two trainer ranks together, with greedy
tokens equal to HF; a version one rank refuses is applied on neither rank.

The ranks share one checkpoint copy (rank 0's, in shared memory): the engine pulls and
keeps one model's bytes, not one per rank."""

from __future__ import annotations

import pytest

from integration.faults import refuse_fault_env
from integration.test_vllm import PLUGIN_ARGS, plugin_env, wait_serving
from integration.tp_fleet import (
    REFUSED,
    TOKENS,
    bad_versions_refused_then_next,
    refused_then_next,
    tp_fleet,
    two_rank_version_pulled_once,
)
from integration.vllm_server import VLLMServer


@pytest.fixture(scope="module")
def tp_engine(tmp_path_factory, vllm_python, coordinator_process):
    root = tmp_path_factory.mktemp("vllm-tp")
    address = coordinator_process.address

    def launch(model_dir):
        return VLLMServer(
            vllm_python, model_dir, extra_args=[*PLUGIN_ARGS, "--tensor-parallel-size", "2"],
            env={**plugin_env(address), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                 **refuse_fault_env(REFUSED, "-rank0")},
            log_path=root / "engine-tp2.log").launch()

    with tp_fleet(root, address, launch, healthy_timeout=480) as fleet:
        yield fleet


def test_a_tp2_engine_joins_the_published_version(tp_engine):
    wait_serving(tp_engine.engine, 1)
    assert tp_engine.engine.greedy(tp_engine.prompts, TOKENS) == tp_engine.expected[0]


def test_a_tp2_engine_follows_a_version_published_by_two_trainer_ranks(tp_engine):
    workers = tp_engine.engine.request("/tensorhub/status")["workers"]
    assert [w.rsplit("-", 1)[1] for w in workers] == ["rank0"]  # one copy, rank 0's
    two_rank_version_pulled_once(tp_engine, lambda v: wait_serving(tp_engine.engine, v),
                                 lambda: workers[0].rsplit("-rank", 1)[0])


def test_a_version_one_rank_refuses_is_applied_on_neither_and_the_next_one_is(tp_engine):
    engine = tp_engine.engine
    refused_then_next(tp_engine, lambda: engine.request("/tensorhub/status")["serving_version"],
                      lambda v: wait_serving(engine, v))


def test_versions_the_model_cannot_load_are_refused_on_both_ranks(tp_engine):
    bad_versions_refused_then_next(tp_engine, lambda v: wait_serving(tp_engine.engine, v))
