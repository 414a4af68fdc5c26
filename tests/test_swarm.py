"""The striped simulator: real coordinator handlers in a queue, the reader session `Replica`
runs, simulated links. Structural checks only (its figures are in bench/)."""

from __future__ import annotations

import pytest
import torch

from tensorhub.sim.config import SimConfig, manifest_bytes
from tensorhub.sim.swarm import simulate_swarm
from tensorhub.tiles import manifests

SMALL = SimConfig(workers=32, model_bytes=1 << 30, tensor_bytes=64 << 20, chunk_bytes=32 << 20)


def test_a_cold_first_version_costs_each_reader_a_plan_a_hold_and_a_read_done():
    result = simulate_swarm(SMALL)
    assert sorted(result.finished) == sorted(f"w{i}" for i in range(32))
    assert result.reader_messages["hold"] == result.reader_messages["read_done"] == 32
    assert result.reader_messages["striped_plan"] >= 32
    assert result.reader_messages["replan_stripes"] > 0  # a leaf's pending stripe asks again
    assert result.standby_seconds == 0.0


def test_readers_on_standby_send_only_a_confirmation_for_the_first_version():
    result = simulate_swarm(SimConfig(**{**SMALL.__dict__, "standby": True}))
    assert len(result.finished) == 32 and not result.unfinished
    assert result.reader_messages == {"confirm_parents": 32, "hold": 32, "read_done": 32}
    assert result.replans == 0
    assert result.standby_seconds > 0 and result.standby_busy > 0  # placed before, apart
    assert all(t > 0 for t in result.finished.values())  # timed from the publish


def test_the_next_version_from_the_same_parents_needs_only_confirmations():
    result = simulate_swarm(SimConfig(**{**SMALL.__dict__, "version": 2}))
    assert len(result.finished) == 32
    assert result.reader_messages == {"confirm_parents": 32, "hold": 32, "read_done": 32}


def test_a_reader_killed_on_standby_mid_pull_leaves_the_others_to_finish():
    config = SimConfig(**{**SMALL.__dict__, "standby": True, "kill": (0, 5), "kill_at": 0.3})
    result = simulate_swarm(config)
    assert sorted(result.killed) == ["w0", "w5"]
    assert not result.unfinished and len(result.finished) == 30


def test_readers_told_one_by_one_after_the_last_one_finished_get_one_trainer_copy():
    config = SimConfig(**{**SMALL.__dict__, "workers": 4, "spread": 1.0})  # 12x the bound
    result = simulate_swarm(config)
    assert sorted(result.finished) == ["w0", "w1", "w2", "w3"]
    assert result.trainer_copies == 1.0  # the later ones read from those that hold it


def test_a_reader_that_reaches_no_one_asking_first_costs_no_second_trainer_copy():
    result = simulate_swarm(SimConfig(**{**SMALL.__dict__, "workers": 8,
                                         "failing_first": True}))
    assert sorted(result.finished) == sorted(f"w{i}" for i in range(8))
    assert result.trainer_copies == 1.0


def meta_llama(layers: int = 4, hidden: int = 2048, ffn: int = 8192, kv: int = 512,
               vocab: int = 32768) -> list[tuple[str, torch.Tensor]]:
    """A Llama-shaped state dict's names and shapes (bf16, on the meta device)."""
    def t(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    named = [("model.embed_tokens.weight", t(vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        named += [(f"{p}.self_attn.q_proj.weight", t(hidden, hidden)),
                  (f"{p}.self_attn.k_proj.weight", t(kv, hidden)),
                  (f"{p}.self_attn.v_proj.weight", t(kv, hidden)),
                  (f"{p}.self_attn.o_proj.weight", t(hidden, hidden)),
                  (f"{p}.mlp.gate_proj.weight", t(ffn, hidden)),
                  (f"{p}.mlp.up_proj.weight", t(ffn, hidden)),
                  (f"{p}.mlp.down_proj.weight", t(hidden, ffn)),
                  (f"{p}.input_layernorm.weight", t(hidden))]
    return named


def test_nodes_of_engines_in_tiles_pull_their_share_and_the_trainer_sends_one_copy():
    """8 engines of TP=4 over 2 nodes each (2 ranks a node), a version in 4 tiles: each
    node receives exactly its ranks' 2 tiles and the whole part, so an engine its tiles once
    and the whole part twice; the trainer sends each part once."""
    parts = tuple(manifests(meta_llama(), 4))
    sizes = [manifest_bytes(m) for m in parts]
    config = SimConfig(workers=16, tiled=parts, engine_nodes=2, chunk_bytes=32 << 20)
    result = simulate_swarm(config)
    assert sorted(result.finished) == sorted(f"w{i}" for i in range(16))
    for name, nbytes in result.node_bytes.items():
        first = 2 * (int(name[1:]) % 2)  # node 0 of its engine: tiles 0 and 1
        assert nbytes == sizes[first] + sizes[first + 1] + sizes[4], name
    assert result.engine_copies == pytest.approx((sum(sizes) + sizes[4]) / sum(sizes))
    assert result.trainer_copies == pytest.approx(1.0)


def test_nodes_of_a_version_split_by_kv_head_pull_their_tiles_and_their_heads_kv():
    """TP=4 over 2 nodes, 4 tiles and 1 K/V head (its K/V in part 5): each node receives
    its 2 tiles, the whole part and the K/V part, never the other node's tiles."""
    parts = tuple(manifests(meta_llama(), 4, kv_heads=1))
    assert len(parts) == 6
    sizes = [manifest_bytes(m) for m in parts]
    result = simulate_swarm(SimConfig(workers=4, tiled=parts, engine_nodes=2,
                                      chunk_bytes=32 << 20))
    assert sorted(result.finished) == sorted(f"w{i}" for i in range(4))
    for name, nbytes in result.node_bytes.items():
        first = 2 * (int(name[1:]) % 2)
        assert nbytes == sizes[first] + sizes[first + 1] + sizes[4] + sizes[5], name


def test_a_node_killed_mid_pull_leaves_every_other_node_its_share():
    parts = tuple(manifests(meta_llama(), 4))
    config = SimConfig(workers=16, tiled=parts, engine_nodes=2, chunk_bytes=32 << 20,
                       kill=(1,), kill_at=0.4)
    result = simulate_swarm(config)
    assert result.killed == ["w1"]
    assert not result.unfinished and len(result.finished) == 15
