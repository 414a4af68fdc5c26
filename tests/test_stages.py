"""A version in layer blocks (`tensorhub/stages.py`): each pipeline stage of an engine pulls
the parts its layers are in, the trainer's bytes; a reader of every part has the model."""

from __future__ import annotations

import pytest
import torch

from tensorhub import PartedReplica, Publisher
from tensorhub.coordinator.parts import check_parts_fit
from tensorhub.core.data_types import Manifest
from tensorhub.core.layer_blocks import even_edges, part_of, pp_layers, stage_edges
from tensorhub.core.layout import manifest_of
from tensorhub.engines.weights_check import from_tensors
from tensorhub.stages import LayeredPublisher, split, stage_share
from tensorhub_testing.tiled_nodes import held_by, llama_state


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def in_blocks(blocks: int | None, layers: int = 4) -> Manifest:
    """Part 0's manifest of a version in `blocks` equal layer blocks, as a share is asked."""
    return Manifest(tensors=[], compact_threshold=0,
                    blocks=None if blocks is None else even_edges(layers, blocks))


def test_each_block_holds_its_layers_and_the_ends_hold_the_embeddings_and_the_head():
    state = llama_state(0, layers=4)
    state["lm_head.weight"] = torch.zeros(8, 4)
    parts, edges = split(state.items(), blocks=2)
    assert edges == [0, 2, 4] and len(parts) == 4
    names = [[n for n, _ in part] for part in parts]
    assert names[0] == ["model.embed_tokens.weight"]
    assert {n.split(".")[2] for n in names[1]} == {"0", "1"}
    assert {n.split(".")[2] for n in names[2]} == {"2", "3"}
    assert names[3] == ["model.norm.weight", "lm_head.weight"]
    assert sorted(n for part in names for n in part) == sorted(state)


def test_layers_go_to_the_block_their_place_falls_in():
    edges = even_edges(7, 3)
    assert edges == [0, 2, 4, 7]
    assert [part_of(f"model.layers.{i}.mlp.up_proj.weight", edges) for i in range(7)] == \
        [1, 1, 2, 2, 3, 3, 3]
    assert part_of("model.language_model.layers.6.input_layernorm.weight", edges) == 3
    assert part_of("model.embed_tokens.weight", edges) == 0
    assert part_of("model.visual.blocks.0.weight", edges) == 0  # (outside the decoder)
    assert part_of("model.norm.weight", edges) == part_of("lm_head.weight", edges) == 4


def test_the_default_blocks_end_where_the_engines_stages_do():
    """vLLM's and SGLang's stages of Llama-3.1-405B's 126 layers: PP=2 [63, 63], PP=4
    [31, 32, 32, 31], PP=8 [15, 16, 16, 16, 16, 16, 16, 15]; the blocks' edges are theirs."""
    assert [len(pp_layers(126, s, 4)) for s in range(4)] == [31, 32, 32, 31]
    assert [len(pp_layers(126, s, 8)) for s in range(8)] == [15, 16, 16, 16, 16, 16, 16, 15]
    assert stage_edges(126) == [0, 15, 31, 47, 63, 79, 95, 111, 126]
    assert stage_edges(4) == [0, 1, 2, 3, 4]  # (PP=8 left out: more stages than layers)
    for stages in (2, 4, 8):
        for s in range(stages):
            layers = pp_layers(126, s, stages)
            assert layers.start in stage_edges(126) and layers.stop in stage_edges(126)


def test_a_state_without_layers_or_with_more_blocks_than_layers_is_refused():
    with pytest.raises(ValueError, match="no decoder layer"):
        split([("model.norm.weight", torch.ones(2))], 2)
    with pytest.raises(ValueError, match="1 to the decoder's 2 layers, not 3"):
        split(llama_state(0, layers=2).items(), 3)
    with pytest.raises(ValueError, match="layer block edges rise from 0"):
        Manifest(tensors=[], compact_threshold=0, blocks=[0, 2, 2])


def test_a_stage_pulls_the_parts_of_the_layers_it_runs():
    """vLLM's parameter names at PP=2 of a 4-layer model: stage 0 runs the embeddings and
    layers 0-1, stage 1 layers 2-3 and the head."""
    first = stage_share(["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                         "model.layers.1.mlp.gate_up_proj.weight"])
    last = stage_share(["model.layers.2.mlp.down_proj.weight",
                        "model.layers.3.input_layernorm.weight", "model.norm.weight",
                        "lm_head.weight"])
    assert first(6, in_blocks(4)) == {0, 1, 2}
    assert last(6, in_blocks(4)) == {3, 4, 5}
    assert first(4, in_blocks(2)) == {0, 1} and last(4, in_blocks(2)) == {2, 3}
    assert first(3, in_blocks(1)) == {0, 1} and last(3, in_blocks(1)) == {1, 2}  # (one block)
    assert first(3, in_blocks(None)) == {0, 1, 2}  # (a version not in blocks: every part)


def test_a_last_stage_whose_head_is_tied_pulls_the_embeddings_too():
    tied = stage_share(["model.embed_tokens.weight", "model.layers.3.mlp.up_proj.weight",
                        "model.norm.weight"])
    assert tied(6, in_blocks(4)) == {0, 4, 5}


def test_a_stage_that_runs_layers_a_version_lacks_refuses_it():
    """A 2-layer version to a stage that runs layers 2-3 of 4: it pulls part 0 too, where
    the names of its missing layers fall, so its check finds them missing."""
    edges = even_edges(2, 2)
    share = stage_share(["model.layers.2.mlp.up_proj.weight",
                         "model.layers.3.mlp.up_proj.weight", "model.norm.weight"])
    assert share(4, Manifest(tensors=[], compact_threshold=0, blocks=edges)) == {0, 3}
    held = from_tensors(llama_state(0, layers=4).items(), "the checkpoint").only(
        lambda n: part_of(n, edges) in (0, 3))
    version = {n: t for n, t in llama_state(1, layers=2).items() if part_of(n, edges) in (0, 3)}
    refusal = held.refusal(6, version.items())
    assert "tensor 'model.layers.2.input_layernorm.weight' is missing" in refusal


def test_the_coordinator_refuses_a_layer_past_the_versions_blocks():
    parts, edges = split(llama_state(0, layers=4).items(), 2)
    parts[0].append(("model.layers.7.mlp.up_proj.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match="is of layer 7, past the 4 layers"):
        check_parts_fit([manifest_of(p, blocks=edges) for p in parts])


def test_the_coordinator_refuses_a_part_that_holds_another_blocks_tensor():
    parts, edges = split(llama_state(0, layers=4).items(), 2)
    check_parts_fit([manifest_of(p, blocks=edges) for p in parts])
    parts[1].append(parts[2].pop())
    with pytest.raises(ValueError, match="is in part 1 of a version in layer blocks, not "
                                         "in part 2"):
        check_parts_fit([manifest_of(p, blocks=edges) for p in parts])


def test_a_stage_checks_only_the_tensors_of_its_share():
    state = llama_state(0, layers=4)
    loadable = from_tensors(state.items(), "the checkpoint")
    edges = even_edges(4, 2)
    mine = {n: t for n, t in state.items() if part_of(n, edges) in (0, 1)}
    assert loadable.refusal(5, mine.items()) is not None  # (the other stage's are missing)
    held = loadable.only(lambda n: part_of(n, edges) in (0, 1))
    assert held.refusal(5, mine.items()) is None
    del mine["model.layers.1.mlp.up_proj.weight"]
    assert "'model.layers.1.mlp.up_proj.weight' is missing" in held.refusal(5, mine.items())


@pytest.mark.slow
def test_stages_pull_their_layers_and_a_whole_reader_gets_the_trainers_tensors(coordinator):
    """PP=2 of a 4-layer model, 2 blocks: each stage pulls its half of the layers and its
    end, and holds the trainer's bytes; a reader of every part gets every tensor; the
    coordinator counts each stage as holding the version; all follow a second version."""
    shares = [stage_share(["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                           "model.layers.1.mlp.up_proj.weight"]),
              stage_share(["model.layers.2.mlp.up_proj.weight",
                           "model.layers.3.mlp.up_proj.weight", "model.norm.weight"])]
    with LayeredPublisher(coordinator.address, "policy", blocks=2, transport="auto") as trainer, \
            PartedReplica(coordinator.address, "policy", name="stage0", transport="auto",
                          share=shares[0]) as stage0, \
            PartedReplica(coordinator.address, "policy", name="stage1", transport="auto",
                          share=shares[1]) as stage1, \
            PartedReplica(coordinator.address, "policy", name="whole",
                          transport="auto") as whole:
        for version in (1, 2):
            state = llama_state(version, layers=4)
            parts, _ = split(state.items(), 2)
            assert trainer.publish(state) == version
            for reader in (whole, stage0, stage1):
                assert reader.pull(version, timeout=60) == version
            assert whole.tensors.keys() == state.keys()
            assert all(torch.equal(whole.tensors[n], t) for n, t in state.items())
            for stage, mine in ((stage0, parts[0] + parts[1]), (stage1, parts[2] + parts[3])):
                assert stage.partial
                pulled = sum(r.last_pull.nbytes for r in stage.replicas if r.last_pull)
                assert pulled == nbytes(mine)
                got = stage.tensors
                assert got.keys() == {n for n, _ in mine}
                assert all(torch.equal(got[n], t) for n, t in mine)
            held = held_by(coordinator.address, "policy", ["stage0", "stage1"])
            assert all(version in held[n] for n in ("stage0", "stage1")), held


@pytest.mark.slow
def test_a_stage_follows_versions_in_blocks_and_whole_ones_in_turn(coordinator):
    share = stage_share(["model.layers.2.mlp.up_proj.weight",
                         "model.layers.3.mlp.up_proj.weight", "model.norm.weight"])
    with LayeredPublisher(coordinator.address, "policy", blocks=2, transport="auto") as layered, \
            PartedReplica(coordinator.address, "policy", name="stage1", transport="auto",
                          share=share) as stage:
        assert layered.publish(llama_state(1, layers=4)) == 1
        plain = Publisher(coordinator.address, "policy", name="plain", transport="auto",
                          owners=layered.parts[0].owners)  # (part 0 is bound to block 0's)
        try:
            for version, publisher in ((1, layered), (2, plain), (3, layered)):
                state = llama_state(version, layers=4)
                if version > 1:
                    assert publisher.publish(state) == version
                assert stage.pull(version, timeout=60) == version
                assert stage.partial == (publisher is layered)
                want = {n for n in state if part_of(n, even_edges(4, 2)) in (2, 3)} \
                    if publisher is layered else set(state)
                assert stage.tensors.keys() == want
                assert all(torch.equal(stage.tensors[n], state[n]) for n in want)
                assert all(stage.holds(n) == (n in want) for n in state)
        finally:
            plain.close()
