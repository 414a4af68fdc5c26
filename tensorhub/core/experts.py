"""Where a mixture of experts' routed experts lie in a version in tiles placed for
expert-parallel engines (`Manifest.experts == "placed"`): the rule the trainer places them
by (`tensorhub/tiles.py`), the coordinator checks a publish against, and a node's copy picks
its tiles by (the experts its ranks run).

Tile t of T holds experts [tE/T, (t+1)E/T) of each layer of E, whole, where T divides E:
the experts vLLM and SGLang give each expert-parallel rank by default (their linear
placement) are then the experts of its tiles. A layer whose experts do not divide into the
tiles keeps them in the last part, which every rank loads.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from tensorhub.core.layer_blocks import DECODER

# How a version in tiles lays out its experts: split as a dense MLP, or placed whole.
ExpertLayout = Literal["split", "placed"]
# A routed expert's tensor (Qwen-MoE, DeepSeek, Mixtral names): its layer's experts'
# prefix, and its number. Shared experts are not routed: every rank loads them.
EXPERT = re.compile(r"^(?P<layer>" + DECODER[1:] + r"(mlp|block_sparse_moe)\.experts\.)"
                    r"(?P<expert>\d+)\.")


def expert_of(name: str) -> tuple[str, int] | None:
    """(its layer's experts' prefix, its number) of a routed expert's tensor; else None."""
    m = EXPERT.search(name)
    return (m.group("layer"), int(m.group("expert"))) if m else None


def expert_counts(names: Iterable[str]) -> dict[str, int]:
    """The number of experts of each layer (by its experts' prefix) these names hold."""
    counts: dict[str, int] = {}
    for name in names:
        if (found := expert_of(name)) is not None:
            counts[found[0]] = max(counts.get(found[0], 0), found[1] + 1)
    return counts


def expert_tile(expert: int, experts: int, tiles: int) -> int | None:
    """The tile that holds expert `expert` of a layer of `experts`, placed (None: they do
    not divide into the tiles, and lie whole in part `tiles`, which every rank loads)."""
    return expert * tiles // experts if experts % tiles == 0 else None


def expert_part(name: str, counts: dict[str, int], tiles: int) -> int | None:
    """The part a tensor of a version in `tiles` tiles with its experts placed lies in, if
    it is a routed expert's (`counts`: `expert_counts` of the whole version)."""
    found = expert_of(name)
    if found is None:
        return None
    home = expert_tile(found[1], counts[found[0]], tiles)
    return tiles if home is None else home
