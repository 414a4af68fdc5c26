"""Whether the ranks of a vLLM engine share one checkpoint copy per node
(`engines/shared_copy.py`), and which ranks hold those copies, decided alike by the front
end (whose workers hold versions) and by every worker from vLLM's own parallel config."""

from __future__ import annotations

from tensorhub.engines import copy_holders as _copy_holders
from tensorhub.engines import one_copy_per_engine as _one_copy


def engine_nodes(parallel_config) -> int:
    """The nodes one engine's ranks span (vLLM's nodes per data-parallel rank)."""
    return int(getattr(parallel_config, "nnodes_within_dp",
                       getattr(parallel_config, "nnodes", 1)) or 1)


def one_copy_per_engine(parallel_config) -> bool:
    """(Not with pipeline stages and data parallelism both: vLLM's world group then spans
    several engines, and each rank keeps its own copy.)"""
    pc = parallel_config
    if pc.pipeline_parallel_size > 1 and pc.data_parallel_size > 1:
        return False
    return _one_copy(pc.world_size, pc.pipeline_parallel_size, engine_nodes(pc))


def copy_holders(parallel_config) -> list[int]:
    """The ranks that hold a copy: each node's lowest when they share, else every rank."""
    world = parallel_config.world_size
    if not one_copy_per_engine(parallel_config):
        return list(range(world))
    return _copy_holders(world, engine_nodes(parallel_config),
                         stages=parallel_config.pipeline_parallel_size)
