"""K/V projections split by head: with more TP ranks than K/V heads, each group of
TP / heads ranks loads one head's K/V rows, so a version in tiles can give each head's
rows a part of its own (`tiles.tile`, `Manifest.kv_heads`). Here is what the trainer's
tiling and the coordinator's check of it both read, free of torch."""

from __future__ import annotations

import re

from tensorhub.core.layer_blocks import DECODER

# The checkpoint tensors split by head: a decoder layer's K and V projection weights
# (their biases are 1-D and stay whole; a fused qkv_proj is not split by head).
KV = re.compile(DECODER + r"self_attn\.[kv]_proj\.weight$")


def kv_split(tiles: int, kv_heads: int | None) -> int | None:
    """The K/V heads a version in `tiles` tiles splits its K/V projections by, in parts of
    their own: `kv_heads` when there are fewer of them than tiles, else None (the tiles
    already end on heads)."""
    if kv_heads is not None and kv_heads < 1:
        raise ValueError(f"kv_heads: at least 1, not {kv_heads}")
    return kv_heads if kv_heads is not None and kv_heads < tiles else None
