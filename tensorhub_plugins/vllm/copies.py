"""Whether the ranks of a vLLM engine share one checkpoint copy (`engines/shared_copy.py`),
decided alike by the front end (whose workers hold versions) and by every worker."""

from __future__ import annotations

from tensorhub.engines import one_copy_per_engine as _one_copy


def one_copy_per_engine(parallel_config) -> bool:
    return _one_copy(parallel_config.world_size, parallel_config.pipeline_parallel_size,
                     getattr(parallel_config, "nnodes", 1))
