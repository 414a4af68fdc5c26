"""A mixture of experts in tiles (`tensorhub/tiles.py`, `core/experts.py`): split as a dense
MLP for tensor-parallel engines, or each expert whole in the tile of the ranks that run it
for expert-parallel ones; a node pulls its ranks' tiles either way, the coordinator refuses
experts out of their place, and a node whose engine loads the other way pulls every tile."""

from __future__ import annotations

import pytest
import torch

from tensorhub.coordinator.parts import check_parts_fit
from tensorhub.core.experts import expert_of
from tensorhub.core.layout import manifest_of
from tensorhub.tiles import NodeExperts, manifests, node_share, split_dim, tile
from tensorhub_testing.tiled_nodes import moe_state, two_nodes_and_a_whole_reader

UP = "model.layers.1.mlp.experts.{}.up_proj.weight"


def placed(state: dict[str, torch.Tensor], tiles: int) -> list:
    return manifests(state.items(), tiles, experts="placed")


def test_placed_experts_lie_whole_in_the_tile_of_the_ranks_that_run_them():
    """8 experts in 4 tiles: tile t holds experts 2t and 2t + 1 whole; attention and the
    shared expert are split as ever; the router lies whole in the last part."""
    state = moe_state(0, experts=8)
    parts = tile(state.items(), 4, experts="placed")
    for t, part in enumerate(parts[:4]):
        tensors = dict(part.tensors)
        experts = sorted({int(n.split(".experts.")[1].split(".")[0])
                          for n in tensors if ".experts." in n})
        assert experts == [2 * t, 2 * t + 1]
        assert torch.equal(tensors[UP.format(2 * t)], state[UP.format(2 * t)])
        assert "model.layers.1.mlp.shared_expert.up_proj.weight" in part.rows
        assert not any(".experts." in n for n in (*part.rows, *part.cols))
    assert "model.layers.1.mlp.gate.weight" in dict(parts[4].tensors)
    check_parts_fit(placed(state, 4))


def test_split_experts_are_tiled_as_a_dense_mlp():
    state = moe_state(0, experts=4)
    parts = tile(state.items(), 2)
    assert parts[1].rows[UP.format(3)] == (64, 128)
    assert parts[0].cols["model.layers.0.mlp.experts.2.down_proj.weight"] == (0, 128)
    said = manifests(state.items(), 2)
    assert {m.experts for m in said} == {"split"}
    check_parts_fit(said)


def test_experts_that_do_not_divide_into_the_tiles_lie_in_the_last_part():
    state = moe_state(0, experts=6)
    parts = tile(state.items(), 4, experts="placed")
    assert UP.format(5) in dict(parts[4].tensors)
    assert not any(".experts." in n for part in parts[:4] for n, _ in part.tensors)
    check_parts_fit(placed(state, 4))


def test_a_dense_model_says_nothing_of_experts():
    dense = {"model.layers.0.mlp.up_proj.weight": torch.zeros(8, 8),
             "model.norm.weight": torch.zeros(8)}
    said = manifests(dense.items(), 2, experts="placed")
    assert {m.experts for m in said} == {None}
    check_parts_fit(said)


def test_routers_and_their_biases_are_not_experts_and_lie_whole():
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.shared_expert_gate.weight",
                 "model.layers.0.mlp.gate.e_score_correction_bias",
                 "model.layers.0.block_sparse_moe.gate.weight"):
        assert expert_of(name) is None and split_dim(name) is None, name
    assert expert_of("model.layers.3.mlp.experts.7.down_proj.weight_scale_inv") == (
        "model.layers.3.mlp.experts.", 7)


def test_a_version_in_tiles_that_does_not_say_how_its_experts_lie_is_refused():
    """An expert-parallel node could not tell which tiles its experts are in."""
    unsaid = [manifest_of(p.tensors, rows=p.rows, cols=p.cols, tiles=2)
              for p in tile(moe_state(0, experts=4).items(), 2)]
    with pytest.raises(ValueError, match=r"is a routed expert's: a version in tiles with "
                                         r"experts says how they are laid out"):
        check_parts_fit(unsaid)


def test_an_expert_out_of_its_tile_is_refused():
    said = placed(moe_state(0, experts=4), 2)
    moved = [m.model_copy(deep=True) for m in said]
    expert = next(s for s in moved[1].tensors if s.name == UP.format(3))
    moved[1].tensors.remove(expert)
    moved[0].tensors.append(expert)
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight' is whole in part 0; "
                                         r"with the experts placed it lies whole in part 1"):
        check_parts_fit(moved)


def test_a_whole_tensor_in_a_tile_is_refused():
    """A node pulls only its ranks' tiles: a tensor every rank loads, put in tile 0, would
    be missed by the other node, which would keep its old bytes."""
    norm, w = torch.zeros(8), torch.zeros(8, 8)
    parts = [manifest_of([("model.norm.weight", norm),
                          ("model.layers.0.mlp.up_proj.weight", w[:4])], tiles=2,
                         rows={"model.layers.0.mlp.up_proj.weight": (0, 8)}),
             manifest_of([("model.layers.0.mlp.up_proj.weight", w[4:])], tiles=2,
                         rows={"model.layers.0.mlp.up_proj.weight": (4, 8)}),
             manifest_of([("model.layers.0.input_layernorm.weight", norm)], tiles=2)]
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' is whole in part 0"):
        check_parts_fit(parts)


def test_parts_that_disagree_on_the_experts_are_refused():
    state = moe_state(0, experts=4)
    mixed = placed(state, 2)[:2] + manifests(state.items(), 2)[2:]
    with pytest.raises(ValueError, match="disagree on how the experts are laid out"):
        check_parts_fit(mixed)


def test_an_expert_parallel_node_pulls_its_ranks_tiles_and_their_experts_tiles():
    """TP=EP=4 on 2 nodes, 8 tiles, 16 experts: the node of ranks 2-3 runs experts 8-15,
    in tiles 4-7, its own; with round-robin placement (experts 2, 3, 6, 7, 10, 11, 14, 15)
    it also pulls tiles 1 and 3, where experts 2, 3, 6 and 7 lie."""
    state = moe_state(0, experts=16)
    part0 = placed(state, 8)[0]
    linear = NodeExperts(ids=frozenset(range(8, 16)), total=16)
    assert node_share([2, 3], 4, experts=linear)(9, part0) == {4, 5, 6, 7, 8}
    robin = NodeExperts(ids=frozenset(e for e in range(16) if e % 4 in (2, 3)), total=16)
    assert node_share([2, 3], 4, experts=robin)(9, part0) == {1, 3, 4, 5, 6, 7, 8}


def test_an_engine_that_counts_other_experts_than_the_trainer_pulls_every_part():
    """The trainer placed 4 experts a layer in 2 tiles (part 0 holds experts 0-1); an
    engine that counts 8 would look for experts 4-7 in tile 1."""
    part0 = placed(moe_state(0, experts=4), 2)[0]
    assert node_share([1], 2, experts=NodeExperts(frozenset(range(2, 4)), 4))(3, part0) \
        == {1, 2}
    assert node_share([1], 2, experts=NodeExperts(frozenset(range(4, 8)), 8))(3, part0) \
        == {0, 1, 2}
    assert node_share([1], 2, experts=NodeExperts(frozenset({1}), 3))(3, part0) == {0, 1, 2}


def test_a_node_pulls_every_tile_of_experts_laid_out_for_the_other_kind_of_engine():
    state = moe_state(0, experts=4)
    split, placed_ = manifests(state.items(), 2)[0], placed(state, 2)[0]
    ep = NodeExperts(ids=frozenset({2, 3}), total=4)
    assert node_share([1], 2)(3, split) == {1, 2}
    assert node_share([1], 2)(3, placed_) == {0, 1, 2}  # (a TP rank loads every expert)
    assert node_share([1], 2, experts=ep)(3, split) == {0, 1, 2}
    assert node_share([1], 2, experts=ep)(3, placed_) == {1, 2}


@pytest.mark.slow
def test_expert_parallel_nodes_pull_their_experts_and_hold_the_trainers_bytes(coordinator):
    """TP=EP=2 over two nodes, 2 tiles, 4 experts placed: each node pulls its rank's half
    of the attention and its two experts whole, half the model's tiled bytes, and holds
    the trainer's bytes there; a whole reader gets every tensor back."""
    shares = [node_share([rank], 2, experts=NodeExperts(frozenset({2 * rank, 2 * rank + 1}),
                                                        4)) for rank in (0, 1)]
    with two_nodes_and_a_whole_reader(coordinator.address, shares, tiles=2,
                                      experts="placed") as (trainer, node0, node1, whole):
        state = moe_state(1, experts=4)
        version = trainer.publish(state)
        for reader in (whole, node0, node1):
            assert reader.pull(version, timeout=60) == version
        assert all(torch.equal(whole.tensors[n], t) for n, t in state.items())
        for rank, node in enumerate((node0, node1)):
            tensors = node.tensors
            mine = {2 * rank, 2 * rank + 1}
            for e in range(4):
                assert (UP.format(e) in tensors) == (e in mine), (rank, e)
                if e in mine:
                    assert torch.equal(tensors[UP.format(e)], state[UP.format(e)])
            q = state["model.layers.0.self_attn.q_proj.weight"]
            assert torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"][32 * rank:][:32],
                               q[32 * rank:][:32])
            assert sorted(r.part.part for r in node.replicas) == [rank, 2]
