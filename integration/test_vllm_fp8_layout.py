"""Quantized once, by the trainer: `Publisher(quantize=["fp8_per_channel"])` publishes each
version also as `layout@fp8_per_channel`, and a `vllm serve --quantization fp8_per_channel`
engine with the plugin follows that companion on its own (the trainer publishes it, the
engine is one CPU rank). It pulls the fp8 bytes, about half the bf16 ones, writes them into
its live parameters with nothing quantized, and a late engine joins from it, the peer
relaying the quantized layout. After each version the live weights are the reference
quantization of the bf16 weights (what vLLM's own quantization makes: pinned by
`integration/test_vllm_fp8.py`) at the addresses they had, and its greedy tokens equal a
fresh fp8 engine's started from the same bf16 weights on disk. Tests run in file order on
one engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from integration.test_vllm import PLUGIN_ARGS, plugin_env, transfers
from integration.test_vllm_fp8 import (
    FP8,
    FP8_ARGS,
    TOKENS,
    check_holds,
    differing,
    equals_a_fresh_engine,
    expected_live,
    read_live,
    refuses_bad_versions_and_serves_on,
    weightless_copy,
)
from integration.tiny_model import (
    build_tiny_model,
    load_state_dict,
    make_prompts,
    perturb_state_dict,
)
from integration.vllm_server import VLLMServer
from tensorhub import Publisher
from tensorhub.quant import quantize_named, quantized_model
from tensorhub.tools.cli import _change as step

MODEL = "layout"
COMPANION = quantized_model(MODEL, "fp8_per_channel")


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


@pytest.fixture(scope="module")
def once(tmp_path_factory, vllm_python, coordinator_process):
    root = tmp_path_factory.mktemp("vllm-fp8-layout")
    address = coordinator_process.address
    model_dir = build_tiny_model(root / "model", dtype=torch.bfloat16)
    states = [load_state_dict(model_dir)]
    for k in range(1, 6):
        states.append(perturb_state_dict(states[-1], seed=40 + k, scale=0.3))
    pub = Publisher(address, MODEL, name="layout-trainer", quantize=["fp8_per_channel"])
    pub.publish(states[0])
    engine = VLLMServer(vllm_python, model_dir, dtype="bfloat16", live_weights=True,
                        extra_args=[*PLUGIN_ARGS, *FP8_ARGS],
                        env={**plugin_env(address), "TENSORHUB_MODEL": MODEL},
                        log_path=root / "engine.log")
    try:
        engine.start(timeout=300)
        yield SimpleNamespace(root=root, model_dir=model_dir, states=states, pub=pub,
                              engine=engine, address=address, addresses={},
                              prompts=make_prompts(4, 12, seed=41), python=vllm_python)
    finally:
        engine.stop()
        pub.close()


def test_an_fp8_engine_follows_the_trainers_quantized_layout_on_its_own(once):
    status = once.engine.wait_serving(1)
    assert status["model"] == COMPANION
    assert f"following {COMPANION}, the trainer's fp8_per_channel layout of {MODEL}" in \
        once.engine.log_path.read_text()
    check_holds(once, once.states[0], "v1, from disk")


@pytest.mark.parametrize("version", [2, 3])
def test_it_pulls_the_quantized_bytes_and_writes_them_as_they_are(once, version):
    state = once.states[version - 1]
    before = once.engine.greedy(once.prompts, TOKENS)
    assert once.pub.publish(state) == version
    assert once.engine.wait_serving(version)["vllm_weight_version"] == str(version)
    check_holds(once, state, f"v{version}")
    assert once.engine.greedy(once.prompts, TOKENS) != before, "the version changed no token"
    pulled = sum(t.nbytes for t in transfers(once.address, version, model=COMPANION))
    fp8 = nbytes(quantize_named(state.items(), "fp8_per_channel"))
    assert fp8 <= pulled < 1.01 * fp8
    # (half of each projection's bytes, plus its scales: this tiny model is mostly its
    # embeddings, which stay bf16; `bench/vllm_fp8.py` measures a real shape)
    assert pulled < 0.85 * nbytes(state.items())
    assert transfers(once.address, version, model=MODEL) == []  # no bf16 byte
    log = once.engine.log_path.read_text()
    assert "quantized before the pause" not in log and "quantizing v" not in log


def test_a_one_percent_step_is_installed_sparse_and_byte_equal_to_a_whole_quantization(once):
    """1 % of each tensor's elements moved by one bf16 step: the check finds the few fp8
    bytes and scales that differ and the pause writes only those; the live weights are then
    the reference quantization of the whole new version."""
    state = {n: t.clone() for n, t in once.states[2].items()}
    step(state, 0.01, torch.Generator().manual_seed(4))
    once.states[3] = state  # (v4: the next tests compare against it)
    assert once.pub.publish(state) == 4
    once.engine.wait_serving(4)
    check_holds(once, state, "v4, installed sparse")
    log = once.engine.log_path.read_text()
    assert "v4 installed sparse" in log, log[-2000:]
    assert once.engine.tensorhub_status()["last_update"]["install"] == "sparse"


def test_its_tokens_and_bytes_equal_a_fresh_fp8_engine_on_the_same_weights(once):
    equals_a_fresh_engine(once)


def test_a_version_it_cannot_load_is_refused_in_the_quantized_layout_too(once):
    refuses_bad_versions_and_serves_on(once)


def test_a_late_fp8_engine_joins_from_its_peer_in_the_quantized_layout(once):
    weightless = weightless_copy(once)
    serving = once.engine.tensorhub_status()["serving_version"]
    ours = once.engine.greedy(once.prompts, TOKENS)
    late = VLLMServer(once.python, weightless, dtype="bfloat16", live_weights=True,
                      extra_args=[*PLUGIN_ARGS, *FP8_ARGS, "--load-format", "dummy"],
                      env={**plugin_env(once.address), "TENSORHUB_MODEL": MODEL},
                      log_path=once.root / "late.log")
    with late:
        status = late.tensorhub_status()
        assert (status["model"], status["serving_version"]) == (COMPANION, serving)
        live, _ = read_live(late, once.root / "late")
        assert not differing(live, expected_live(once.states[4], live))
        assert sum(t.dtype == FP8 for t in live.values()) == 4 * 2
        assert late.greedy(once.prompts, TOKENS) == ours
        pulled = sum(t.nbytes for t in transfers(once.address, serving, COMPANION)
                     if t.reader == status["name"])
    assert pulled == nbytes(quantize_named(once.states[4].items(), "fp8_per_channel"))
