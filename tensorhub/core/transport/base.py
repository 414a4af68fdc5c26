"""The transport interface: expose local memory, and read a peer's memory one-sided.

A transport knows nothing of versions or plans. Workers hand it byte buffers to expose and
lists of (local destination, remote descriptor) pairs to read; the coordinator decides who
reads what from whom.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tensorhub.core.data_types import Endpoint, MemoryDesc


@dataclass(frozen=True)
class ReadOp:
    """Copy `remote` (a holder's registered bytes) into `local` (a uint8 view of ours)."""

    local: torch.Tensor
    remote: MemoryDesc


@dataclass(frozen=True)
class Peer:
    """A holder as a transport sees it: a stable id and how to reach its memory."""

    worker_id: str
    endpoint: Endpoint
    grant: str | None = None  # the coordinator's leave to read it (`grants.py`)


class Transport(ABC):
    """One implementation per module: `nixl` (one-sided READ), `zmq` (fallback), `cma`
    (same-host process_vm_readv) and `auto` (cma for same-host peers, nixl for the rest)."""

    name: str
    # The key this transport's server checks readers' grants with (`grants.py`), given to
    # the coordinator at registration; None: a transport that cannot check who reads.
    grant_key: str | None = None

    @abstractmethod
    def register(self, buffers: list[torch.Tensor]) -> None:
        """Expose buffers (contiguous uint8 views) so peers may read them, and so we may read
        into them. Call `endpoint()` afterwards: peers need the fresh endpoint."""

    @abstractmethod
    def deregister(self, buffers: list[torch.Tensor]) -> None: ...

    @abstractmethod
    def endpoint(self) -> Endpoint:
        """What a peer needs to read our registered memory (a snapshot)."""

    @abstractmethod
    def read(self, peer: Peer, ops: list[ReadOp], timeout: float) -> None:
        """Read every op from `peer` into local memory; raise `TransferError` on failure or
        when `timeout` seconds pass. Local destinations must lie in registered memory."""

    def forget_peer(self, worker_id: str) -> None:  # noqa: B027 - optional hook
        """Drop cached connection state for a peer that left."""

    @property
    def late_reads(self) -> int:
        """Reads given up (timed out) whose bytes landed later after all. Zero where a read
        is over when `read` returns; a copy verified before this count grew must be
        verified again before it is used."""
        return 0

    @abstractmethod
    def close(self) -> None: ...


def check_ops(ops: list[ReadOp]) -> None:
    for op in ops:
        local_bytes = op.local.numel() * op.local.element_size()
        if local_bytes != op.remote.nbytes:
            raise ValueError(
                f"read of {op.remote.nbytes} bytes into a {local_bytes}-byte destination"
            )
