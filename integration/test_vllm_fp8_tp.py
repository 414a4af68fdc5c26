"""The fp8 vLLM engine of `test_vllm_fp8.py` at tensor parallelism 2 (`vllm serve
--quantization fp8_per_channel --dtype bfloat16 --tensor-parallel-size 2` on CPU): each rank
quantizes its own shard at every version, so the row-parallel layers' scales are those of
half a row, not of the whole.

The oracle is vLLM itself: after each version TensorHub installed, the engine reloads the
same bf16 weights from disk with its own `reload_weights`, and every rank's parameters
(fp8 weights, scales and the rest) must be byte-equal before and after, at the addresses
they had at start. A version the model cannot load is refused on both ranks, which keep
their bytes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from integration.test_vllm import PLUGIN_ARGS, _bad_versions, plugin_env
from integration.test_vllm_fp8 import (
    FP8,
    FP8_ARGS,
    TOKENS,
    bf16_versions,
    differing,
    read_ranks,
)
from integration.tiny_model import (
    make_prompts,
    save_version,
)
from integration.tp_fleet import TP_SHAPE
from integration.vllm_server import VLLMServer
from tensorhub_testing.waits import wait_for


@pytest.fixture(scope="module")
def fp8_tp(tmp_path_factory, vllm_python, coordinator_process):
    root = tmp_path_factory.mktemp("vllm-fp8-tp")
    address = coordinator_process.address
    model_dir, states, pub = bf16_versions(root, address, 4, **TP_SHAPE)
    engine = VLLMServer(vllm_python, model_dir, dtype="bfloat16", live_weights=True,
                        extra_args=[*PLUGIN_ARGS, *FP8_ARGS, "--tensor-parallel-size", "2"],
                        env={**plugin_env(address), "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
                        log_path=root / "fp8-tp2.log")
    try:
        engine.start(timeout=480)
        yield SimpleNamespace(root=root, model_dir=model_dir, states=states, pub=pub,
                              engine=engine, prompts=make_prompts(4, 12, seed=39))
    finally:
        engine.stop()
        pub.close()


def test_each_fp8_rank_holds_what_vllms_own_reload_makes_of_each_version(fp8_tp):
    engine = fp8_tp.engine
    engine.wait_serving(1)
    _, at_start = read_ranks(engine, fp8_tp.root / "start")
    for version in (2, 3):
        state = fp8_tp.states[version - 1]
        assert fp8_tp.pub.publish(state) == version
        assert engine.wait_serving(version)["vllm_weight_version"] == str(version)
        ours, addresses = read_ranks(engine, fp8_tp.root / f"ours{version}")
        assert addresses == at_start, f"v{version}: parameters moved"
        assert all(sum(t.dtype == FP8 for t in rank.values()) == 4 * 2 for rank in ours)
        tokens = engine.greedy(fp8_tp.prompts, TOKENS)
        engine.reload_from_disk(save_version(fp8_tp.model_dir, state,
                                             fp8_tp.root / f"v{version}"))
        theirs, addresses = read_ranks(engine, fp8_tp.root / f"theirs{version}")
        assert addresses == at_start, f"v{version}: vLLM's reload moved parameters"
        for rank, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert not differing(a, b), f"v{version}, rank {rank}: {differing(a, b)}"
        assert engine.greedy(fp8_tp.prompts, TOKENS) == tokens


def test_a_version_the_tp2_fp8_engine_cannot_load_is_refused_on_both_ranks(fp8_tp):
    engine = fp8_tp.engine
    serving = engine.tensorhub_status()["serving_version"]
    before, _ = read_ranks(engine, fp8_tp.root / "before")
    what, state, tensor = _bad_versions(fp8_tp.states[serving - 1])[1]  # a wrong shape
    bad = fp8_tp.pub.publish(state)
    wait_for(lambda: (engine.tensorhub_status()["unloadable"] or {}).get("version") == bad,
             timeout=60, what=f"refusing v{bad} ({what})")
    status = engine.tensorhub_status()
    assert tensor in status["unloadable"]["reason"] and status["serving_version"] == serving
    after, _ = read_ranks(engine, fp8_tp.root / "after")
    for rank, (a, b) in enumerate(zip(before, after, strict=True)):
        assert not differing(a, b), f"rank {rank}: {differing(a, b)}"
    good = fp8_tp.pub.publish(fp8_tp.states[3])
    engine.wait_serving(good)
