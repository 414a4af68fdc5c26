"""One checkpoint copy per engine, not per rank: the ranks of a tensor-parallel engine on
one host share rank 0's.

Rank 0 keeps the `CheckpointHolder`: it alone pulls and serves the version, in buffers of
shared memory (`BoundLayout.allocate`). At apply time it tells the other ranks where those
buffers are (`SharedCopy`, over the engine's own process group); they map them read-only
(`map_region`) and load their shard from them, as rank 0 does. So an engine pulls and keeps
one model's bytes whatever its TP size. The holder's lock is held until every rank has
loaded, so the copy is never replaced under a rank still reading it.
"""

from __future__ import annotations

import os

import msgpack
import torch

from tensorhub.core.data_types import SharedCopy, SharedPart
from tensorhub.core.layout import BoundLayout, arena_bytes
from tensorhub.core.shared_memory import map_region, regions_of
from tensorhub.core.wire import encode
from tensorhub.parted import PartedReplica, whole_tensors


def describe(replica: PartedReplica) -> bytes:
    """Where `replica`'s copy lies, for the other ranks (raises if it is not in shared
    memory: then the ranks cannot share it)."""
    parts = []
    for r in replica.replicas:
        first = r.layout.item_bytes[0]
        regions = regions_of([first])
        if not regions:
            raise RuntimeError("the checkpoint copy is not in shared memory "
                               "(TENSORHUB_SHARED_MEMORY=0?): the ranks cannot share it")
        region = regions[0]
        parts.append(SharedPart(manifest=r.layout.manifest, region=region,
                                offset=first.data_ptr() - region.addr))
    return encode(SharedCopy(pid=os.getpid(), version=replica.version, parts=parts))


class SharedCopyReader:
    """The other ranks' side: map rank 0's copy (once per buffer) and name its tensors."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int, int], torch.Tensor] = {}

    def named_tensors(self, payload: bytes, version: int) -> list[tuple[str, torch.Tensor]]:
        copy = SharedCopy.model_validate(msgpack.unpackb(payload, raw=False))
        if copy.version != version:
            raise RuntimeError(f"rank 0 holds v{copy.version}, not v{version}")
        layouts, wanted = [], {}
        for part in copy.parts:
            key = (copy.pid, part.region.fd, part.region.inode)
            view = self._maps.get(key)
            if view is None:
                view = map_region(copy.pid, part.region)
            wanted[key] = view
            arena = view[part.offset:part.offset + arena_bytes(part.manifest)]
            layouts.append(BoundLayout.over(part.manifest, arena))
        self._maps = wanted  # buffers rank 0 no longer uses are unmapped
        return list(whole_tensors(layouts).items())
