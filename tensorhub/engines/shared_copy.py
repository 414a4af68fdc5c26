"""One checkpoint copy per node, not per rank: the ranks of a tensor-parallel engine on one
host share the copy of that host's lowest rank (rank 0's on an engine of one node); with
pipeline stages, the ranks of each stage on a host share the copy of their lowest, which
pulls that stage's share.

That rank keeps the `CheckpointCopy`: it alone pulls and serves the version, in buffers of
shared memory (`BoundLayout.allocate`). At apply time it tells the other ranks of its node
where those buffers are (`SharedCopy`, over a broadcast among the node's ranks); they map
them read-only (`map_region`) and load their shard from them, as it does. So an engine pulls
and keeps one model's bytes per node whatever its TP size. The holder's lock is held until
every rank of the engine has loaded, so the copy is never replaced under a rank still
reading it. Shared memory does not cross hosts: an engine on N nodes keeps N copies (with
pipeline stages, one per stage on each node: each its stage's share).

`apply_shared` is that exchange, the same for every engine: the engine gives it its node's
broadcast, the vote of all its ranks (`votes.RankVote`) and its own way to load named
tensors.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable

import msgpack
import torch
from pydantic import Field

from tensorhub import settings
from tensorhub.core import shared_memory
from tensorhub.core.data_types import Manifest, SharedRegion
from tensorhub.core.errors import TensorHubError
from tensorhub.core.layout import BoundLayout, arena_bytes
from tensorhub.core.schema import MAX_PARTS, Strict, Version
from tensorhub.core.shared_memory import map_region, regions_of
from tensorhub.core.wire import encode
from tensorhub.engines.checkpoint_copy import CheckpointCopy, TornLoad
from tensorhub.parted import PartedReplica, whole_tensors

log = logging.getLogger("tensorhub.engines")

Named = list[tuple[str, torch.Tensor]]


class SharedPart(Strict):
    """One part of a checkpoint copy in shared memory: its manifest, and where its
    `BoundLayout.allocate` arena lies (`offset` bytes into `region`)."""

    manifest: Manifest
    region: SharedRegion
    offset: int = Field(ge=0, lt=2**48)


class SharedCopy(Strict):
    """An engine's checkpoint copy of `version`, as the engine's other ranks on the host
    map it: passed between ranks, never to the coordinator."""

    pid: int = Field(ge=1)
    version: Version
    parts: list[SharedPart] = Field(max_length=MAX_PARTS)
    # Only the node's share of a version tiled so (`Manifest.tiling`).
    share_layout: str | None = Field(default=None, max_length=128)


def ranks_per_copy(ranks: int, stages: int = 1, nodes: int = 1) -> int:
    """How many of an engine's `ranks` share each copy: those of one node that run one
    pipeline stage. vLLM numbers its ranks stage by stage and places them on its nodes in
    consecutive blocks, so each such group is a block of consecutive ranks: a stage's TP
    ranks where a node holds whole stages, a node's where a stage spans nodes. (Where
    neither count divides the other, the blocks are smaller than a node's share of a stage:
    more copies than needed, never a copy shared across a node or a stage.)"""
    nodes, stages = max(nodes, 1), max(stages, 1)
    if ranks % nodes or ranks % stages:
        return 1
    return math.gcd(ranks // nodes, ranks // stages)


def one_copy_per_engine(ranks: int, stages: int = 1, nodes: int = 1) -> bool:
    """Whether an engine's ranks share one copy per node and pipeline stage (each a block
    of `ranks_per_copy` > 1 ranks), shared memory available, not turned off. (With one rank
    per node and stage every rank keeps a copy: its node's share of its stage.)"""
    return ranks_per_copy(ranks, stages, nodes) > 1 and shared_memory.enabled() \
        and not settings.COPY_PER_RANK.get()


def copy_holders(ranks: int, nodes: int = 1, *, stages: int = 1) -> list[int]:
    """The ranks (in the engine's group) that hold a copy when the ranks share
    (`one_copy_per_engine`): the lowest of each node's ranks of each stage."""
    return list(range(0, ranks, ranks_per_copy(ranks, stages, nodes)))


def node_of(index: int, ranks: int, nodes: int = 1, *, stages: int = 1) -> list[int]:
    """The positions in the engine's group of the ranks that share the copy of the rank at
    `index` (its node's ranks of its stage; the copy's holder first)."""
    per = ranks_per_copy(ranks, stages, nodes)
    first = index - index % per
    return list(range(first, first + per))


def apply_shared(version: int, load: Callable[[Named], None],
                 broadcast: Callable[[bytes | None], bytes], agree: Callable[[bool], bool],
                 checkpoint: CheckpointCopy | None = None,
                 reader: SharedCopyReader | None = None,
                 failure: Exception | None = None, fetch: bool = False) -> None:
    """Apply `version` on every rank of an engine from its node's copy, or on none. Every
    rank calls it at once: each node's holder of the copy (`copy_holders`) with its
    `checkpoint` (None, or a `failure`, when it has nothing to share), the others with a
    `reader` (and their own `failure`, if any). `broadcast` sends the node's holder's bytes
    to every rank of that node (its argument is ignored elsewhere); `agree` is the vote of
    all the engine's ranks; `fetch`: the rank with the copy pulls `version` from peers first if its
    copy holds another. Raises on every rank when any rank cannot apply it (the weights are
    then untouched), and `TornLoad` on every rank when a rank's `load` failed."""
    if reader is not None:
        payload, named = broadcast(None), None
        if failure is not None:
            log.warning("this rank cannot apply v%d: %s", version, failure)
        elif not payload:
            log.warning("the holder of this node's copy cannot apply v%d (see its log)", version)
        else:
            try:
                named = reader.named_tensors(payload, version)
            except Exception as exc:
                log.warning("cannot map this node's copy of v%d: %s", version, exc)
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
        # (each holder keeps its copy locked until this vote: every rank is done with it)
        if not agree(loaded is None):
            raise TornLoad(version, loaded) from loaded
        return
    if checkpoint is None or failure is not None:
        broadcast(b"")
        agree(False)
        raise failure or TensorHubError("no checkpoint copy on this rank")

    def share_and_agree(ok: bool) -> bool:
        payload = b""
        if ok:
            try:
                payload = describe(checkpoint.replica)
            except Exception as exc:
                log.warning("cannot share the checkpoint copy: %s", exc)
                ok = False
        broadcast(payload)
        return agree(ok)

    with checkpoint.tensors_of(version, share_and_agree, loaded=agree, fetch=fetch) as named:
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
    return encode(SharedCopy(pid=os.getpid(), version=replica.version, parts=parts,
                             share_layout=replica.share_layout))


class SharedCopyReader:
    """The other ranks' side: map its node's copy (once per buffer) and name its tensors."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int, int], torch.Tensor] = {}
        self.share_layout: str | None = None  # the last copy named, a node's share

    def named_tensors(self, payload: bytes, version: int) -> list[tuple[str, torch.Tensor]]:
        copy = SharedCopy.model_validate(msgpack.unpackb(payload, raw=False))
        if copy.version != version:
            raise RuntimeError(f"this node's copy holds v{copy.version}, not v{version}")
        layouts, wanted = [], {}
        for part in copy.parts:
            key = (copy.pid, part.region.fd, part.region.inode)
            view = self._maps.get(key)
            if view is None:
                view = map_region(copy.pid, part.region)
            wanted[key] = view
            arena = view[part.offset:part.offset + arena_bytes(part.manifest)]
            layouts.append(BoundLayout.over(part.manifest, arena))
        self._maps = wanted  # buffers the holder no longer uses are unmapped
        self.share_layout = copy.share_layout
        return list(whole_tensors(layouts, partial=copy.share_layout is not None).items())

    def forget(self) -> None:
        """Unmap the node's copy (it may free it: the memory goes back once no rank maps it)."""
        self._maps = {}
