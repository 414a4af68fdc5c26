"""SGLang at tensor parallelism 2 on CPU (real `sglang.launch_server --tp-size 2`; the
plugin turns off the CUDA-only PyNccl and custom all-reduce, so collectives run on gloo):
it follows versions published by one trainer and by two trainer ranks together, with
greedy tokens equal to HF; a version one rank refuses is applied on neither rank."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from integration.sglang_server import SGLangServer
from integration.sharded import publish_in_two_ranks
from integration.test_sglang import LOADER, MODEL, TOKENS, sglang_env, wait_sglang
from integration.tiny_model import Versions, pick_stable_prompts
from tensorhub import Publisher
from tensorhub.engines.holder import REFUSE_ENV

REFUSED = 3


@pytest.fixture(scope="module")
def tp_engine(tmp_path_factory, sglang_python, coordinator_process):
    root = tmp_path_factory.mktemp("sglang-tp")
    versions = Versions(root, count=4, hidden=128, heads=4, kv_heads=2)
    prompts, expected = pick_stable_prompts(versions.dir, 6, 12, TOKENS,
                                            state_dicts=versions.states)
    address = coordinator_process.address
    pub = Publisher(address, MODEL, name="trainer")
    pub.publish(versions.state(1))
    engine = SGLangServer(
        sglang_python, versions.dir,
        env={**sglang_env(address), "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
             REFUSE_ENV: f"{REFUSED}@-tp1"},
        extra_args=["--custom-weight-loader", LOADER, "--tp-size", "2"],
        log_path=root / "sglang-tp2.log").launch()
    try:
        engine.wait_healthy(300)
        yield SimpleNamespace(versions=versions, prompts=prompts, expected=expected, pub=pub,
                              engine=engine, address=address)
    finally:
        engine.stop()
        pub.close()


def test_a_tp2_sglang_engine_serves_the_published_version(tp_engine):
    wait_sglang(tp_engine.engine, 1)
    assert tp_engine.engine.greedy(tp_engine.prompts, TOKENS) == tp_engine.expected[0]
    workers = tp_engine.engine.request("/tensorhub/status")["workers"]
    assert [w.rsplit("-", 1)[1] for w in workers] == ["tp0", "tp1"]


def test_a_tp2_sglang_engine_follows_a_version_published_by_two_ranks(tp_engine):
    publish_in_two_ranks(tp_engine.address, MODEL, tp_engine.versions.state(2), 2)
    wait_sglang(tp_engine.engine, 2)
    assert tp_engine.engine.greedy(tp_engine.prompts, TOKENS) == tp_engine.expected[1]


def test_a_version_one_rank_refuses_is_applied_on_neither_and_the_next_one_is(tp_engine):
    engine = tp_engine.engine
    assert tp_engine.pub.publish(tp_engine.versions.state(REFUSED)) == REFUSED
    deadline = time.monotonic() + 120
    while f"refusing v{REFUSED}" not in engine.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the engine never tried to apply v3"
        time.sleep(0.5)
    assert engine.request("/get_model_info")["weight_version"] == "2"
    assert engine.greedy(tp_engine.prompts, TOKENS) == tp_engine.expected[1]  # v2, whole
    assert tp_engine.pub.publish(tp_engine.versions.state(4)) == 4
    wait_sglang(engine, 4)
    assert engine.greedy(tp_engine.prompts, TOKENS) == tp_engine.expected[3]
