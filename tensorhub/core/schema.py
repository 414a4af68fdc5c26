"""What every structure that crosses a process boundary is checked against: the strict base
model (an unknown field is an error), the limits on sizes and counts that keep a hostile or
broken peer from making us allocate without bound, the protocol's version, and the field
types the messages share (names, versions, dtypes). The messages are `data_types.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# Limits checked at the edge: a hostile or broken peer cannot make us allocate without bound.
MAX_NAME = 512  # characters of a name (model, worker, tensor): longer than any real one
MAX_TENSORS = 200_000  # tensors in one manifest: many times a large model's
MAX_DIMS = 8  # dimensions of one tensor
MAX_METADATA = 16 * 1024 * 1024  # bytes of a peer's opaque transport metadata (NIXL's blob)
# The wire protocol's version: peers of releases that speak another one are refused with
# a clear error (`wire.foreign`), not a failed validation.
PROTOCOL = 7
MAX_PARTS = 64  # trainer ranks that publish one version together (`Publish.parts`)

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
Version = Annotated[int, Field(ge=1, lt=2**62)]
# The dtypes a manifest may name: those every transport copies as raw bytes.
DTYPES = (
    "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2",
    "int8", "uint8", "int16", "int32", "int64", "bool",
)  # fmt: skip
DType = Literal[DTYPES]  # type: ignore[valid-type]


class Strict(BaseModel):
    """Base: unknown fields are errors, so a typo or a hostile field never passes silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)
