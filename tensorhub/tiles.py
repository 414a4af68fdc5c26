"""A version in tiles, so that a node of a tensor-parallel engine can pull only its share.

A node's ranks load a range of rows of each column-parallel weight (q/k/v, gate/up,
embeddings, the LM head) and a range of columns of each row-parallel weight (o_proj,
down_proj). Columns read one-sided as they lie in a row-major tensor cost one descriptor
per row, slower than reading the whole weight (`bench/results/share_reads.md`), so the
trainer lays each version out in `tiles` tiles in which every share is contiguous: tile t
holds rows [tR/T, (t+1)R/T) of each column-parallel weight and columns [tC/T, (t+1)C/T) of
each row-parallel one, stored contiguous (`TILED`). One more part holds what every rank
loads whole (norms, biases, tensors that do not divide).

Each tile is a part of a sharded version (`Publisher(part=, parts=)`), so it has its own
checksums, holders, relay forest and failover: a node pulls the parts of its tiles
(`PartedReplica(share=node_share(...))`) from whoever holds them, and serves them on to
the next node with the same share. A reader that pulls every part gets the whole tensors
back (`PartedReplica.tensors` joins the slices). With `tiles` a power of two, any TP size
up to it that divides it splits on tile edges.

A mixture of experts' experts are either split as a dense MLP is (`experts="split"`: what a
tensor-parallel engine's ranks load, a slice of every expert) or placed whole, tile t
holding experts [tE/T, (t+1)E/T) of each layer of E (`experts="placed"`: what an
expert-parallel engine's ranks load, their own experts, as the engines place them by
default). A node whose ranks load the other way pulls every tile.

With more ranks than K/V heads, each group of TP / heads ranks loads one head's K/V rows,
which span the group's tiles; where a group spans nodes, a node would pull the other
node's tiles for them. Given the model's K/V heads (`kv_heads`, fewer than the tiles), the
trainer splits the K/V projections by head instead, into parts of their own after the
whole part, and such a node pulls the tiles of its own ranks and its heads' K/V parts.
Design: docs/design/sharded-versions.md.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import get_args

import torch

from tensorhub.core.data_types import Manifest
from tensorhub.core.experts import (
    ExpertLayout,
    expert_counts,
    expert_of,
    expert_part,
    expert_tile,
)
from tensorhub.core.kv_heads import KV, kv_split
from tensorhub.core.layer_blocks import DECODER, MODEL
from tensorhub.core.layout import DEFAULT_COMPACT_THRESHOLD, manifest_of
from tensorhub.publisher import Publisher

# The weights tiled, by the dim tensor parallelism splits them on: a language model's
# decoder layers (Llama, Qwen, Mistral names; a mixture of experts' shared experts and,
# split, its experts: Qwen-MoE, DeepSeek and Mixtral names), column-parallel by output
# rows, row-parallel by input columns, and its embeddings and LM head by vocabulary rows.
# Under GQA with more ranks than K/V heads, a group of ranks loads one head's K/V rows
# (`node_share` pulls the whole group's tiles). Vision towers (engines may run them
# data-parallel) stay whole: their names do not match.
VOCAB = re.compile(MODEL + r"embed_tokens\.weight$|^(language_model\.)?lm_head\.weight$")
_MLP = r"(mlp\.(shared_experts?\.|experts\.\d+\.)?|block_sparse_moe\.experts\.\d+\.)"
TILED = {0: re.compile(DECODER + r"(self_attn\.[qkv]_proj|" + _MLP + r"(gate_proj|up_proj|w1|w3))"
                       r"\.weight$|" + VOCAB.pattern),
         1: re.compile(DECODER + r"(self_attn\.o_proj|" + _MLP + r"(down_proj|w2))\.weight$")}
EXPERTS = get_args(ExpertLayout)
# vLLM and SGLang pad the vocabulary to a multiple of this before they split it over TP
# ranks: only then are a rank's rows of a vocabulary that divides into the tiles its tiles.
VOCAB_PADDING = 64

# What a reader pulls of a version: its part count and part 0's manifest -> the parts.
Share = Callable[[int, Manifest], set[int]]


def split_dim(name: str) -> int | None:
    """The dim a tensor is tiled on (0: rows, 1: columns), or None: kept whole."""
    for dim, pattern in TILED.items():
        if pattern.search(name):
            return dim
    return None


@dataclass
class Tile:
    """One part of a tiled version: its tensors and the slice each is of."""

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (first, total)
    cols: dict[str, tuple[int, int]] = field(default_factory=dict)


def tile(named: Iterable[tuple[str, torch.Tensor]], tiles: int,
         split: Callable[[str], int | None] = split_dim,
         experts: ExpertLayout = "split", kv_heads: int | None = None) -> list[Tile]:
    """`tiles` + 1 parts of a state dict: parts 0..tiles-1 the tiles (column slices made
    contiguous: a copy of the row-parallel weights), part `tiles` every tensor kept whole
    (`split` says None, not 2-D, or not divisible into `tiles`; a vocabulary not a multiple
    of `VOCAB_PADDING` too). `experts="placed"`: each routed expert whole in its tile
    (`expert_tile`) instead of split. `kv_heads` fewer than `tiles` (`kv_split`): one more
    part per head, part tiles + 1 + h head h's rows of each K/V projection."""
    if tiles < 1:
        raise ValueError(f"tiles: at least 1, not {tiles}")
    if experts not in EXPERTS:
        raise ValueError(f"experts: one of {EXPERTS}, not {experts!r}")
    heads = kv_split(tiles, kv_heads)
    named = list(named)
    counts = expert_counts(n for n, _ in named) if experts == "placed" else {}
    parts = [Tile() for _ in range(tiles + 1 + (heads or 0))]
    for name, t in named:
        if counts and (home := expert_part(name, counts, tiles)) is not None:
            parts[home].tensors.append((name, t))
            continue
        dim = split(name)
        by_head = heads is not None and dim == 0 and KV.search(name) is not None
        count = heads if by_head else tiles
        multiple = math.lcm(tiles, VOCAB_PADDING) if VOCAB.search(name) else count
        if dim is None or t.dim() != 2 or t.shape[dim] % multiple:
            parts[tiles].tensors.append((name, t))
            continue
        step = t.shape[dim] // count
        for k in range(count):
            piece = t.narrow(dim, k * step, step)
            home = parts[tiles + 1 + k if by_head else k]
            home.tensors.append((name, piece.contiguous()))
            (home.cols if dim else home.rows)[name] = (k * step, t.shape[dim])
    if not parts[0].tensors:
        raise ValueError(f"nothing to tile: no decoder projection, embedding, LM head "
                         f"(`TILED`) or expert splits into {tiles} tiles")
    if heads is not None and not parts[tiles + 1].tensors:
        raise ValueError(f"kv_heads={heads}: no K/V projection (a decoder layer's "
                         f"self_attn.k_proj/v_proj weight, `core/kv_heads.py`) splits "
                         f"into {heads} heads by rows; give the model's "
                         f"num_key_value_heads, or publish without kv_heads (a fused "
                         f"qkv_proj is not split by head)")
    if not parts[tiles].tensors:
        raise ValueError("every tensor was tiled, none is left for the part every rank "
                         "loads whole (a model has norms): publish it untiled")
    return parts


def manifests(named: Iterable[tuple[str, torch.Tensor]], tiles: int,
              split: Callable[[str], int | None] = split_dim,
              compact_threshold: int = DEFAULT_COMPACT_THRESHOLD,
              experts: ExpertLayout = "split",
              kv_heads: int | None = None) -> list[Manifest]:
    """The manifests of `named` published in `tiles` tiles, part by part, as
    `TiledPublisher` publishes them (tensors on the meta device will do: only their
    shapes count). The simulator pulls versions of these."""
    named = list(named)
    said = experts_said(named, experts)
    heads = kv_split(tiles, kv_heads)
    return [manifest_of(part.tensors, compact_threshold, part.rows, part.cols, tiles,
                        experts=said, kv_heads=heads)
            for part in tile(named, tiles, split, experts, kv_heads)]


def experts_said(named: list[tuple[str, torch.Tensor]],
                 experts: ExpertLayout) -> ExpertLayout | None:
    """What a version's manifests say of its experts (`Manifest.experts`): how they are
    laid out, if it has any."""
    return experts if any(expert_of(n) is not None for n, _ in named) else None


def node_parts(ranks: Iterable[int], tp: int, tiles: int) -> set[int]:
    """The parts a node whose ranks are `ranks` (of a TP=`tp` engine) loads: each rank's
    1/tp of the tiles, and the part every rank loads whole."""
    if tiles % tp:
        raise ValueError(f"{tiles} tiles do not split over TP={tp}: use a multiple of {tp}")
    per_rank = tiles // tp
    wanted = {tiles}
    for rank in ranks:
        if not 0 <= rank < tp:
            raise ValueError(f"rank {rank} is not one of TP={tp}'s")
        wanted |= set(range(rank * per_rank, (rank + 1) * per_rank))
    return wanted


def placed_as_counted(part0: Manifest, total: int) -> bool:
    """Whether part 0 of a version with its experts placed holds what tile 0 holds of
    layers of `total` experts (the engine's count): each layer's first total / tiles
    experts, or none where they lie in the last part (a layer that does not divide, or a
    part 0 whose tensors were not given). A trainer that counts otherwise placed them
    elsewhere."""
    tiles = part0.tiles
    held: dict[str, set[int]] = {}
    for spec in part0.tensors:
        if (found := expert_of(spec.name)) is not None:
            held.setdefault(found[0], set()).add(found[1])
    if not held:
        return True
    return total % tiles == 0 and all(ids == set(range(total // tiles))
                                      for ids in held.values())


def heads_of(ranks: Iterable[int], tp: int, kv_heads: int) -> set[int] | None:
    """The K/V heads the ranks `ranks` of a TP=`tp` engine load: a group of tp / kv_heads
    ranks per head, or kv_heads / tp heads per rank (vLLM's and SGLang's rule); None where
    neither divides the other."""
    if tp % kv_heads == 0:
        return {r // (tp // kv_heads) for r in ranks}
    if kv_heads % tp == 0:
        per_rank = kv_heads // tp
        return {h for r in ranks for h in range(r * per_rank, (r + 1) * per_rank)}
    return None


@dataclass(frozen=True)
class NodeExperts:
    """The routed experts a node's expert-parallel ranks run (their numbers, the same in
    every layer) of each layer's `total`."""

    ids: frozenset[int]
    total: int


def node_share(ranks: Iterable[int], tp: int, kv_heads: int | None = None,
               experts: NodeExperts | None = None) -> Share:
    """What a node's copy pulls of each version (`PartedReplica(share=)`): its ranks'
    tiles of a version in tiles that split over `tp`; every part of any other.

    `kv_heads`: the model's K/V heads. With more ranks than heads, each group of
    tp / kv_heads ranks loads one head's K/V rows, the tiles of the whole group: a node
    whose ranks take part of a group pulls the group's tiles. Engines place ranks on nodes
    in blocks, so a node splits no group while tp / kv_heads divides its rank count; past
    that, a group of G nodes' ranks has each of them pull G nodes' tiles, unless the
    version splits its K/V by head (`Manifest.kv_heads`): then the node pulls its own
    ranks' tiles and the K/V parts of their heads (a version whose heads are not the
    engine's is pulled whole).

    `experts`: the node's ranks are expert-parallel and run these experts; they pull the
    tiles those experts are placed in. A version whose experts are laid out for the other
    kind of engine (split for tensor-parallel ranks, placed for expert-parallel ones) is
    pulled whole."""
    own = sorted(ranks)
    grouped = own
    if kv_heads and tp > kv_heads and tp % kv_heads == 0:
        group = tp // kv_heads
        grouped = sorted({q for r in own for q in range(r // group * group,
                                                        (r // group + 1) * group)})

    def share(parts: int, manifest: Manifest) -> set[int]:
        tiles = manifest.tiles
        if tiles is None or tiles % tp:
            return set(range(parts))
        if manifest.kv_heads is None:
            wanted = node_parts(grouped, tp, tiles)
        elif kv_heads not in (None, manifest.kv_heads) or \
                (heads := heads_of(own, tp, manifest.kv_heads)) is None:
            return set(range(parts))
        else:
            wanted = node_parts(own, tp, tiles) | {tiles + 1 + h for h in heads}
        if manifest.experts is None:
            return wanted
        if (experts is None) != (manifest.experts == "split"):
            return set(range(parts))
        if experts is not None:
            if not placed_as_counted(manifest, experts.total):
                return set(range(parts))
            homes = {expert_tile(e, experts.total, tiles) for e in experts.ids}
            wanted |= {home for home in homes if home is not None}
        return wanted

    return share


class TiledPublisher:
    """A trainer that publishes each version in `tiles` tiles (`tile`): one `Publisher`
    per part, named `<name>.tile<k>`, publishing together. `experts`: how a mixture of
    experts' experts are laid out, for the engines that follow it (`"split"` for
    tensor-parallel ones, `"placed"` for expert-parallel ones). `kv_heads`: the model's
    K/V heads (`config.num_key_value_heads`); with fewer than `tiles`, the K/V projections
    are published by head in parts of their own (`tile`), so that an engine whose K/V
    groups span nodes pulls no other node's tiles."""

    def __init__(self, coordinator: str, model: str, tiles: int = 8, *,
                 name: str = "trainer", split: Callable[[str], int | None] = split_dim,
                 experts: ExpertLayout = "split", kv_heads: int | None = None,
                 **publisher_kw):
        if experts not in EXPERTS:
            raise ValueError(f"experts: one of {EXPERTS}, not {experts!r}")
        self.tiles, self.split, self.experts = tiles, split, experts
        self.kv_heads = kv_split(tiles, kv_heads)
        self._open(coordinator, model, f"{name}.tile", tiles + 1 + (self.kv_heads or 0),
                   publisher_kw)

    def _open(self, coordinator: str, model: str, prefix: str, parts: int,
              publisher_kw: dict) -> None:
        """One `Publisher` per part, named `<prefix><k>`."""
        self.parts: list[Publisher] = []
        try:
            for k in range(parts):
                self.parts.append(Publisher(coordinator, model, name=f"{prefix}{k}",
                                            part=k, parts=parts, **publisher_kw))
        except BaseException:
            self.close()
            raise
        self.version: int | None = None

    def _pieces(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[list, dict]]:
        """Each part's tensors and what its publish says of them."""
        said = {"tiles": self.tiles, "experts": experts_said(items, self.experts),
                "kv_heads": self.kv_heads}
        return [(piece.tensors, {"rows": piece.rows, "cols": piece.cols, **said})
                for piece in tile(items, self.tiles, self.split, self.experts, self.kv_heads)]

    def publish(self, named: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
                version: int | None = None) -> int:
        """Publish `named` as `version` (default: the next) in tiles; returns once every
        part is in. Raises what the first part that failed raised."""
        items = list(named.items()) if isinstance(named, dict) else list(named)
        pieces = self._pieces(items)
        if version is None:
            version = max(self.parts[0].latest(), self.version or 0) + 1
        with ThreadPoolExecutor(len(self.parts)) as pool:
            futures = [pool.submit(p.publish, tensors, version, **said)
                       for p, (tensors, said) in zip(self.parts, pieces, strict=True)]
            for f in futures:
                f.result()
        self.version = version
        return version

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def __enter__(self) -> TiledPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
