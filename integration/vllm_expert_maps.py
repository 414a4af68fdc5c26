"""Run in the vLLM venv: the experts `tensorhub_plugins.vllm.experts.node_experts` says a
node's ranks run, for MoE layers built by vLLM's own `ExpertMapManager` (vLLM's CPU build
cannot run expert parallelism: its fused-MoE kernel ignores the expert map), printed as
one JSON object: case -> sorted expert numbers, or null.

    python integration/vllm_expert_maps.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def moe_model(ep_rank: int, ep_size: int, experts: int, strategy: str = "linear",
              groups: int | None = None, eplb: bool = False, tp_size: int = 1,
              fused_shared: int = 0) -> torch.nn.Module:
    """A model whose one MoE layer carries the expert map vLLM builds for this rank
    (`ep_size` 1: a tensor-parallel layer split over `tp_size` ranks, no map;
    `fused_shared`: ROCm's shared experts fused in, set after the manager is built, whose
    own set-up of them needs a GPU)."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager

    parallel = FusedMoEParallelConfig(
        tp_size=tp_size, pcp_size=1, dp_size=1, ep_size=ep_size, tp_rank=0, pcp_rank=0,
        dp_rank=0, ep_rank=ep_rank, sp_size=1, use_ep=ep_size > 1,
        all2all_backend="allgather_reducescatter", enable_eplb=eplb)
    layer = torch.nn.Module()
    layer.expert_map_manager = ExpertMapManager(
        max_num_batched_tokens=8, top_k=2, global_num_experts=experts,
        num_redundant_experts=0, num_expert_group=groups, moe_parallel_config=parallel,
        placement_strategy=strategy, enable_eplb=eplb)
    layer.expert_map_manager.num_fused_shared_experts = fused_shared
    model = torch.nn.Module()
    model.add_module("experts", layer)
    return model


def main() -> None:
    from tensorhub_plugins.vllm.experts import experts_split_as_attention, node_experts

    def said(model, positions, mine, tp):
        found = node_experts(model, positions, mine, tp)
        return None if found is None else {"ids": sorted(found.ids), "total": found.total}

    print(json.dumps({
        "rank 0 of 2, 4 experts": said(moe_model(0, 2, 4), [0], 0, 2),
        "rank 1 of 2, 4 experts": said(moe_model(1, 2, 4), [1], 1, 2),
        "node of ranks 0-1 of 4, 8 experts": said(moe_model(1, 4, 8), [0, 1], 1, 4),
        "round robin, rank 0 of 2": said(moe_model(0, 2, 4, "round_robin", groups=2),
                                         [0], 0, 2),
        "EPLB": said(moe_model(0, 2, 4, eplb=True), [0], 0, 2),
        "expert group wider than TP": said(moe_model(0, 2, 4), [0], 0, 1),
        "another rank's map": said(moe_model(1, 2, 4), [0], 0, 2),
        "shared experts fused in": said(moe_model(0, 2, 4, fused_shared=1), [0], 0, 2),
        "split as attention: TP=2 layer, TP=2 engine": experts_split_as_attention(
            moe_model(0, 1, 4, tp_size=2), 2),
        "split as attention: over DP=2 x TP=2, TP=2 engine": experts_split_as_attention(
            moe_model(0, 1, 4, tp_size=4), 2),
        "split as attention: expert parallel": experts_split_as_attention(
            moe_model(0, 2, 4), 2),
        "split as attention: dense": experts_split_as_attention(torch.nn.Module(), 2),
    }))


if __name__ == "__main__":
    main()
