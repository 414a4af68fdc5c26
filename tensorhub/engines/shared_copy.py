"""One checkpoint copy per engine, not per rank: the ranks of a tensor-parallel engine on
one host share rank 0's.

Rank 0 keeps the `CheckpointHolder`: it alone pulls and serves the version, in buffers of
shared memory (`BoundLayout.allocate`). At apply time it tells the other ranks where those
buffers are (`SharedCopy`, over the engine's own process group); they map them read-only
(`map_region`) and load their shard from them, as rank 0 does. So an engine pulls and keeps
one model's bytes whatever its TP size. The holder's lock is held until every rank has
loaded, so the copy is never replaced under a rank still reading it.

`apply_shared` is that exchange, the same for every engine: the engine gives it its rank
group's broadcast and vote (`votes.RankVote`) and its own way to load named tensors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import msgpack
import torch

from tensorhub import settings
from tensorhub.core import shared_memory
from tensorhub.core.data_types import SharedCopy, SharedPart
from tensorhub.core.errors import TensorHubError
from tensorhub.core.layout import BoundLayout, arena_bytes
from tensorhub.core.shared_memory import map_region, regions_of
from tensorhub.core.wire import encode
from tensorhub.engines.holder import CheckpointHolder, TornLoad
from tensorhub.parted import PartedReplica, whole_tensors

log = logging.getLogger("tensorhub.engines")

Named = list[tuple[str, torch.Tensor]]


def one_copy_per_engine(ranks: int, stages: int = 1, nodes: int = 1) -> bool:
    """Whether an engine's ranks share one copy: several tensor-parallel ranks (no pipeline
    stages), all on this node, shared memory available, not turned off."""
    return (ranks > 1 and stages == 1 and nodes == 1 and shared_memory.enabled()
            and not settings.COPY_PER_RANK.get())


def apply_shared(version: int, load: Callable[[Named], None],
                 broadcast: Callable[[bytes | None], bytes], agree: Callable[[bool], bool],
                 holder: CheckpointHolder | None = None,
                 reader: SharedCopyReader | None = None,
                 failure: Exception | None = None, fetch: bool = False) -> None:
    """Apply `version` on every rank of an engine from rank 0's copy, or on none. Every
    rank calls it at once: rank 0 with its `holder` (None, or a `failure`, when it has
    nothing to share), the others with a `reader` (and their own `failure`, if any).
    `broadcast` sends rank 0's bytes to every rank (its argument is ignored elsewhere);
    `agree` is the ranks' vote; `fetch`: rank 0 pulls `version` from peers first if its
    copy holds another. Raises on every rank when any rank cannot apply it (the weights are
    then untouched), and `TornLoad` on every rank when a rank's `load` failed."""
    if reader is not None:
        payload, named = broadcast(None), None
        if failure is not None:
            log.warning("this rank cannot apply v%d: %s", version, failure)
        elif not payload:
            log.warning("rank 0 cannot apply v%d (see its log)", version)
        else:
            try:
                named = reader.named_tensors(payload, version)
            except Exception as exc:
                log.warning("cannot map rank 0's copy of v%d: %s", version, exc)
        if not agree(named is not None and failure is None):
            if failure is not None:
                raise failure
            raise TensorHubError(f"a rank of this engine cannot apply v{version}, so no "
                                 f"rank applies it; the engine keeps its current weights",
                                 code="refused")
        loaded: Exception | None = None
        try:
            load(named)
        except Exception as exc:
            loaded = exc
        # (rank 0 keeps its copy locked until this vote: every rank is done with it)
        if not agree(loaded is None):
            raise TornLoad(version, loaded) from loaded
        return
    if holder is None or failure is not None:
        broadcast(b"")
        agree(False)
        raise failure or TensorHubError("no checkpoint copy on this rank")

    def share_and_agree(ok: bool) -> bool:
        payload = b""
        if ok:
            try:
                payload = describe(holder.replica)
            except Exception as exc:
                log.warning("cannot share the checkpoint copy: %s", exc)
                ok = False
        broadcast(payload)
        return agree(ok)

    with holder.tensors_of(version, share_and_agree, loaded=agree, fetch=fetch) as named:
        load(named)


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

    def forget(self) -> None:
        """Unmap rank 0's copy (it may free it: the memory goes back once no rank maps it)."""
        self._maps = {}
