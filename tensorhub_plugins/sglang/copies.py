"""Whether the TP ranks of an SGLang engine share one checkpoint copy per node
(`engines/shared_copy.py`), decided alike by the main process's driver and by every
scheduler from SGLang's own server arguments. Under pipeline stages every rank keeps a copy
of its own: the plugin knows a rank by its TP rank alone."""

from __future__ import annotations

from tensorhub.engines import one_copy_per_engine as _one_copy


def one_copy_per_engine(server_args) -> bool:
    tp_size = int(getattr(server_args, "tp_size", 1) or 1)
    pp_size = int(getattr(server_args, "pp_size", 1) or 1)
    nodes = int(getattr(server_args, "nnodes", 1) or 1)
    return pp_size == 1 and _one_copy(tp_size, nodes=nodes)
