"""The routed experts a node's expert-parallel vLLM ranks run, from vLLM's own expert maps,
so that its copy pulls the tiles they are placed in (`tensorhub.tiles.node_share`), and
whether a tensor-parallel engine's MoE layers split their experts as its attention."""

from __future__ import annotations

import logging

from tensorhub.engines import NodeExperts

log = logging.getLogger("tensorhub.vllm")


def node_experts(model, positions: list[int], mine: int, tp: int) -> NodeExperts | None:
    """The experts the ranks at `positions` of the engine's TP group of `tp` run (this
    rank at `mine`; without data parallelism, a rank's expert-parallel rank is its TP
    rank), by vLLM's placement (`determine_expert_map`, as its MoE layers were built);
    None where it cannot say for sure: no expert-parallel MoE layer, experts that move
    (EPLB), an expert group wider than the TP group (data parallelism), shared experts
    fused into the routed ones (each rank then holds them whole), or a computed placement
    that differs from this rank's own map. The copy then pulls every part."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    managers = [m.expert_map_manager for m in model.modules()
                if getattr(m, "expert_map_manager", None) is not None]
    if not managers or managers[0].expert_map is None:
        return None
    first = managers[0]
    if any(m.global_num_experts != first.global_num_experts
           or m.placement_strategy != first.placement_strategy for m in managers):
        return None  # (layers placed alike, or no one rule)
    if first.moe_parallel_config.enable_eplb or first.ep_size != tp or first.ep_rank != mine \
            or any(m.num_fused_shared_experts for m in managers):
        return None

    def placed(rank: int) -> set[int]:
        _, expert_map, _ = determine_expert_map(first.ep_size, rank, first.global_num_experts,
                                                first.placement_strategy)
        return set((expert_map != -1).nonzero().flatten().tolist())

    if placed(mine) != set(first.get_local_expert_ids()):
        log.warning("TensorHub: vLLM's expert map for this rank is not the one its "
                    "placement rule gives: this copy pulls every part")
        return None
    return NodeExperts(ids=frozenset().union(*(placed(r) for r in positions)),
                       total=first.global_num_experts)


def experts_split_as_attention(model, tp: int) -> bool:
    """Whether every MoE layer of a tensor-parallel engine splits its experts over the same
    `tp` ranks as its attention, so that a rank loads its tiles of them (not, as vLLM does
    under data or context parallelism, over dp * pcp * tp ranks, nor with shared experts
    fused in). True for a model with no MoE layer."""
    managers = [m.expert_map_manager for m in model.modules()
                if getattr(m, "expert_map_manager", None) is not None]
    return all(m.moe_parallel_config.tp_size == tp and not m.moe_parallel_config.use_ep
               and not m.num_fused_shared_experts for m in managers)


def keep_cpu_experts_packed(model) -> int:
    """Make each reload of an unquantized MoE layer on vLLM's CPU build pack its experts
    again; returns the layers so hooked. vLLM (0.32) packs the experts' weights into its CPU
    grouped-GEMM layout only at the first load: on a weight update its `_setup_kernel`
    skips the experts' `process_weights_after_loading`, so a reloaded MoE serves garbage
    (its own `reload_weights` too). The hook runs where vLLM processes a reloaded layer,
    so a layer the reload did not reach keeps its packed weights as they are. A layer
    hooked already (a second engine on the same model) is left as it is."""
    hooked = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if experts is None or not any(c.__name__ == "CPUUnquantizedExperts"
                                      for c in type(experts).__mro__):
            continue
        if getattr(method.process_weights_after_loading, "packs_experts", False):
            continue

        def process(layer, _process=method.process_weights_after_loading,
                    _experts=experts) -> None:
            _process(layer)
            _experts.process_weights_after_loading(layer)

        process.packs_experts = True
        method.process_weights_after_loading = process
        hooked += 1
    if hooked:
        log.info("TensorHub: %d MoE layers pack their experts again after each reload "
                 "(vLLM's CPU build does not)", hooked)
    return hooked
