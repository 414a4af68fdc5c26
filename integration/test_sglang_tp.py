"""SGLang at tensor parallelism 2 on CPU (real `sglang.launch_server --tp-size 2`; the
plugin turns off the CUDA-only PyNccl and custom all-reduce, so collectives run on gloo):
it follows versions published by one trainer and by two trainer ranks together, with
greedy tokens equal to HF, pulling and keeping one checkpoint copy for both ranks; a version
one rank refuses is applied on neither rank."""

from __future__ import annotations

import pytest

from integration.faults import refuse_fault_env
from integration.sglang_server import SGLangServer
from integration.test_sglang import LOADER, sglang_env, sglang_version, wait_sglang
from integration.tp_fleet import (
    REFUSED,
    TOKENS,
    bad_versions_refused_then_next,
    refused_then_next,
    tp_fleet,
    two_rank_version_pulled_once,
)


@pytest.fixture(scope="module")
def tp_engine(tmp_path_factory, sglang_python, coordinator_process):
    root = tmp_path_factory.mktemp("sglang-tp")
    address = coordinator_process.address

    def launch(model_dir):
        return SGLangServer(
            sglang_python, model_dir,
            env={**sglang_env(address), "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
                 **refuse_fault_env(REFUSED, "-tp0")},
            extra_args=["--custom-weight-loader", LOADER, "--tp-size", "2"],
            log_path=root / "sglang-tp2.log").launch()

    with tp_fleet(root, address, launch, healthy_timeout=300) as fleet:
        yield fleet


def test_a_tp2_sglang_engine_serves_the_published_version(tp_engine):
    wait_sglang(tp_engine.engine, 1)
    assert tp_engine.engine.greedy(tp_engine.prompts, TOKENS) == tp_engine.expected[0]
    workers = tp_engine.engine.request("/tensorhub/status")["workers"]
    assert [w.rsplit("-", 1)[1] for w in workers] == ["tp0"]  # one copy, rank 0's


def test_a_tp2_sglang_engine_follows_a_version_published_by_two_ranks(tp_engine):
    # Rank 1 loads its shard from rank 0's copy: the engine pulls one model's bytes.
    two_rank_version_pulled_once(
        tp_engine, lambda v: wait_sglang(tp_engine.engine, v),
        lambda: tp_engine.engine.request("/tensorhub/status")["name"])


def test_a_version_one_rank_refuses_is_applied_on_neither_and_the_next_one_is(tp_engine):
    engine = tp_engine.engine
    refused_then_next(tp_engine, lambda: int(sglang_version(engine)),
                      lambda v: wait_sglang(engine, v))


def test_versions_the_model_cannot_load_are_refused_on_both_ranks(tp_engine):
    bad_versions_refused_then_next(tp_engine, lambda v: wait_sglang(tp_engine.engine, v))
