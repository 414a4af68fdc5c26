"""Whether the ranks of a vLLM engine share one checkpoint copy (`engines/shared_copy.py`),
decided alike by the front end (whose workers hold versions) and by every worker."""

from __future__ import annotations

import os

from tensorhub.core import shared_memory

PER_RANK_ENV = "TENSORHUB_COPY_PER_RANK"  # "1": a copy per rank, as before


def one_copy_per_engine(parallel_config) -> bool:
    """Several tensor-parallel ranks (no pipeline stages), all on this node, shared memory
    available, not turned off."""
    return (parallel_config.world_size > 1 and parallel_config.pipeline_parallel_size == 1
            and getattr(parallel_config, "nnodes", 1) == 1
            and shared_memory.enabled() and os.environ.get(PER_RANK_ENV, "0") != "1")
