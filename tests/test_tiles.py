"""A version in tiles (`tensorhub/tiles.py`): every TP share of a weight is contiguous in
some parts, a reader of every part gets the trainer's tensors back, and a node that pulls
only its ranks' tiles pulls about its share of the model and holds exactly the trainer's
bytes there."""

from __future__ import annotations

import pytest
import torch

from tensorhub import PartedReplica
from tensorhub.coordinator.parts import check_parts_fit
from tensorhub.core.client import CoordinatorClient
from tensorhub.core.data_types import HoldingsRequest
from tensorhub.core.layout import manifest_of
from tensorhub.tiles import TiledPublisher, node_parts, node_share, split_dim, tile

HIDDEN, FFN, VOCAB = 256, 512, 1024


def llama_state(seed: int, layers: int = 2) -> dict[str, torch.Tensor]:
    """A small Llama-shaped state dict (fp32)."""
    g = torch.Generator().manual_seed(seed)
    state = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for name, shape in (("self_attn.q_proj", (HIDDEN, HIDDEN)),
                            ("self_attn.k_proj", (HIDDEN, HIDDEN)),
                            ("self_attn.v_proj", (HIDDEN, HIDDEN)),
                            ("self_attn.o_proj", (HIDDEN, HIDDEN)),
                            ("mlp.gate_proj", (FFN, HIDDEN)), ("mlp.up_proj", (FFN, HIDDEN)),
                            ("mlp.down_proj", (HIDDEN, FFN))):
            state[f"{p}.{name}.weight"] = torch.randn(*shape, generator=g)
        state[f"{p}.input_layernorm.weight"] = torch.randn(HIDDEN, generator=g)
    state["model.norm.weight"] = torch.randn(HIDDEN, generator=g)
    return state


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
    assert "model.layers.0.self_attn.k_proj.weight" in shared  # (GQA: ranks may share KV)
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


def test_a_node_loads_its_ranks_tiles_and_the_shared_part():
    assert node_parts([0], tp=2, tiles=8) == {0, 1, 2, 3, 8}
    assert node_parts([2, 3], tp=4, tiles=8) == {4, 5, 6, 7, 8}
    with pytest.raises(ValueError, match="do not split over TP=3"):
        node_parts([0], tp=3, tiles=8)
    share = node_share([1], tp=2)
    assert share(9, 8) == {4, 5, 6, 7, 8}
    assert share(3, None) == {0, 1, 2}  # (a version not in tiles: every part)


def test_linear_weights_are_tiled_on_the_dim_tensor_parallelism_splits():
    assert split_dim("model.layers.3.self_attn.q_proj.weight") == 0
    assert split_dim("model.layers.3.mlp.up_proj.weight") == 0
    assert split_dim("model.layers.3.self_attn.o_proj.weight") == 1
    assert split_dim("model.layers.3.mlp.down_proj.weight") == 1
    for whole in ("model.layers.3.self_attn.o_proj.bias", "model.layers.3.self_attn.v_proj.weight",
                  "model.embed_tokens.weight", "lm_head.weight"):
        assert split_dim(whole) is None


@pytest.mark.slow
def test_nodes_pull_their_shares_and_a_whole_reader_gets_the_trainers_tensors(coordinator):
    """TP=2 over two nodes, 4 tiles: each node pulls its rank's two tiles and the norms,
    about half the model, and holds the trainer's bytes in its rank's rows and columns; a
    reader of every part gets every tensor back whole; all of them follow a second version."""
    share = {rank: node_share([rank], 2) for rank in (0, 1)}
    with TiledPublisher(coordinator.address, "policy", tiles=4, transport="auto") as trainer, \
            PartedReplica(coordinator.address, "policy", name="node0", transport="auto",
                          share=share[0]) as node0, \
            PartedReplica(coordinator.address, "policy", name="node1", transport="auto",
                          share=share[1]) as node1, \
            PartedReplica(coordinator.address, "policy", name="whole",
                          transport="auto") as whole:
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
            client = CoordinatorClient(coordinator.address)
            try:
                held = client.call(HoldingsRequest(model="policy",
                                                   names=["node0", "node1"])).holdings
            finally:
                client.close()
            assert all(version in held[n] for n in ("node0", "node1")), held
