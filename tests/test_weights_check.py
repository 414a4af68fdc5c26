"""A version an engine cannot load is refused before the model is touched: its tensors'
names, shapes and dtypes are compared with what the engine loads (the checkpoint it
started from, then the last version it applied)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tensorhub import Publisher, TensorHubError
from tensorhub.engines.checkpoint_copy import CheckpointCopy
from tensorhub.engines.weights_check import (
    from_checkpoint,
    from_tensors,
    tied_optional,
)

STATE = {"model.embed_tokens.weight": torch.zeros(16, 4),
         "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 4),
         "model.norm.weight": torch.zeros(4)}


def with_changes(**changes) -> dict[str, torch.Tensor]:
    state = dict(STATE)
    state.update(changes)
    return state


def test_a_checkpoint_folder_is_read_from_its_headers(tmp_path):
    save_file(STATE, str(tmp_path / "model.safetensors"))
    loadable = from_checkpoint(tmp_path)
    assert loadable.specs == {"model.embed_tokens.weight": ("float32", (16, 4)),
                              "model.layers.0.mlp.up_proj.weight": ("float32", (8, 4)),
                              "model.norm.weight": ("float32", (4,))}
    assert from_checkpoint(tmp_path / "absent") is None


def test_a_folder_without_weights_gives_nothing_to_check_against(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert from_checkpoint(tmp_path) is None


@pytest.mark.parametrize(("state", "said"), [
    ({**STATE, "model.layers.0.value_head.weight": torch.zeros(1, 4)},
     "tensor 'model.layers.0.value_head.weight' is not in the engine's model"),
    (with_changes(**{"model.norm.weight": torch.zeros(5)}),
     "tensor 'model.norm.weight' has shape [5], the engine's model [4]"),
    (with_changes(**{"model.norm.weight": torch.zeros(4, dtype=torch.float16)}),
     "tensor 'model.norm.weight' is float16, the engine's model loads float32"),
    ({k: v for k, v in STATE.items() if k != "model.norm.weight"},
     "tensor 'model.norm.weight' is missing"),
])
def test_a_version_unlike_the_model_is_refused_naming_the_tensor(state, said):
    reason = from_tensors(STATE.items(), "the checkpoint").refusal(7, state.items())
    assert reason == f"v7 does not fit the engine's model (the checkpoint): {said}"


def test_a_tied_lm_head_may_come_or_not():
    class Config:
        tie_word_embeddings = True

    loadable = from_tensors(STATE.items(), "the checkpoint", tied_optional(Config()))
    assert loadable.refusal(2, {**STATE, "lm_head.weight": torch.zeros(16, 4)}.items()) is None
    assert loadable.refusal(2, STATE.items()) is None


def test_a_copy_refuses_an_unloadable_version_and_takes_the_next(coordinator):
    """The refusal comes before the engine's load function runs; the copy moves on to the
    next version, which it applies; what it applied becomes what it checks against."""
    holder = CheckpointCopy(coordinator.address, "policy", "engine", transport="zmq",
                            follow=False)
    holder.loadable = from_tensors(STATE.items(), "the checkpoint")
    try:
        with Publisher(coordinator.address, "policy", transport="zmq", min_replicas=0) as pub:
            bad = pub.publish({**STATE, "model.norm.weight": torch.ones(5)})
            assert holder.pull(bad) == bad
            with pytest.raises(TensorHubError, match="has shape \\[5\\]") as err:
                holder.check(bad)
            assert err.value.code == "unloadable"
            loaded = []
            with pytest.raises(TensorHubError, match="has shape \\[5\\]"), \
                    holder.tensors_of(bad) as named:
                loaded.append(named)
            assert loaded == [] and holder.refused == bad
            assert holder.unloadable["version"] == bad
            good = pub.publish(with_changes(**{"model.norm.weight": torch.ones(4)}))
            assert holder.pull(good) == good
            with holder.tensors_of(good) as named:
                assert torch.equal(dict(named)["model.norm.weight"], torch.ones(4))
            assert holder.applied == good
            assert holder.loadable.source == f"v{good}, the last version it applied"
    finally:
        holder.close()


def test_a_copy_a_late_read_landed_in_is_verified_again_before_it_is_applied(
        coordinator, monkeypatch):
    """A read given up that completes later writes into the copy after it was verified:
    the copy is checked again before the engine applies it, and refused if it is torn."""
    from tensorhub.core.transport.base import Transport

    holder = CheckpointCopy(coordinator.address, "policy", "engine", transport="zmq",
                            follow=False)
    try:
        with Publisher(coordinator.address, "policy", transport="zmq", min_replicas=0) as pub:
            v = pub.publish(STATE)
            holder.pull(v)
            late = [0]
            monkeypatch.setattr(Transport, "late_reads", property(lambda self: late[0]))
            late[0] = 1  # landed, but the same bytes: applied as verified
            with holder.tensors_of(v) as named:
                assert len(named) == len(STATE)
            late[0] = 2  # landed, and tore a tensor
            holder.replica.replicas[0].layout.item_bytes[0][0] ^= 0xFF
            with pytest.raises(TensorHubError, match="torn or stale bytes"), \
                    holder.tensors_of(v):
                pass
            assert holder.version is None
    finally:
        holder.close()


def test_what_an_engine_loads_can_be_a_published_versions_manifest(coordinator):
    """An engine that applied a version another way (SGLang's native path) checks later
    versions against that version's published tensors."""
    holder = CheckpointCopy(coordinator.address, "policy", "engine", transport="zmq",
                            follow=False)
    try:
        with Publisher(coordinator.address, "policy", transport="zmq", min_replicas=0) as pub:
            v = pub.publish(STATE)
            assert holder.loadable_as(v, set()).specs == from_tensors(STATE.items(), "").specs
            assert holder.loadable_as(v + 5, set()) is None
    finally:
        holder.close()
