"""Same-host reads from a holder's shared memory: map its memfd once, then memcpy.

A holder on `auto` lists the buffers it keeps in shared memory in its endpoint (see
`core.shared_memory`). A reader on the same host opens each through
`/proc/<pid>/fd/<fd>`, checks that it is the file the holder named (inode), that it is
sealed against shrinking (a mapped file that shrinks kills the reader with SIGBUS) and long
enough, maps it read-only and keeps the mapping: every later pull from that holder is a
memcpy out of the mapping, shared by two threads (`parallel_copy`), like the memcpy baseline
(bench/same_node).

Not a `Transport` of its own: it reads only what a holder keeps in shared memory, so `auto`
asks it first and sends the rest of a read to cma or NIXL. Mappings of a holder are dropped
when its endpoint no longer lists them (it freed or replaced the buffer) and when the holder
leaves or exits; a mapping keeps the holder's memory alive only while we hold it. (A live
holder that replaces a buffer and is never read from again keeps its old one alive in our
mapping until it leaves.)
"""

from __future__ import annotations

import ctypes
import threading
import time

import torch

from tensorhub import settings
from tensorhub.core.data_types import SharedRegion
from tensorhub.core.errors import TransferError
from tensorhub.core.shared_memory import MapError, map_region
from tensorhub.core.transport.base import Peer, ReadOp
from tensorhub.core.transport.cma import exited
from tensorhub.core.transport.parallel_copy import CopyPool, Segment


class ShmNotPermitted(TransferError):
    """The kernel would not let us open the holder's memory file (another user, Yama
    ptrace_scope 2-3): `auto` reads this holder another way from then on."""


def region_of(peer: Peer, op: ReadOp) -> SharedRegion | None:
    """The holder's shared region that contains all of `op`'s remote bytes, if any."""
    if op.remote.mem != "DRAM" or op.local.device.type != "cpu":
        return None
    start, end = op.remote.addr, op.remote.addr + op.remote.nbytes
    for r in peer.endpoint.shared:
        if r.addr <= start and end <= r.addr + r.nbytes:
            return r
    return None


class ShmReader:
    """Maps same-host holders' shared regions (cached per holder) and copies out of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies = CopyPool("tensorhub-shm")
        self._pruned = 0.0  # when mappings of exited holders were last let go
        # worker id -> (pid, pid started, fd, inode) -> a read-only view of the whole region
        self._maps: dict[str, dict[tuple[int, int | None, int, int], torch.Tensor]] = {}

    def read(self, peer: Peer, ops: list[tuple[ReadOp, SharedRegion]], deadline: float,
             timeout: float) -> None:
        """Copy every op out of its region; `TransferError` if the holder is gone, its file
        is not what it claims, or `deadline` passes."""
        if not ops:
            return
        ep = peer.endpoint
        assert ep.pid is not None
        if exited(ep.pid, ep.pid_started):
            raise TransferError(f"holder {peer.worker_id} (pid {ep.pid}) has exited",
                                peer.worker_id)
        views = self._views(peer)
        segments = []
        for op, region in ops:
            view = views.get(region.addr)
            if view is None:
                view = views[region.addr] = self._map(peer, region)
            segments.append((op.local.data_ptr(),
                             view.data_ptr() + op.remote.addr - region.addr, op.remote.nbytes))

        def copy(call: list[Segment]) -> None:
            if time.monotonic() > deadline:
                raise TransferError(f"shared-memory read from {peer.worker_id} did not "
                                    f"finish within {timeout:.1f}s", peer.worker_id)
            for local, mapped, n in call:
                ctypes.memmove(local, mapped, n)  # releases the GIL

        self._copies.run(segments, copy)

    def _key(self, peer: Peer, r: SharedRegion) -> tuple[int, int | None, int, int]:
        assert peer.endpoint.pid is not None
        return (peer.endpoint.pid, peer.endpoint.pid_started, r.fd, r.inode)

    def _views(self, peer: Peer) -> dict[int, torch.Tensor]:
        """Our mappings of the regions `peer` lists now, by region address; mappings of
        regions it no longer lists are dropped (unmapped once no copy uses them)."""
        wanted = {self._key(peer, r): r for r in peer.endpoint.shared}
        now = time.monotonic()
        with self._lock:
            cached = self._maps.get(peer.worker_id, {})
            kept = {k: v for k, v in cached.items() if k in wanted}
            self._maps[peer.worker_id] = kept
            if now - self._pruned > settings.SHM_PRUNE_SECONDS:
                # A mapping keeps a holder's memory alive: let go of holders that exited.
                self._pruned = now
                for worker_id, maps in list(self._maps.items()):
                    if any(exited(pid, started) for pid, started, *_ in maps):
                        del self._maps[worker_id]
        return {wanted[k].addr: v for k, v in kept.items()}

    def _map(self, peer: Peer, region: SharedRegion) -> torch.Tensor:
        who = f"holder {peer.worker_id} (pid {peer.endpoint.pid})"
        try:
            view = map_region(peer.endpoint.pid, region)
        except MapError as exc:
            kind = ShmNotPermitted if exc.denied else TransferError
            raise kind(f"shared-memory read from {who}: {exc}", peer.worker_id) from None
        except OSError as exc:
            raise TransferError(f"cannot map the shared memory of {who}: {exc}",
                                peer.worker_id) from None
        with self._lock:
            self._maps.setdefault(peer.worker_id, {})[self._key(peer, region)] = view
        return view

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self._maps.pop(worker_id, None)

    def close(self) -> None:
        self._copies.close()
        with self._lock:
            self._maps.clear()
