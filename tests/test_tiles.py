"""A version in tiles (`tensorhub/tiles.py`): every TP share of a weight is contiguous in
some parts, a reader of every part gets the trainer's tensors back, and a node that pulls
only its ranks' tiles pulls about its share of the model and holds exactly the trainer's
bytes there."""

from __future__ import annotations

import pytest
import torch

from tensorhub import PartedReplica, Publisher
from tensorhub.coordinator import dispatch
from tensorhub.coordinator.parts import check_parts_fit
from tensorhub.coordinator.server import CoordinatorConfig
from tensorhub.coordinator.state import CoordinatorState
from tensorhub.core.data_types import (
    Endpoint,
    Hold,
    HoldingsRequest,
    Manifest,
    MemoryDesc,
    Publish,
    Register,
)
from tensorhub.core.errors import LayoutError, TensorHubError
from tensorhub.core.layout import BoundLayout, layout_id, manifest_of
from tensorhub.core.transport import grants
from tensorhub.engines.share_check import ShareCheck
from tensorhub.parted import whole_tensors
from tensorhub.tiles import TiledPublisher, node_parts, node_share, split_dim, tile
from tensorhub_testing.tiled_nodes import (
    FFN,
    HIDDEN,
    held_by,
    llama_state,
    two_nodes_and_a_whole_reader,
)


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_each_tile_holds_a_contiguous_share_of_rows_or_columns():
    state = llama_state(0)
    parts = tile(state.items(), 4)
    assert len(parts) == 5
    down = "model.layers.0.mlp.down_proj.weight"
    q = "model.layers.0.self_attn.q_proj.weight"
    for k, part in enumerate(parts[:4]):
        tensors = dict(part.tensors)
        assert part.cols[down] == (k * FFN // 4, FFN) and down not in part.rows
        assert tensors[down].is_contiguous()
        assert torch.equal(tensors[down], state[down][:, k * FFN // 4:(k + 1) * FFN // 4])
        assert part.rows[q] == (k * HIDDEN // 4, HIDDEN)
        assert torch.equal(tensors[q], state[q][k * HIDDEN // 4:(k + 1) * HIDDEN // 4])
    shared = dict(parts[4].tensors)
    assert set(shared) == {n for n in state if split_dim(n) is None}
    assert set(shared) == {"model.norm.weight"} | {f"model.layers.{i}.input_layernorm.weight"
                                                   for i in range(2)}
    check_parts_fit([manifest_of(p.tensors, rows=p.rows, cols=p.cols, tiles=4)
                     for p in parts])
    with pytest.raises(ValueError, match="4 tiles make 5 parts, not 4"):
        check_parts_fit([manifest_of(p.tensors, rows=p.rows, cols=p.cols, tiles=4)
                         for p in parts[:4]])


def test_columns_that_overlap_do_not_fit():
    w = torch.randn(8, 16)
    a = manifest_of([("w", w[:, :10].contiguous())], cols={"w": (0, 16)})
    b = manifest_of([("w", w[:, 8:].contiguous())], cols={"w": (8, 16)})
    with pytest.raises(ValueError, match=r"columns 10\.\.8 overlap"):
        check_parts_fit([a, b])


def test_tiles_in_the_wrong_parts_do_not_fit():
    parts = tile(llama_state(0).items(), 2)
    manifests = [manifest_of(p.tensors, rows=p.rows, cols=p.cols, tiles=2) for p in parts]
    with pytest.raises(ValueError, match=r"part 1 holds 0\.\.512 of 1024, not tile 1 of 2"):
        check_parts_fit([manifests[1], manifests[0], manifests[2]])
    with pytest.raises(ValueError, match="in 2 tiles is published in 3 parts, not 1"):
        Publish(worker_id="t", model="m", version=1, manifest=manifests[0],
                checksums=[], memory=[])


def test_a_share_comes_whole_in_shape_with_the_rest_nan():
    w = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    pieces = [manifest_of([("w", w[:, 4:].contiguous())], cols={"w": (4, 8)}),
              manifest_of([("w", w[:, :4].contiguous())], cols={"w": (0, 8)})]
    layouts = [BoundLayout.allocate(m) for m in pieces]
    for layout, t in zip(layouts, (w[:, 4:], w[:, :4]), strict=True):
        layout.tensors[0].copy_(t)
    assert torch.equal(whole_tensors(layouts)["w"], w)  # (joined in column order)
    half = whole_tensors(layouts[:1], partial=True)["w"]
    assert torch.equal(half[:, 4:], w[:, 4:]) and half[:, :4].isnan().all()
    with pytest.raises(LayoutError, match="only some of its columns"):
        whole_tensors(layouts[:1])


class Holdings:
    """A coordinator's state with a two-tile version (3 parts) and an unsharded 2-part
    one published, and readers that hold parts of them."""

    def __init__(self):
        self.state = CoordinatorState(CoordinatorConfig())
        w, norm = torch.zeros(8, 8), torch.zeros(8)
        tiled = tile([("model.layers.0.self_attn.q_proj.weight", w),
                      ("model.layers.0.self_attn.o_proj.weight", w),
                      ("model.norm.weight", norm)], 2)
        self.manifests = {
            "tiled": [manifest_of(p.tensors, 0, p.rows, p.cols, tiles=2) for p in tiled],
            "sharded": [manifest_of([("a", w)], 0), manifest_of([("b", w)], 0)]}
        for model, manifests in self.manifests.items():
            for k, m in enumerate(manifests):
                self.call(Publish(worker_id=self.join(f"{model}-t.part{k}", "trainer"),
                                  model=model, version=1, part=k, parts=len(manifests),
                                  manifest=m, checksums=["x"] * len(m.tensors),
                                  memory=self.memory(m)))

    def call(self, request):
        return dispatch.HANDLERS[type(request)](self.state, request)

    def join(self, name: str, role: str = "replica") -> str:
        endpoint = Endpoint(transport="nixl", agent_name=name.replace(".", "-"),
                            agent_metadata=b"\0")
        return self.call(Register(name=name, role=role, endpoint=endpoint,
                                  grant_key=grants.new_key())).worker_id

    @staticmethod
    def memory(manifest) -> list[MemoryDesc]:
        return [MemoryDesc(addr=(i + 1) << 20, nbytes=t.nbytes)
                for i, t in enumerate(manifest.tensors)]

    def hold(self, model: str, name: str, parts: dict[int, bool]) -> None:
        """Reader `name` runs a worker for each of `parts`; those True hold their part."""
        manifests = self.manifests[model]
        for k, holds in parts.items():
            worker = self.join(name if k == 0 else f"{name}.part{k}")
            if holds:
                self.call(Hold(worker_id=worker, model=model, version=1, part=k,
                               parts=len(manifests), layout_id=layout_id(manifests[k]),
                               memory=self.memory(manifests[k])))

    def held(self, model: str, name: str) -> bool:
        return 1 in self.call(HoldingsRequest(model=model, names=[name])).holdings[name]


def test_a_reader_holds_a_version_in_tiles_when_it_holds_its_share():
    h = Holdings()
    h.hold("tiled", "node1", {1: True, 2: True})
    h.hold("tiled", "whole-only", {2: True})
    h.hold("tiled", "pulling", {0: True, 1: False, 2: True})
    assert h.held("tiled", "node1")
    assert not h.held("tiled", "whole-only")  # (no tile: not a share)
    assert not h.held("tiled", "pulling")  # (a tile its worker does not hold yet)


def test_a_reader_holds_a_sharded_version_only_with_every_part():
    h = Holdings()
    h.hold("sharded", "half", {0: True})
    h.hold("sharded", "both", {0: True, 1: True})
    assert not h.held("sharded", "half")
    assert h.held("sharded", "both")


def tiled(tiles: int | None) -> Manifest:
    """Part 0's manifest of a version in `tiles` tiles, as a share is asked with it."""
    return Manifest(tensors=[], compact_threshold=0, tiles=tiles)


def test_a_node_loads_its_ranks_tiles_and_the_shared_part():
    assert node_parts([0], tp=2, tiles=8) == {0, 1, 2, 3, 8}
    assert node_parts([2, 3], tp=4, tiles=8) == {4, 5, 6, 7, 8}
    with pytest.raises(ValueError, match="do not split over TP=3"):
        node_parts([0], tp=3, tiles=8)
    share = node_share([1], tp=2)
    assert share(9, tiled(8)) == {4, 5, 6, 7, 8}
    assert share(3, tiled(None)) == {0, 1, 2}  # (a version not in tiles: every part)


def test_weights_are_tiled_on_the_dim_tensor_parallelism_splits():
    for rows in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.up_proj.weight",
                 "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.3.self_attn.v_proj.weight", "model.embed_tokens.weight",
                 "lm_head.weight", "model.language_model.embed_tokens.weight",
                 "model.layers.3.mlp.experts.7.up_proj.weight",
                 "model.layers.3.mlp.shared_experts.gate_proj.weight",
                 "model.layers.3.block_sparse_moe.experts.0.w3.weight"):
        assert split_dim(rows) == 0, rows
    for cols in ("model.layers.3.self_attn.o_proj.weight", "model.layers.3.mlp.down_proj.weight",
                 "model.layers.3.mlp.experts.7.down_proj.weight",
                 "model.layers.3.mlp.shared_expert.down_proj.weight",
                 "model.layers.3.block_sparse_moe.experts.0.w2.weight"):
        assert split_dim(cols) == 1, cols
    for whole in ("model.layers.3.self_attn.o_proj.bias", "model.layers.3.self_attn.k_proj.bias",
                  "model.layers.3.input_layernorm.weight", "model.layers.3.mlp.gate.weight",
                  "visual.blocks.0.attn.qkv.weight"):
        assert split_dim(whole) is None, whole


def test_a_vocabulary_engines_would_pad_stays_whole():
    """Engines pad the vocabulary to a multiple of 64 before splitting it: 1000 rows would
    split as 512 + 488 at TP=2, not on the tiles' 500."""
    padded = torch.zeros(1000, 8)
    parts = tile([("model.embed_tokens.weight", padded),
                  ("model.layers.0.mlp.up_proj.weight", torch.zeros(16, 8)),
                  ("model.norm.weight", torch.zeros(8))], 2)
    assert [n for n, _ in parts[2].tensors] == ["model.embed_tokens.weight",
                                                "model.norm.weight"]
    parts = tile([("model.embed_tokens.weight", torch.zeros(1024, 8)),
                  ("model.norm.weight", torch.zeros(8))], 2)
    assert parts[0].rows == {"model.embed_tokens.weight": (0, 1024)}


def test_a_node_whose_ranks_split_a_kv_head_group_pulls_the_whole_groups_tiles():
    """TP=8 over 4 nodes of 2 ranks and 2 K/V heads: ranks 0-3 load head 0's K/V rows, so
    the node of ranks 2 and 3 pulls ranks 0-3's tiles; at 4 K/V heads it pulls its own."""
    assert node_share([2, 3], 8, kv_heads=2)(9, tiled(8)) == {0, 1, 2, 3, 8}
    assert node_share([2, 3], 8, kv_heads=4)(9, tiled(8)) == {2, 3, 8}
    assert node_share([2, 3], 8, kv_heads=16)(9, tiled(8)) == {2, 3, 8}


@pytest.mark.slow
def test_nodes_pull_their_shares_and_a_whole_reader_gets_the_trainers_tensors(coordinator):
    """TP=2 over two nodes, 4 tiles: each node pulls its rank's two tiles and the norms,
    about half the model, and holds the trainer's bytes in its rank's rows and columns; a
    reader of every part gets every tensor back whole; all of them follow a second version."""
    shares = [node_share([rank], 2) for rank in (0, 1)]
    with two_nodes_and_a_whole_reader(coordinator.address, shares, tiles=4) as (
            trainer, node0, node1, whole):
        for version in (1, 2):
            state = llama_state(version)
            assert trainer.publish(state) == version
            for reader in (whole, node0, node1):
                assert reader.pull(version, timeout=60) == version
            got = whole.tensors
            assert got.keys() == state.keys()
            assert all(torch.equal(got[n], state[n]) for n in state)
            whole_bytes = nbytes({n: t for n, t in state.items() if split_dim(n) is None})
            for rank, node in enumerate((node0, node1)):
                pulled = sum(r.last_pull.nbytes for r in node.replicas if r.last_pull)
                assert pulled == (nbytes(state) - whole_bytes) // 2 + whole_bytes
                tensors = node.tensors
                assert tensors.keys() == state.keys()
                for name, t in state.items():
                    dim = split_dim(name)
                    if dim is None:
                        assert torch.equal(tensors[name], t)
                        continue
                    half = t.shape[dim] // 2
                    assert tensors[name].shape == t.shape
                    assert torch.equal(tensors[name].narrow(dim, rank * half, half),
                                       t.narrow(dim, rank * half, half)), name
            # the coordinator counts each node as holding the version: its share
            held = held_by(coordinator.address, "policy", ["node0", "node1"])
            assert all(version in held[n] for n in ("node0", "node1")), held


@pytest.mark.slow
def test_a_node_follows_versions_in_tiles_and_whole_ones_in_turn(coordinator):
    """Its share of a version in tiles, every part of a version published whole, then its
    share again: each time the trainer's bytes wherever its rank loads."""
    with TiledPublisher(coordinator.address, "policy", tiles=2, transport="auto") as tiled, \
            PartedReplica(coordinator.address, "policy", name="node1", transport="auto",
                          share=node_share([1], 2)) as node:
        assert tiled.publish(llama_state(1)) == 1
        plain = Publisher(coordinator.address, "policy", name="plain", transport="auto",
                          owners=tiled.parts[0].owners)  # (part 0 is bound to tile 0's)
        try:
            for version, publisher in ((1, tiled), (2, plain), (3, tiled)):
                state = llama_state(version)
                if version > 1:
                    assert publisher.publish(state) == version
                assert node.pull(version, timeout=60) == version
                assert node.partial == (publisher is tiled)
                tensors = node.tensors
                for name, t in state.items():
                    dim = split_dim(name) if publisher is tiled else None
                    mine = t if dim is None else t.narrow(dim, t.shape[dim] // 2, t.shape[dim] // 2)
                    got = tensors[name] if dim is None else \
                        tensors[name].narrow(dim, t.shape[dim] // 2, t.shape[dim] // 2)
                    assert torch.equal(got, mine), (version, name)
        finally:
            plain.close()


def test_the_first_load_from_a_share_fails_if_a_rank_read_outside_it():
    check, o_proj = ShareCheck(), "model.layers.0.self_attn.o_proj.weight"
    nan = torch.full((2,), float("nan"))
    check.after_load([(o_proj, nan)], share_layout=None)  # (not from a share)
    with pytest.raises(TensorHubError, match=r"o_proj\.weight holds NaN") as err:
        check.after_load([("model.norm.weight", torch.ones(2)),
                          (o_proj, torch.tensor([1.0, float("nan")]))],
                         share_layout="2 tiles")
    assert err.value.code == "outside_share"
    check.after_load([(o_proj, torch.ones(2)), ("model.norm.weight", nan)],
                     share_layout="2 tiles")
    check.after_load([(o_proj, nan)], share_layout="2 tiles")  # (each tiling checked once)
    with pytest.raises(TensorHubError, match=r"o_proj\.weight holds NaN"):
        check.after_load([(o_proj, nan)], share_layout="4 tiles")
    with pytest.raises(TensorHubError, match=r"o_proj\.weight holds NaN"):
        check.after_load([(o_proj, nan)], share_layout="2 tiles, K/V by 1 heads")


def test_a_mixture_of_experts_fused_weights_are_scanned_too():
    """vLLM and SGLang load every expert of a layer into one 3-D parameter."""
    w13 = torch.ones(4, 8, 2)
    w13[3, 0, 0] = float("nan")
    with pytest.raises(TensorHubError, match=r"experts\.w13_weight holds NaN"):
        ShareCheck().after_load([("model.layers.0.mlp.experts.w13_weight", w13)],
                                share_layout="2 tiles, experts split")


def test_a_tiling_names_its_tiles_kv_heads_and_experts():
    assert Manifest(tensors=[], compact_threshold=0).tiling is None
    assert tiled(4).tiling == "4 tiles"
    assert Manifest(tensors=[], compact_threshold=0, tiles=8, kv_heads=2,
                    experts="placed").tiling == "8 tiles, K/V by 2 heads, experts placed"


def test_a_share_is_joined_once_per_version_pulled():
    """The engine's check before the pause joins a node's share; its install inside the
    pause gets the same tensors, not a second copy."""
    reader = PartedReplica.__new__(PartedReplica)
    w = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    layout = BoundLayout.allocate(manifest_of([("w", w[:, 4:].contiguous())],
                                              cols={"w": (4, 8)}))
    layout.tensors[0].copy_(w[:, 4:])
    part = type("Part", (), {"layout": layout})()
    reader._parts, reader._count, reader._joined, reader.version = {1: part}, 3, None, 7
    first = reader.tensors["w"]
    assert reader.tensors["w"] is first and first[:, :4].isnan().all()
    reader.version = 8  # (another version pulled into the same buffers)
    assert reader.tensors["w"] is not first
