"""A version in layer blocks, so that a pipeline stage of an engine pulls only its layers.

A pipeline-parallel engine's stage runs a contiguous range of the decoder's layers, the
first stage the embeddings too and the last the final norm and the LM head (and the
embeddings again where the head is tied to them). Across nodes, a stage that pulls the
whole model pulls what the other stages run. So the trainer lays each version out in
layer blocks (`tensorhub/core/layer_blocks.py`): part 0 what lies outside the layers and
the head, one part per block of layers, one for the head. By default the blocks' edges are
where the engines begin a stage at PP = 2, 4 and 8 (`stage_edges`): at most 12 blocks,
and a stage of those sizes pulls exactly its layers. Each part is a part of a sharded
version (`Publisher(part=, parts=)`) with its own checksums, holders and relay forest; a
stage's copy pulls the parts its parameters come from (`stage_share`): its layers (and,
where a block straddles two stages, the other stage's layers of that block), and parts 0
and the head where it runs them. A reader of every part has the whole model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from tensorhub.core.data_types import Manifest
from tensorhub.core.layer_blocks import (
    HEAD,
    even_edges,
    layer_of,
    layer_part,
    part_of,
    stage_edges,
)
from tensorhub.tiles import Share, TiledPublisher

Named = list[tuple[str, torch.Tensor]]


def decoder_layers(names: Iterable[str]) -> int:
    """The decoder's layer count, as the tensors' names give it (0: none)."""
    return 1 + max((layer for n in names if (layer := layer_of(n)) is not None), default=-1)


def split(named: Iterable[tuple[str, torch.Tensor]], blocks: int | None = None
          ) -> tuple[list[Named], list[int]]:
    """The parts of a state dict in layer blocks, and the blocks' edges: `blocks` blocks of
    equal layer counts, or (None) the engines' stage edges at PP = 2, 4 and 8."""
    named = list(named)
    layers = decoder_layers(n for n, _ in named)
    if not layers:
        raise ValueError("no decoder layer (`model.layers.<i>.`) to split")
    if blocks is not None and not 1 <= blocks <= layers:
        raise ValueError(f"blocks: 1 to the decoder's {layers} layers, not {blocks}")
    edges = stage_edges(layers) if blocks is None else even_edges(layers, blocks)
    parts: list[Named] = [[] for _ in range(len(edges) + 1)]
    for name, t in named:
        parts[part_of(name, edges)].append((name, t))
    for k in (0, len(edges)):
        if not parts[k]:
            what = "embeddings" if k == 0 else "head (final norm, LM head)"
            raise ValueError(f"no tensor outside the decoder's layers for the {what} part: "
                             f"publish it unsplit")
    return parts, edges


def stage_share(parameters: Iterable[str]) -> Share:
    """What a pipeline stage's copy pulls of each version (`PartedReplica(share=)`), from
    the names of the parameters the stage runs (vLLM's and SGLang's keep the checkpoint's
    prefixes and layer numbers): of a version in layer blocks, the parts they come from;
    every part of any other."""
    names = list(parameters)
    layers = {layer for n in names if (layer := layer_of(n)) is not None}
    outside = any(layer_of(n) is None and not HEAD.search(n) for n in names)
    head = any(HEAD.search(n) for n in names)

    def share(parts: int, manifest: Manifest) -> set[int]:
        if manifest.blocks is None:
            return set(range(parts))
        edges = manifest.blocks
        wanted = {layer_part(layer, edges) for layer in layers if layer < edges[-1]}
        # (a stage running layers the version has not: part 0 places their names, so its
        # check finds them missing and refuses the version, as it would a whole one)
        if outside or not wanted or any(layer >= edges[-1] for layer in layers):
            wanted.add(0)
        if head:
            wanted.add(len(edges))
        return wanted

    return share


class LayeredPublisher(TiledPublisher):
    """A trainer that publishes each version in layer blocks (`split`: `blocks` equal ones,
    or by default the engines' stage edges): one `Publisher` per part, named
    `<name>.block<k>`, publishing together. Its parts open with the first version (their
    count follows from its layers), or at once given `layers`, the decoder's layer count."""

    def __init__(self, coordinator: str, model: str, blocks: int | None = None, *,
                 layers: int | None = None, name: str = "trainer", **publisher_kw):
        self.blocks, self.edges = blocks, None
        self.parts, self.version = [], None
        self._opening = (coordinator, model, f"{name}.block", publisher_kw)
        if layers is not None:
            self._open_for(layers)

    def _open_for(self, layers: int) -> None:
        """Open the parts (again, after a first open that failed) for `layers` layers."""
        edges = stage_edges(layers) if self.blocks is None else even_edges(layers, self.blocks)
        coordinator, model, prefix, publisher_kw = self._opening
        try:
            self._open(coordinator, model, prefix, len(edges) + 1, publisher_kw)
        except BaseException:
            self.parts = []
            raise
        self.edges = edges

    def _pieces(self, items: Named) -> list[tuple[list, dict]]:
        parts, edges = split(items, self.blocks)
        if self.edges is None:
            self._open_for(edges[-1])
        elif edges != self.edges:
            raise ValueError(f"a state of {edges[-1]} decoder layers published by a "
                             f"LayeredPublisher whose parts are {self.edges[-1]} layers'")
        return [(tensors, {"blocks": edges}) for tensors in parts]
