"""A version in tiles whose K/V projections are split by K/V head, in parts of their own
(`TiledPublisher(kv_heads=)`): a node whose ranks share a head with another node's pulls
its own tiles and that head's K/V rows, not the other node's tiles."""

from __future__ import annotations

import pytest
import torch

from tensorhub.coordinator.parts import check_parts_fit
from tensorhub.core.data_types import Manifest, Publish
from tensorhub.core.layout import manifest_of
from tensorhub.tiles import KV, heads_of, manifests, node_share, tile
from tensorhub_testing.tiled_nodes import HIDDEN, held_by, llama_state, two_nodes_and_a_whole_reader

K = "model.layers.0.self_attn.k_proj.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


def by_head(tiles: int, kv_heads: int | None) -> Manifest:
    """Part 0's manifest of a version in `tiles` tiles, its K/V by `kv_heads` heads."""
    return Manifest(tensors=[], compact_threshold=0, tiles=tiles, kv_heads=kv_heads)


def test_each_kv_head_lies_in_a_part_of_its_own_after_the_whole_part():
    state = llama_state(0)
    parts = tile(state.items(), 4, kv_heads=2)
    assert len(parts) == 4 + 1 + 2
    for k in range(4):
        assert not any(KV.search(n) for n, _ in parts[k].tensors)
        assert parts[k].rows[Q] == (k * HIDDEN // 4, HIDDEN)
    for h in range(2):
        tensors = dict(parts[5 + h].tensors)
        assert set(tensors) == {n for n in state if KV.search(n)}
        assert parts[5 + h].rows[K] == (h * HIDDEN // 2, HIDDEN)
        assert torch.equal(tensors[K], state[K][h * HIDDEN // 2:(h + 1) * HIDDEN // 2])
    check_parts_fit(manifests(state.items(), 4, kv_heads=2))


def test_as_many_kv_heads_as_tiles_keep_the_plain_layout():
    """The tiles then end on heads already: no part of their own."""
    assert len(tile(llama_state(0).items(), 4, kv_heads=4)) == 5
    assert {m.kv_heads for m in manifests(llama_state(0).items(), 4, kv_heads=8)} == {None}
    with pytest.raises(ValueError, match="kv_heads: at least 1, not 0"):
        tile(llama_state(0).items(), 4, kv_heads=0)


def test_a_kv_slice_out_of_its_heads_part_does_not_fit():
    found = manifests(llama_state(0).items(), 4, kv_heads=2)
    half = HIDDEN // 2
    with pytest.raises(ValueError, match=fr"part 6 holds 0\.\.{half} of {HIDDEN}, not K/V "
                                         fr"head 1 of 2"):
        check_parts_fit([*found[:5], found[6], found[5]])
    with pytest.raises(ValueError, match="4 tiles make 7 parts, not 5"):
        check_parts_fit(found[:5])
    plain = manifests(llama_state(0).items(), 4)
    with pytest.raises(ValueError, match="disagree on the tiles or the K/V heads"):
        check_parts_fit(plain[:4] + found[4:])


def parts_of(held: dict[int, tuple[int, int]]) -> list[Manifest]:
    """The 7 parts of a version in 4 tiles with 2 K/V heads whose only sliced tensor `w`
    (4 rows) has rows `held[part]` in the parts named; a norm in the whole part."""
    w = torch.randn(4, 2)
    out = []
    for r in range(7):
        named = [("w", w[slice(*held[r])])] if r in held else []
        rows = {"w": (held[r][0], 4)} if r in held else None
        if r == 4 and r not in held:
            named = [("n", torch.zeros(2))]
        out.append(manifest_of(named, rows=rows, tiles=4, kv_heads=2))
    return out


def test_a_tensor_split_over_tiles_and_heads_at_once_does_not_fit():
    check_parts_fit(parts_of({0: (0, 1), 1: (1, 2), 2: (2, 3), 3: (3, 4)}))
    check_parts_fit(parts_of({5: (0, 2), 6: (2, 4)}))
    with pytest.raises(ValueError, match="split over tiles and over K/V heads at once"):
        check_parts_fit(parts_of({0: (0, 1), 1: (1, 2), 6: (2, 4)}))
    with pytest.raises(ValueError, match="a slice in part 4, which holds what every rank"):
        check_parts_fit(parts_of({4: (0, 4)}))


def test_a_kv_projection_sliced_over_tiles_in_a_version_by_head_does_not_fit():
    """A node pulls its heads' K/V from their parts: K/V rows in the tiles would reach
    some of its ranks as holes."""
    tiled = manifests(llama_state(0).items(), 4)
    w = torch.zeros(4, 2)  # (what two parts of heads may hold)
    heads = [manifest_of([("w", w[2 * h:2 * h + 2])], rows={"w": (2 * h, 4)}, tiles=4,
                         kv_heads=2) for h in range(2)]
    claimed = [m.model_copy(update={"kv_heads": 2}) for m in tiled]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' "
                                         r"is a K/V projection of a version split by K/V head: "
                                         r"its rows lie in the K/V parts 5\.\.6"):
        check_parts_fit(claimed + heads)


def test_kv_biases_and_a_fused_qkv_stay_out_of_the_heads_parts():
    state = llama_state(0)
    state["model.layers.0.self_attn.k_proj.bias"] = torch.randn(HIDDEN)
    state["model.layers.1.self_attn.qkv_proj.weight"] = torch.randn(3 * HIDDEN, HIDDEN)
    parts = tile(state.items(), 4, kv_heads=2)
    whole = dict(parts[4].tensors)
    assert "model.layers.0.self_attn.k_proj.bias" in whole
    assert all("qkv_proj" not in n and not n.endswith(".bias")
               for p in parts[5:] for n, _ in p.tensors)
    check_parts_fit(manifests(state.items(), 4, kv_heads=2))


def test_kv_heads_with_no_kv_projection_to_split_are_refused_before_any_part():
    """A fused-qkv checkpoint has nothing to split by head: its head parts would be empty,
    and an empty part cannot be published."""
    state = {n.replace("k_proj", "kv_fused"): t for n, t in llama_state(0).items()
             if "v_proj" not in n}
    with pytest.raises(ValueError, match=r"kv_heads=2: no K/V projection .* splits into 2 "
                                         r"heads by rows"):
        tile(state.items(), 4, kv_heads=2)


def test_a_publish_names_the_parts_of_its_heads():
    manifest = manifests(llama_state(0).items(), 4, kv_heads=2)[0]
    with pytest.raises(ValueError, match="4 tiles with its K/V by head is published in 7"):
        Publish(worker_id="t", model="m", version=1, manifest=manifest, checksums=[],
                memory=[], parts=5)
    with pytest.raises(ValueError, match="K/V heads in parts of their own: only in a version"):
        Manifest(tensors=[], compact_threshold=0, kv_heads=2)


def test_the_heads_a_node_loads():
    assert heads_of([2, 3], tp=8, kv_heads=2) == {0}  # (4 ranks per head)
    assert heads_of([4, 5], tp=8, kv_heads=2) == {1}
    assert heads_of([1], tp=2, kv_heads=4) == {2, 3}  # (2 heads per rank)
    assert heads_of([0], tp=3, kv_heads=2) is None


def test_a_node_whose_ranks_share_a_head_pulls_its_tiles_and_the_heads_kv():
    """TP=8 over 4 nodes of 2 ranks and 2 K/V heads: the node of ranks 2 and 3 pulls its
    own tiles and head 0's K/V part, where a version without K/V parts costs it ranks 0-3's
    tiles."""
    share = node_share([2, 3], 8, kv_heads=2)
    assert share(11, by_head(8, 2)) == {2, 3, 8, 9}
    assert node_share([4, 5], 8, kv_heads=2)(11, by_head(8, 2)) == {4, 5, 8, 10}
    assert share(9, by_head(8, None)) == {0, 1, 2, 3, 8}
    # an engine that cannot say its heads takes the version's; one whose heads differ, all
    assert node_share([2, 3], 8)(11, by_head(8, 2)) == {2, 3, 8, 9}
    assert node_share([2, 3], 8, kv_heads=4)(13, by_head(8, 4)) == {2, 3, 8, 10}
    assert node_share([2, 3], 8, kv_heads=1)(11, by_head(8, 2)) == set(range(11))


def test_a_node_spanning_several_heads_pulls_each_heads_kv():
    """TP=8 with 4 K/V heads over 2 nodes of 4 ranks: 2 ranks per head, 2 heads a node; and
    TP=2 with 4 heads: each rank loads 2 heads."""
    assert node_share([0, 1, 2, 3], 8, kv_heads=4)(13, by_head(8, 4)) == {0, 1, 2, 3, 8, 9, 10}
    assert node_share([4, 5, 6, 7], 8, kv_heads=4)(13, by_head(8, 4)) == {4, 5, 6, 7, 8, 11, 12}
    assert node_share([1], 2, kv_heads=4)(9, by_head(4, None)) == {2, 3, 4}


@pytest.mark.slow
def test_nodes_sharing_a_head_pull_their_tiles_and_its_kv(coordinator):
    """TP=2 over two nodes of one rank and one K/V head, 4 tiles: each node pulls its two
    tiles, the norms and the K/V, and holds the trainer's bytes there; a reader of every
    part gets every tensor back whole."""
    shares = [node_share([rank], 2, kv_heads=1) for rank in (0, 1)]
    with two_nodes_and_a_whole_reader(coordinator.address, shares, tiles=4,
                                      kv_heads=1) as (trainer, node0, node1, whole):
        state = llama_state(1)
        assert trainer.publish(state) == 1
        for reader in (whole, node0, node1):
            assert reader.pull(1, timeout=60) == 1
        assert all(torch.equal(whole.tensors[n], state[n]) for n in state)
        parts = [sum(t.numel() * t.element_size() for _, t in p.tensors)
                 for p in tile(state.items(), 4, kv_heads=1)]
        for rank, node in enumerate((node0, node1)):
            pulled = sum(r.last_pull.nbytes for r in node.replicas if r.last_pull)
            assert pulled == parts[2 * rank] + parts[2 * rank + 1] + parts[4] + parts[5]
            tensors = node.tensors
            assert torch.equal(tensors[K], state[K])
            half = HIDDEN // 2
            assert torch.equal(tensors[Q][rank * half:(rank + 1) * half],
                               state[Q][rank * half:(rank + 1) * half])
            assert tensors[Q][(1 - rank) * half].isnan().all()
        held = held_by(coordinator.address, "policy", ["node0", "node1"])
        assert all(1 in held[n] for n in ("node0", "node1")), held
