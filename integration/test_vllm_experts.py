"""Which experts a node's expert-parallel vLLM ranks run (`tensorhub_plugins/vllm/experts.py`),
from the expert maps vLLM's own `ExpertMapManager` builds, and the tiles their copy then
pulls of a version with its experts placed. vLLM's CPU build cannot serve with expert
parallelism (its fused-MoE kernel ignores the expert map and crashes: seen with
`--enable-expert-parallel` at TP=2), so no engine serves here: the maps are vLLM's, the
layer around them a stand-in."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tensorhub.tiles import NodeExperts, manifests, node_share
from tensorhub_testing.tiled_nodes import moe_state

SCRIPT = Path(__file__).resolve().parent / "vllm_expert_maps.py"


@pytest.fixture(scope="module")
def said(vllm_python) -> dict:
    done = subprocess.run([vllm_python, str(SCRIPT)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_each_rank_runs_its_block_of_experts(said):
    assert said["rank 0 of 2, 4 experts"] == {"ids": [0, 1], "total": 4}
    assert said["rank 1 of 2, 4 experts"] == {"ids": [2, 3], "total": 4}
    assert said["node of ranks 0-1 of 4, 8 experts"] == {"ids": [0, 1, 2, 3], "total": 8}


def test_round_robin_placement_is_followed(said):
    assert said["round robin, rank 0 of 2"] == {"ids": [0, 2], "total": 4}


def test_where_the_experts_move_or_the_maps_disagree_every_part_is_pulled(said):
    for case in ("EPLB", "expert group wider than TP", "another rank's map",
                 "shared experts fused in"):
        assert said[case] is None, case


def test_a_tensor_parallel_rank_pulls_its_tiles_of_experts_split_over_its_tp_ranks_only(said):
    """Under data parallelism vLLM splits the experts over DP x TP ranks, not as the
    attention: the copy then pulls every part (`_share` returns None)."""
    assert said["split as attention: TP=2 layer, TP=2 engine"] is True
    assert said["split as attention: dense"] is True
    assert said["split as attention: over DP=2 x TP=2, TP=2 engine"] is False
    assert said["split as attention: expert parallel"] is False


def test_a_rank_pulls_its_tile_and_its_experts_tiles(said):
    """2 tiles, 4 experts placed: rank 1 pulls tile 1 (its attention rows and experts 2
    and 3) and the last part; with round-robin placement rank 0 also needs tile 1."""
    part0 = manifests(moe_state(0, experts=4).items(), 2, experts="placed")[0]
    rank1 = NodeExperts(frozenset(said["rank 1 of 2, 4 experts"]["ids"]), 4)
    assert node_share([1], 2, experts=rank1)(3, part0) == {1, 2}
    robin = NodeExperts(frozenset(said["round robin, rank 0 of 2"]["ids"]), 4)
    assert node_share([0], 2, experts=robin)(3, part0) == {0, 1, 2}
