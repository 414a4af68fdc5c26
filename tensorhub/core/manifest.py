"""A layout's manifest: the ordered tensors (names, dtypes, shapes, and for a part of a
sharded version the slice each is of) and the compaction threshold that fix its bytes.
Its hash is the layout id (`layout.py`)."""

from __future__ import annotations

import itertools
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from tensorhub.core.experts import ExpertLayout
from tensorhub.core.schema import MAX_DIMS, MAX_PARTS, MAX_TENSORS, DType, Name, Strict


class TensorSpec(Strict):
    """One tensor of a layout: what a reader must allocate to receive it."""

    name: Name
    dtype: DType
    shape: list[Annotated[int, Field(ge=0, lt=2**40)]] = Field(max_length=MAX_DIMS)
    nbytes: Annotated[int, Field(ge=0, lt=2**44)]
    # Rows [start, stop) of a tensor of `total` rows (dim 0), the rest held by other parts
    # of a sharded version (`Publish.parts`). None: the whole tensor.
    rows: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)],
                Annotated[int, Field(ge=1, lt=2**40)]] | None = None
    # Columns [start, stop) of a 2-D tensor of `total` columns (dim 1), held contiguous (a
    # row-parallel weight's tile, `tensorhub/tiles.py`). Never with `rows`.
    cols: tuple[Annotated[int, Field(ge=0)], Annotated[int, Field(ge=0)],
                Annotated[int, Field(ge=1, lt=2**40)]] | None = None

    @model_validator(mode="after")
    def _slice_fits(self) -> TensorSpec:
        if self.rows is not None and self.cols is not None:
            raise ValueError(f"tensor {self.name!r}: a slice of rows or of columns, not both")
        if (piece := self.piece) is not None:
            dim, start, stop, total = piece
            what = ("rows", "cols")[dim]
            if not (start <= stop <= total and len(self.shape) > dim
                    and self.shape[dim] == stop - start and (dim == 0 or len(self.shape) == 2)):
                raise ValueError(f"tensor {self.name!r}: {what} {(start, stop, total)} do not "
                                 f"fit shape {self.shape} (need start <= stop <= total, "
                                 f"shape[{dim}] = stop - start{', 2-D' if dim else ''})")
        return self

    @property
    def piece(self) -> tuple[int, int, int, int] | None:
        """(dim, start, stop, total) of a slice of a larger tensor; None: the whole one."""
        if self.rows is not None:
            return (0, *self.rows)
        if self.cols is not None:
            return (1, *self.cols)
        return None

    @property
    def whole_shape(self) -> tuple[int, ...]:
        """The shape of the whole tensor this spec is (a slice of)."""
        piece = self.piece
        if piece is None:
            return tuple(self.shape)
        shape = list(self.shape)
        shape[piece[0]] = piece[3]
        return tuple(shape)


class Manifest(Strict):
    """An ordered list of tensors plus the compaction threshold: together they fix the bytes.

    Its hash is the layout id; two workers can exchange raw bytes only if their ids match.
    """

    tensors: list[TensorSpec] = Field(max_length=MAX_TENSORS)
    compact_threshold: Annotated[int, Field(ge=0, lt=2**40)]
    # A part of a version published in tiles (`tensorhub/tiles.py`): parts 0..tiles-1 are
    # the tiles, part `tiles` what every rank loads whole.
    tiles: Annotated[int, Field(ge=1, lt=MAX_PARTS)] | None = None
    # A part of a version in layer blocks (`core/layer_blocks.py`): the blocks' edges,
    # [0, ..., the decoder's layers]; part 0 what lies outside the layers and the head,
    # part 1 + b block b's layers, the last part the head.
    blocks: list[Annotated[int, Field(ge=0, lt=2**20)]] | None = Field(
        default=None, min_length=2, max_length=MAX_PARTS - 1)
    # How a version in tiles holds a mixture of experts' expert weights: "split", each
    # expert split over the tiles as a dense MLP is (what tensor-parallel ranks load);
    # "placed", each expert whole in one tile, tile t the experts [tE/T, (t+1)E/T) of each
    # layer of E (what expert-parallel ranks load). None: no experts in tiles.
    experts: ExpertLayout | None = None
    # A version in tiles whose K/V projections are split by K/V head instead, in parts of
    # their own: part tiles + 1 + h holds head h's rows (a node whose ranks share a head
    # with another node's then pulls that head's K/V rows, not the other node's tiles).
    kv_heads: Annotated[int, Field(ge=1, lt=MAX_PARTS)] | None = None

    @field_validator("blocks")
    @classmethod
    def _edges_rise_from_zero(cls, edges: list[int] | None) -> list[int] | None:
        if edges is not None and (edges[0] != 0 or any(
                b <= a for a, b in itertools.pairwise(edges))):
            raise ValueError(f"layer block edges rise from 0, one block at least: {edges}")
        return edges

    @model_validator(mode="after")
    def _experts_in_tiles(self) -> Manifest:
        if self.experts is not None and self.tiles is None:
            raise ValueError("experts are split or placed over tiles: only in a version in "
                             "tiles")
        if self.kv_heads is not None and self.tiles is None:
            raise ValueError("K/V heads in parts of their own: only in a version in tiles")
        return self

    @property
    def tiling(self) -> str | None:
        """How a version in tiles is cut, in words: what the rows a node's share holds
        depend on (None: not in tiles)."""
        if self.tiles is None:
            return None
        return f"{self.tiles} tiles" + (f", K/V by {self.kv_heads} heads" if self.kv_heads
                                        else "") + (f", experts {self.experts}"
                                                    if self.experts else "")

    @property
    def tile_parts(self) -> int | None:
        """The parts of a version in tiles: the tiles, the part every rank loads whole, and
        one per K/V head if its K/V projections are split by head. None: not in tiles."""
        if self.tiles is None:
            return None
        return self.tiles + 1 + (self.kv_heads or 0)
