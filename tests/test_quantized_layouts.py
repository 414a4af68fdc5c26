"""A trainer that quantizes each version once: `Publisher(quantize=["fp8_per_channel"])`
publishes `<model>@fp8_per_channel` beside its bf16 model, and readers of it get the
reference quantizer's bytes, about half the bf16 version's."""

from __future__ import annotations

import threading

import pytest
import torch

from tensorhub import Publisher, Replica
from tensorhub.core.errors import CoordinatorError
from tensorhub.engines import EngineSettings, followed_model
from tensorhub.engines.weights_check import from_tensors
from tensorhub.quant import vllm_per_channel
from tensorhub.quant.layouts import (
    quantize_named,
    quantized_model,
    quantized_specs,
    recipe_of,
    split_quantized,
    stand_ins,
)

FP8 = torch.float8_e4m3fn


def decoder(seed: int = 0, layers: int = 2) -> dict[str, torch.Tensor]:
    """A small Qwen2-like checkpoint in bf16: projections, norms, embeddings, a bias."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": t(96, 32), "lm_head.weight": t(96, 32),
           "model.norm.weight": t(32)}
    for k in range(layers):
        a, m = f"model.layers.{k}.self_attn", f"model.layers.{k}.mlp"
        out |= {f"{a}.q_proj.weight": t(32, 32), f"{a}.q_proj.bias": t(32),
                f"{a}.k_proj.weight": t(16, 32), f"{a}.v_proj.weight": t(16, 32),
                f"{a}.o_proj.weight": t(32, 32), f"{m}.gate_proj.weight": t(64, 32),
                f"{m}.up_proj.weight": t(64, 32), f"{m}.down_proj.weight": t(32, 64),
                f"model.layers.{k}.input_layernorm.weight": t(32)}
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_the_projections_are_quantized_by_the_reference_and_the_rest_kept():
    state = decoder()
    quantized = dict(quantize_named(state.items(), "fp8_per_channel"))
    projections = [n for n in state if n.endswith("_proj.weight")]
    assert len(projections) == 2 * 7
    for name in projections:
        ref = vllm_per_channel(state[name])
        scale = quantized[name.removesuffix("weight") + "weight_scale"]
        assert quantized[name].dtype == FP8 and quantized[name].shape == state[name].shape
        assert torch.equal(as_bytes(quantized[name]), as_bytes(ref.weight))
        assert scale.dtype == torch.float32 and torch.equal(scale, ref.scale)
    for name in state.keys() - set(projections):
        assert quantized[name] is state[name]  # embeddings, LM head, norms, biases: as given
    assert len(quantized) == len(state) + len(projections)


def test_per_row_scales_make_the_engines_stacked_bytes_from_the_checkpoints_tensors():
    """vLLM quantizes q/k/v stacked into one layer; per-row scales make that the stack of
    each tensor's own quantization, which is all a trainer sees."""
    state = decoder()
    p = "model.layers.0.self_attn"
    stacked = vllm_per_channel(torch.cat([state[f"{p}.{x}_proj.weight"] for x in "qkv"]))
    quantized, _ = split_quantized(quantize_named(state.items(), "fp8_per_channel"))
    parts = [quantized[f"{p}.{x}_proj"] for x in "qkv"]
    assert torch.equal(as_bytes(torch.cat([q.weight for q in parts])), as_bytes(stacked.weight))
    assert torch.equal(torch.cat([q.scale for q in parts]), stacked.scale)


def test_what_an_engine_checks_a_quantized_version_against_is_what_the_trainer_makes():
    state = decoder()
    bf16 = from_tensors(state.items(), "the checkpoint")
    quantized = quantize_named(state.items(), "fp8_per_channel")
    assert quantized_specs(bf16.specs) == from_tensors(quantized, "v").specs
    assert from_tensors(stand_ins(state.items()), "declared").specs == \
        from_tensors(quantized, "v").specs


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_projection_not_in_bf16_is_left_unquantized_so_an_engines_check_refuses_it(dtype):
    state = decoder()
    name = "model.layers.0.mlp.down_proj.weight"
    state[name] = state[name].to(dtype)
    quantized = dict(quantize_named(state.items(), "fp8_per_channel"))
    assert quantized[name].dtype == dtype
    assert name.removesuffix("weight") + "weight_scale" not in quantized
    engine = from_tensors(quantize_named(decoder().items(), "fp8_per_channel"), "engine")
    assert f"tensor {name!r} is {str(dtype).removeprefix('torch.')}" in \
        engine.refusal(2, quantized.items())


def test_split_names_each_module_once_with_its_scale():
    state = decoder()
    quantized, rest = split_quantized(quantize_named(state.items(), "fp8_per_channel"))
    assert set(quantized) == {n.removesuffix(".weight") for n in state
                              if n.endswith("_proj.weight")}
    assert dict(rest).keys() == {n for n in state if not n.endswith("_proj.weight")}
    with pytest.raises(KeyError, match="weight_scale"):
        split_quantized([("a.q_proj.weight", quantized["model.layers.0.self_attn.q_proj"].weight)])


def test_a_recipe_without_a_layout_is_refused_with_the_ones_there_are():
    with pytest.raises(ValueError, match="fp8_per_channel"):
        quantized_model("policy", "fp8_per_tensor")
    assert recipe_of("policy@fp8_per_channel") == "fp8_per_channel"
    assert recipe_of("org/model-1.5@v2") is None and recipe_of("policy") is None


def test_a_trainer_publishes_each_version_quantized_once_beside_it(coordinator):
    states = [decoder(seed) for seed in (1, 2)]
    model = quantized_model("policy", "fp8_per_channel")
    with Publisher(coordinator.address, "policy", transport="zmq",
                   quantize=["fp8_per_channel"]) as pub, \
            Replica(coordinator.address, model, transport="zmq", name="fp8") as reader:
        for version, state in enumerate(states, 1):
            assert pub.publish(state) == version
            assert pub.quantized["fp8_per_channel"].version == version
            reader.pull(version)
            got = reader.tensors
            want = dict(quantize_named(state.items(), "fp8_per_channel"))
            assert got.keys() == want.keys()
            assert all(torch.equal(as_bytes(got[n]), as_bytes(want[n])) for n in want)
        assert set(pub.owners) == {"policy", model}  # (a resumed trainer keeps both)
        bf16 = sum(t.nbytes for t in states[-1].values())
        fp8 = sum(t.nbytes for t in want.values())
        assert fp8 < 0.7 * bf16  # (embeddings and LM head stay bf16 in this small model)


def test_a_sharded_trainer_cannot_quantize_its_parts(coordinator):
    with pytest.raises(ValueError, match="sharded"):
        Publisher(coordinator.address, "policy", part=0, parts=2, quantize=["fp8_per_channel"])


def refused(call) -> str:
    with pytest.raises(CoordinatorError) as refusal:
        call()
    assert refusal.value.code == "unauthorized"
    return str(refusal.value)


@pytest.mark.parametrize("companion", ["policy@fp8_per_channel", "policy.patch"])
def test_only_the_models_trainer_publishes_or_declares_its_companions(coordinator, companion):
    """Engines take a model's quantized layout (and its patches) as its trainer's bytes: no
    other trainer may publish or declare one, before the model is out or after."""
    state = decoder()
    with Publisher(coordinator.address, companion, name="stranger", transport="zmq") as other, \
            Publisher(coordinator.address, "policy", transport="zmq") as trainer:
        assert "only the trainer that publishes 'policy'" in refused(lambda: other.publish(state))
        assert "only the trainer that declares" in refused(lambda: other.declare(state))
        trainer.publish(state)
        assert "only the trainer that publishes 'policy'" in refused(lambda: other.publish(state))


def test_closing_waits_for_the_replicas_that_follow_the_quantized_layout(coordinator):
    """A reader of the quantized layout alone, one version behind when the trainer closes:
    the trainer waits for it to hold the newest (else that version is gone with it)."""
    states = [decoder(seed) for seed in (1, 2)]
    with Replica(coordinator.address, quantized_model("policy", "fp8_per_channel"),
                 transport="zmq", name="fp8") as reader:
        pub = Publisher(coordinator.address, "policy", transport="zmq",
                        quantize=["fp8_per_channel"])
        pub.publish(states[0])
        reader.pull(1)
        pub.publish(states[1])
        late = threading.Timer(0.5, reader.pull, args=(2,))
        late.start()
        pub.close()
        late.join()
        assert reader.version == 2


def test_an_engine_follows_the_layout_only_while_it_keeps_up_with_its_model(coordinator):
    settings = EngineSettings(coordinator=coordinator.address, model="policy")
    companion = quantized_model("policy", "fp8_per_channel")

    def follows(cannot: str | None = None) -> str:
        return followed_model(settings, "fp8_per_channel", lambda: cannot)

    assert follows() == "policy"  # nothing published yet
    with Publisher(coordinator.address, "policy", transport="zmq",
                   quantize=["fp8_per_channel"]) as pub:
        pub.declare(decoder())
        assert follows() == companion
        pub.publish(decoder(1))
        assert follows() == companion
        assert follows("it is TP=2") == "policy"
        pub.quantized.clear()  # (a trainer that goes on without quantizing)
        pub.publish(decoder(2))
        assert follows() == "policy"  # its layout is a version behind: left over
