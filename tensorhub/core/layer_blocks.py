"""Which part of a version in layer blocks holds a tensor, by its name: the rule the trainer
splits by (`tensorhub/stages.py`), the coordinator checks a publish against, and a pipeline
stage picks its parts by (the names of the parameters it runs).

A version in layer blocks carries its blocks' edges, `edges` = [0, e1, ..., layers]: block b
holds the decoder's layers [edges[b], edges[b + 1]). It has len(edges) + 1 parts: part 0
what lies outside the decoder's layers and its head (the embeddings, and anything the
names do not place), part 1 + b block b, the last part the head (the final norm and the LM
head). By default the edges are those of the engines' pipeline stages (`stage_edges`), so
that a stage of any usual size pulls exactly its layers.
"""

from __future__ import annotations

import bisect
import re

# A language model's names (Llama, Qwen, Mistral; HF checkpoints and vLLM's parameters
# alike): its decoder layers, and its head.
MODEL = r"^(model\.|model\.language_model\.|language_model\.model\.)"
DECODER = MODEL + r"layers\.\d+\."
LAYER = re.compile(MODEL + r"layers\.(\d+)\.")
HEAD = re.compile(MODEL + r"norm\.weight$|^(language_model\.)?lm_head\.weight$")
# The pipeline sizes whose stage edges the default blocks follow.
STAGES = (2, 4, 8)


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to (None: none)."""
    m = LAYER.search(name)
    return int(m.group(2)) if m else None


def pp_layers(layers: int, stage: int, stages: int) -> range:
    """The decoder layers vLLM and SGLang place on pipeline stage `stage` of `stages`
    (their `get_pp_indices`, with no partition given): an even split, the layers left over
    going one each to the stages before the last, from the last but one back."""
    sizes = [layers // stages] * stages
    for i in range(2, layers % stages + 2):
        sizes[-i] += 1
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


def stage_edges(layers: int, stages: tuple[int, ...] = STAGES) -> list[int]:
    """Block edges on which the stages of every pipeline size in `stages` begin and end
    (sizes over `layers` left out)."""
    edges = {0, layers}
    for pp in stages:
        if pp <= layers:
            edges |= {pp_layers(layers, s, pp).start for s in range(pp)}
    return sorted(edges)


def even_edges(layers: int, blocks: int) -> list[int]:
    """`blocks` blocks of (nearly) equal layer counts."""
    return [b * layers // blocks for b in range(blocks)] + [layers]


def layer_part(layer: int, edges: list[int]) -> int:
    """The part that holds decoder layer `layer` (< edges[-1]): its block's."""
    return bisect.bisect_right(edges, layer)


def part_of(name: str, edges: list[int]) -> int:
    """The part of a version in the layer blocks `edges` that holds `name`."""
    layer = layer_of(name)
    if layer is not None and layer < edges[-1]:
        return layer_part(layer, edges)
    return len(edges) if HEAD.search(name) else 0
