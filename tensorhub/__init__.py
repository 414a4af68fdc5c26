"""TensorHub: reference-oriented weight transfer for LLM reinforcement learning.

The coordinator stores no weights, only references to which workers hold which immutable
version; workers pull a version one-sided from peers that hold it and then serve it on.

`Publisher`, `TiledPublisher`, `LayeredPublisher`, `Replica` and `PartedReplica` are imported
when first used: a process that only asks the coordinator (`tensorhub status`) does not
load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorhub.core.errors import (
    AddressError,
    CoordinatorError,
    CoordinatorUnavailable,
    IntegrityError,
    LayoutError,
    TensorHubError,
    TransferError,
)

if TYPE_CHECKING:
    from tensorhub.parted import PartedReplica
    from tensorhub.publisher import Publisher
    from tensorhub.replica import Replica
    from tensorhub.stages import LayeredPublisher
    from tensorhub.tiles import TiledPublisher

_LAZY = {"PartedReplica": "tensorhub.parted", "Publisher": "tensorhub.publisher",
         "Replica": "tensorhub.replica", "TiledPublisher": "tensorhub.tiles",
         "LayeredPublisher": "tensorhub.stages"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tensorhub' has no attribute {name!r}")


__all__ = [
    "AddressError",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "IntegrityError",
    "LayeredPublisher",
    "LayoutError",
    "PartedReplica",
    "Publisher",
    "Replica",
    "TensorHubError",
    "TiledPublisher",
    "TransferError",
]
