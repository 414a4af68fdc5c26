"""TensorHub: reference-oriented weight transfer for LLM reinforcement learning.

The coordinator stores no weights, only references to which workers hold which immutable
version; workers pull a version one-sided from peers that hold it and then serve it on.
"""

from tensorhub.core.errors import (
    AddressError,
    CoordinatorError,
    CoordinatorUnavailable,
    IntegrityError,
    LayoutError,
    TensorHubError,
    TransferError,
)
from tensorhub.parted import PartedReplica
from tensorhub.publisher import Publisher
from tensorhub.replica import Replica

__all__ = [
    "AddressError",
    "CoordinatorError",
    "CoordinatorUnavailable",
    "IntegrityError",
    "LayoutError",
    "PartedReplica",
    "Publisher",
    "Replica",
    "TensorHubError",
    "TransferError",
]
