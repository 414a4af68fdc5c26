"""A quantized vLLM engine fed by a bf16 trainer: `vllm serve --quantization fp8_per_channel
--dtype bfloat16` with the plugin (vLLM 0.32 CPU: `Fp8PtpcOnlineLinearMethod`, online
per-channel quantization at load, and again at each layerwise reload the plugin drives).

It joins, follows versions, refuses a bad one, and a late engine joins from peers. After
each version its fp8 weights and scales are byte-equal to the reference quantizer
(`tensorhub.quant.vllm_per_channel`) of the published bf16 weights, every other parameter
equals the published bytes, and every parameter keeps its address (CUDA graphs and
kernels hold them). Its greedy tokens equal those of a fresh fp8 engine started from the
same bf16 weights on disk, whose weights are the same bytes too (HF float32 is no oracle
for fp8)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from integration.test_vllm import PLUGIN_ARGS, _bad_versions, plugin_env, transfers
from integration.tiny_model import (
    build_tiny_model,
    load_state_dict,
    make_prompts,
    perturb_state_dict,
    save_version,
)
from integration.vllm_server import VLLMServer
from tensorhub import Publisher
from tensorhub.quant import vllm_per_channel
from tensorhub_testing.waits import wait_for

TOKENS = 12
FP8_ARGS = ["--quantization", "fp8_per_channel"]
FP8 = torch.float8_e4m3fn
# vLLM's fused linear layers of Qwen2 and the checkpoint tensors stacked into each, in order.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def vllm_named(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under vLLM's parameter names (q/k/v and gate/up stacked by rows)."""
    out = dict(state)
    for name in list(state):
        for fused, parts in FUSED.items():
            first = f".{parts[0]}."
            if first in name:
                stem, kind = name.split(first)
                pieces = [out.pop(f"{stem}.{p}.{kind}") for p in parts]
                out[f"{stem}.{fused}.{kind}"] = torch.cat(pieces)
    return out


def expected_live(state: dict[str, torch.Tensor], live: dict[str, torch.Tensor]) -> dict:
    """What an fp8_per_channel engine must hold for `state`: for each quantized linear
    layer the reference's fp8 values (held transposed, [in, out]) and scales, and every
    other parameter as published."""
    named = vllm_named(state)
    want = {}
    for name, t in live.items():
        if name.endswith(".weight_scale"):
            continue
        if t.dtype == FP8:
            ref = vllm_per_channel(named[name])
            want[name] = ref.weight.t().contiguous()
            want[name.removesuffix("weight") + "weight_scale"] = ref.scale
        else:
            want[name] = named[name]
    return want


def differing(live: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, str]:
    """Parameters whose bytes differ (or are missing on either side), with how."""
    bad = {n: "missing in the engine" for n in want.keys() - live.keys()}
    bad |= {n: "not expected" for n in live.keys() - want.keys()}
    for n in live.keys() & want.keys():
        a = live[n]
        b = want[n].reshape(a.shape) if n.endswith("weight_scale") else want[n]
        if a.shape != b.shape or a.dtype != b.dtype:
            bad[n] = f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        elif (diff := int((a.contiguous().reshape(-1).view(torch.uint8)
                           != b.contiguous().reshape(-1).view(torch.uint8)).sum())):
            bad[n] = f"{diff} bytes differ"
    return bad


def read_ranks(engine: VLLMServer, prefix: Path) -> tuple[list[dict], list[dict]]:
    """(parameters, addresses) of each rank, in rank order."""
    tensors, addresses = [], []
    for rank in engine.dump_live_weights(prefix):
        tensors.append(load_file(rank["path"]))
        Path(rank["path"]).unlink()
        addresses.append(rank["addresses"])
    return tensors, addresses


def read_live(engine: VLLMServer, prefix: Path) -> tuple[dict, dict]:
    """(parameters, addresses) of a TP=1 engine."""
    ([tensors], [addresses]) = read_ranks(engine, prefix)
    return tensors, addresses


def bf16_versions(root: Path, address: str, count: int, model: str = "policy", **shape
                  ) -> tuple[Path, list[dict], Publisher]:
    """A bf16 tiny model on disk, `count` versions of it (the first: the weights on disk)
    and a trainer that published that first one as `model`."""
    model_dir = build_tiny_model(root / "model", dtype=torch.bfloat16, **shape)
    states = [load_state_dict(model_dir)]
    for k in range(1, count):
        states.append(perturb_state_dict(states[-1], seed=k, scale=0.3))
    pub = Publisher(address, model, name=f"{model}-trainer")
    pub.publish(states[0])
    return model_dir, states, pub


@pytest.fixture(scope="module")
def fp8(tmp_path_factory, vllm_python, coordinator_process):
    root = tmp_path_factory.mktemp("vllm-fp8")
    address = coordinator_process.address
    model_dir, states, pub = bf16_versions(root, address, 6)
    engine = VLLMServer(vllm_python, model_dir, dtype="bfloat16", live_weights=True,
                        extra_args=[*PLUGIN_ARGS, *FP8_ARGS], env=plugin_env(address),
                        log_path=root / "fp8.log")
    try:
        engine.start(timeout=300)
        yield SimpleNamespace(root=root, model_dir=model_dir, states=states, pub=pub,
                              engine=engine, address=address, addresses={},
                              prompts=make_prompts(4, 12, seed=39), python=vllm_python)
    finally:
        engine.stop()
        pub.close()


def check_holds(fp8, state: dict, what: str) -> dict:
    """The engine's live parameters are the reference quantization of `state`, at the
    addresses they had when it started; returns them."""
    live, addresses = read_live(fp8.engine, fp8.root / "live")
    assert not differing(live, expected_live(state, live)), \
        f"{what}: {differing(live, expected_live(state, live))}"
    fp8.addresses = fp8.addresses or addresses
    assert addresses == fp8.addresses, f"{what}: parameters moved"
    return live


def test_an_fp8_engine_joins_and_holds_the_reference_quantization(fp8):
    status = fp8.engine.wait_serving(1)
    assert status["vllm_weight_version"] == "1"
    live = check_holds(fp8, fp8.states[0], "v1")
    quantized = [n for n, t in live.items() if t.dtype == FP8]
    assert len(quantized) == 4 * 2, quantized  # qkv, o, gate_up, down in both layers
    assert "Fp8PtpcOnlineLinearMethod" in fp8.engine.log_path.read_text()


@pytest.mark.parametrize("version", [2, 3])
def test_it_follows_bf16_versions_requantized_in_place(fp8, version):
    before = fp8.engine.greedy(fp8.prompts, TOKENS)
    assert fp8.pub.publish(fp8.states[version - 1]) == version
    assert fp8.engine.wait_serving(version)["vllm_weight_version"] == str(version)
    check_holds(fp8, fp8.states[version - 1], f"v{version}")
    assert fp8.engine.greedy(fp8.prompts, TOKENS) != before, "the version changed no token"
    pulled = sum(t.nbytes for t in transfers(fp8.address, version, model="policy"))
    bf16 = sum(t.numel() * t.element_size() for t in fp8.states[version - 1].values())
    assert bf16 <= pulled < 1.01 * bf16  # it pulls the bf16 version, whole


def equals_a_fresh_engine(fp8) -> None:
    """The engine's live bytes and greedy tokens equal those of a fresh fp8 engine started
    from the version it serves, saved as a bf16 checkpoint."""
    serving = fp8.engine.tensorhub_status()["serving_version"]
    ours_live, _ = read_live(fp8.engine, fp8.root / "ours")
    ours = fp8.engine.greedy(fp8.prompts, TOKENS)
    on_disk = save_version(fp8.model_dir, fp8.states[serving - 1], fp8.root / f"v{serving}")
    with VLLMServer(fp8.python, on_disk, dtype="bfloat16", live_weights=True,
                    extra_args=FP8_ARGS, log_path=fp8.root / "fresh.log") as fresh:
        fresh_live, _ = read_live(fresh, fp8.root / "fresh")
        assert not differing(ours_live, fresh_live), differing(ours_live, fresh_live)
        assert ours == fresh.greedy(fp8.prompts, TOKENS)


def weightless_copy(fp8) -> Path:
    """The model's folder without its weights (config and tokenizer: `--load-format dummy`)."""
    weightless = fp8.root / "weightless"
    weightless.mkdir(exist_ok=True)
    for f in fp8.model_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (weightless / f.name).write_bytes(f.read_bytes())
    return weightless


def refuses_bad_versions_and_serves_on(fp8) -> None:
    """Each of `_bad_versions` of the served version is refused, naming its tensor, with
    the live bytes and tokens untouched; the next good version (`states[4]`) is then
    served and held as the reference quantization."""
    engine = fp8.engine
    serving = engine.tensorhub_status()["serving_version"]
    before, _ = read_live(engine, fp8.root / "before")
    tokens = engine.greedy(fp8.prompts, TOKENS)
    for what, state, tensor in _bad_versions(fp8.states[serving - 1]):
        bad = fp8.pub.publish(state)
        wait_for(lambda bad=bad: (engine.tensorhub_status()["unloadable"] or {}
                                  ).get("version") == bad, timeout=60,
                 what=f"refusing v{bad} ({what})")
        status = engine.tensorhub_status()
        assert tensor in status["unloadable"]["reason"], status["unloadable"]
        assert status["serving_version"] == serving
    after, _ = read_live(engine, fp8.root / "after")
    assert not differing(after, before)
    assert engine.greedy(fp8.prompts, TOKENS) == tokens
    good = fp8.pub.publish(fp8.states[4])
    engine.wait_serving(good)
    check_holds(fp8, fp8.states[4], f"v{good} after the refused ones")


def test_its_tokens_and_bytes_equal_a_fresh_fp8_engine_on_the_same_weights(fp8):
    equals_a_fresh_engine(fp8)


def test_an_fp8_engine_started_later_joins_the_newest_version_from_peers(fp8):
    weightless = weightless_copy(fp8)
    serving = fp8.engine.tensorhub_status()["serving_version"]
    ours = fp8.engine.greedy(fp8.prompts, TOKENS)
    late = VLLMServer(fp8.python, weightless, dtype="bfloat16", live_weights=True,
                      extra_args=[*PLUGIN_ARGS, *FP8_ARGS, "--load-format", "dummy"],
                      env=plugin_env(fp8.address), log_path=fp8.root / "late.log")
    with late:
        assert late.tensorhub_status()["serving_version"] == serving  # before any request
        live, _ = read_live(late, fp8.root / "late")
        assert not differing(live, expected_live(fp8.states[serving - 1], live))
        assert late.greedy(fp8.prompts, TOKENS) == ours
    assert f"joined at policy v{serving} from peers" in late.log_path.read_text()


def test_a_version_the_fp8_engine_cannot_load_is_refused_and_it_serves_on(fp8):
    refuses_bad_versions_and_serves_on(fp8)


def test_a_tied_fp8_engine_takes_versions_that_carry_the_tied_head(tmp_path_factory,
                                                                  vllm_python,
                                                                  coordinator_process):
    """Tied embeddings, and a trainer whose versions carry `lm_head.weight` too (as a
    `state_dict()` does): each version is installed (the alias skipped, as vLLM's loader
    skips it), and the engine holds the reference quantization of it."""
    root = tmp_path_factory.mktemp("vllm-fp8-tied")
    address = coordinator_process.address
    model_dir, states, pub = bf16_versions(root, address, 3, model="tied",
                                           tie_word_embeddings=True)
    engine = VLLMServer(vllm_python, model_dir, dtype="bfloat16", live_weights=True,
                        extra_args=[*PLUGIN_ARGS, *FP8_ARGS],
                        env={**plugin_env(address), "TENSORHUB_MODEL": "tied"},
                        log_path=root / "tied.log")
    try:
        engine.start(timeout=300)
        engine.wait_serving(1)
        for version in (2, 3):
            state = states[version - 1]
            with_head = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
            assert pub.publish(with_head) == version
            assert engine.wait_serving(version)["vllm_weight_version"] == str(version)
            live, _ = read_live(engine, root / "live")
            assert not differing(live, expected_live(state, live)), f"v{version}"
        assert "quantized before the pause" in engine.log_path.read_text()
    finally:
        engine.stop()
        pub.close()
