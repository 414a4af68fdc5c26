"""Sharded versions: K trainer ranks (FSDP, Megatron) publish one version together.

Each rank publishes its part as an ordinary layout (its own manifest, holders and forest),
so planning, striping and failover work per part unchanged. What is new is only the
waiting: a version whose parts are not all in is *pending*, invisible to readers; it is
announced when the last part arrives, and given up (*aborted*) if a rank leaves or the
parts do not all come in time. Nothing here does I/O: the coordinator drives it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from tensorhub import settings
from tensorhub.coordinator.table import LayoutRec
from tensorhub.core.data_types import Manifest, MemoryDesc
from tensorhub.core.experts import expert_counts, expert_of, expert_part
from tensorhub.core.kv_heads import KV
from tensorhub.core.layer_blocks import layer_of, part_of


@dataclass
class PendingPart:
    layout_id: str
    layout: LayoutRec
    publisher: str  # worker id
    memory: list[MemoryDesc]


@dataclass
class PendingVersion:
    version: int
    parts: int
    started: float
    have: dict[int, PendingPart] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.have) == self.parts

    def missing(self) -> list[int]:
        return [r for r in range(self.parts) if r not in self.have]


class Pending:
    """Pending versions by (model, version), and the reasons recent ones were aborted."""

    def __init__(self) -> None:
        self.versions: dict[tuple[str, int], PendingVersion] = {}
        self.aborted: OrderedDict[tuple[str, int], str] = OrderedDict()

    def abort(self, key: tuple[str, int], reason: str) -> PendingVersion | None:
        self.aborted[key] = reason
        while len(self.aborted) > settings.ABORTED_KEPT:
            self.aborted.popitem(last=False)
        return self.versions.pop(key, None)

    def published_by(self, worker_id: str) -> list[tuple[str, int]]:
        return [key for key, pv in self.versions.items()
                if any(p.publisher == worker_id for p in pv.have.values())]


def check_parts_fit(manifests: list[Manifest]) -> None:
    """Raise `ValueError` unless the parts' tensors make one state dict: every name in
    exactly one part, or split over several parts by rows (or, 2-D, by columns) that tile
    it exactly (one dim, same dtype and other dims; [0, total) with no gap or overlap)."""
    whole: dict[str, int] = {}
    sliced: dict[str, list[tuple[int, int, int, int, int, str, tuple[int, ...]]]] = {}
    if len({(m.tiles, m.kv_heads) for m in manifests}) > 1:
        raise ValueError(f"the parts disagree on the tiles or the K/V heads: "
                         f"{[(m.tiles, m.kv_heads) for m in manifests]}")
    if (count := manifests[0].tile_parts) is not None and len(manifests) != count:
        raise ValueError(f"{manifests[0].tiles} tiles make {count} parts, not "
                         f"{len(manifests)}")
    if len({m.experts for m in manifests}) > 1:
        raise ValueError(f"the parts disagree on how the experts are laid out: "
                         f"{[m.experts for m in manifests]}")
    if manifests[0].tiles is not None:
        _check_tile_homes(manifests)
    if any(m.blocks != manifests[0].blocks for m in manifests):
        raise ValueError(f"the parts disagree on the layer blocks: "
                         f"{[m.blocks for m in manifests]}")
    if manifests[0].blocks is not None:
        edges = manifests[0].blocks
        for r, manifest in enumerate(manifests):
            for spec in manifest.tensors:
                if (layer := layer_of(spec.name)) is not None and layer >= edges[-1]:
                    raise ValueError(f"tensor {spec.name!r} is of layer {layer}, past the "
                                     f"{edges[-1]} layers of the version's blocks")
                if (home := part_of(spec.name, edges)) != r:
                    raise ValueError(f"tensor {spec.name!r} is in part {r} of a version in "
                                     f"layer blocks, not in part {home}")
    for r, manifest in enumerate(manifests):
        if manifest.compact_threshold != manifests[0].compact_threshold:
            raise ValueError(f"part {r} compacts below {manifest.compact_threshold} bytes, "
                             f"part 0 below {manifests[0].compact_threshold}: use one "
                             f"threshold on every rank")
        for spec in manifest.tensors:
            if spec.piece is None:
                if spec.name in whole or spec.name in sliced:
                    raise ValueError(f"tensor {spec.name!r} is in more than one part "
                                     f"(parts {whole.get(spec.name, '?')} and {r})")
                whole[spec.name] = r
            else:
                if spec.name in whole:
                    raise ValueError(f"tensor {spec.name!r} is whole in part "
                                     f"{whole[spec.name]} and slices in part {r}")
                dim, start, stop, total = spec.piece
                others = tuple(n for d, n in enumerate(spec.shape) if d != dim)
                sliced.setdefault(spec.name, []).append(
                    (start, stop, total, r, dim, spec.dtype, others))
    tiles = manifests[0].tiles
    for name, slices in sliced.items():
        slices.sort()
        if tiles is not None:
            _check_tile_slices(name, slices, tiles, manifests[0].kv_heads)
        kinds = {(s[2], s[4], s[5], s[6]) for s in slices}
        if len(kinds) > 1:
            raise ValueError(f"tensor {name!r}: its slices disagree on the dim sliced, its "
                             f"total, the dtype or the other dims ({sorted(kinds)})")
        what = ("rows", "columns")[slices[0][4]]
        cursor = 0
        for start, stop, _total, r, *_ in slices:
            if start != cursor:
                gap = "overlap" if start < cursor else "gap"
                raise ValueError(f"tensor {name!r}: {what} {cursor}..{start} {gap} at part {r}")
            cursor = stop
        if cursor != slices[0][2]:
            raise ValueError(f"tensor {name!r}: {what} {cursor}..{slices[0][2]} are in no part")


def _check_tile_slices(name: str, slices: list[tuple], tiles: int,
                       kv_heads: int | None) -> None:
    """A node pulls tile k from part k and K/V head h from part tiles + 1 + h
    (`tiles.node_share`), so each slice must be what its part's place says, a tensor's
    slices all tiles or all heads, and a K/V projection's (`core/kv_heads.py`) all heads'
    rows."""
    kinds = set()
    for start, stop, total, r, *_ in slices:
        if r < tiles:
            kind, k, count = "tile", r, tiles
        elif r > tiles and kv_heads is not None:
            kind, k, count = "K/V head", r - tiles - 1, kv_heads
        else:
            raise ValueError(f"tensor {name!r}: a slice in part {r}, which holds what every "
                             f"rank loads whole")
        kinds.add(kind)
        if (start, stop) != (k * total // count, (k + 1) * total // count):
            raise ValueError(f"tensor {name!r}: part {r} holds {start}..{stop} of {total}, "
                             f"not {kind} {k} of {count}")
    if len(kinds) > 1:
        raise ValueError(f"tensor {name!r}: split over tiles and over K/V heads at once")
    if kv_heads is not None and KV.search(name) and (kinds != {"K/V head"} or slices[0][4]):
        # (a node pulls its heads' K/V from their parts, not from its tiles)
        raise ValueError(f"tensor {name!r} is a K/V projection of a version split by K/V "
                         f"head: its rows lie in the K/V parts {tiles + 1}..{tiles + kv_heads}")


def _check_tile_homes(manifests: list[Manifest]) -> None:
    """In a version in tiles a node pulls only its ranks' tiles, so a whole tensor in a
    tile would be missed by the other nodes: only a placed expert lies whole in a tile, in
    its own (`core/experts.py`); the others lie in part `tiles`."""
    tiles = manifests[0].tiles
    if manifests[0].experts is None and (name := next(
            (s.name for m in manifests for s in m.tensors if expert_of(s.name)), None)):
        raise ValueError(f"tensor {name!r} is a routed expert's: a version in tiles with "
                         f"experts says how they are laid out (experts='split' or "
                         f"'placed', as TiledPublisher does)")
    counts = expert_counts(s.name for m in manifests for s in m.tensors) \
        if manifests[0].experts == "placed" else {}
    for r, manifest in enumerate(manifests):
        for spec in manifest.tensors:
            home = expert_part(spec.name, counts, tiles) if counts else None
            if home is not None and (spec.piece is not None or r != home):
                what = "a slice" if spec.piece is not None else "whole"
                raise ValueError(f"expert tensor {spec.name!r} is {what} in part {r}; with "
                                 f"the experts placed it lies whole in part {home}")
            if home is None and spec.piece is None and r != tiles:
                raise ValueError(f"tensor {spec.name!r} is whole in part {r}: a tensor not "
                                 f"split over the tiles lies in part {tiles}, which every "
                                 f"node pulls")
