"""NIXL for every peer, shared memory or cross-memory attach for peers on this host: the
fastest path per read.

A worker on `auto` registers its memory with NIXL and advertises a NIXL endpoint that also
carries its pid, host identity and the buffers it keeps in shared memory. Any NIXL reader
can read it; an `auto` reader on the same host maps the holder's shared buffers and copies
with memcpy (see `shm`; a publisher's snapshot and a replica that allocated its own tensors
live there), and copies the rest straight out of the holder's memory with
`process_vm_readv` (see `cma`; an engine's own parameters), instead of streaming through
UCX over loopback. Peers elsewhere, peers that advertise no pid (plain `nixl` workers), and
GPU memory go through NIXL.

Why a module of its own rather than an option inside `nixl` or `cma`: each of those stays
one mechanism with its own failure modes, and the choice between them (per peer, per read)
is this module's one idea. The endpoint keeps transport "nixl" so `auto` and `nixl`
workers interoperate both ways.

GPU: the same-node path for VRAM is CUDA IPC. Set TENSORHUB_CUDA_IPC=1 and NIXL's UCX
backend gets `cuda_copy,cuda_ipc` in its default transports, so a same-host VRAM READ maps
the holder's allocation by CUDA IPC handle and copies device to device. Not tested here
(this machine has no GPU).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from tensorhub.core.data_types import Endpoint, SharedRegion
from tensorhub.core.shared_memory import regions_of
from tensorhub.core.transport.base import Peer, ReadOp, Transport, check_ops
from tensorhub.core.transport.cma import CmaNotPermitted, CmaTransport, CmaUnavailable
from tensorhub.core.transport.nixl import NixlTransport
from tensorhub.core.transport.shm import ShmNotPermitted, ShmReader, region_of

log = logging.getLogger("tensorhub.transport.auto")


class AutoTransport(Transport):
    name = "auto"

    def __init__(self, agent_name: str | None = None, host: str = "127.0.0.1"):
        self._nixl = NixlTransport(agent_name=agent_name, host=host)
        try:
            self._cma: CmaTransport | None = CmaTransport()
        except CmaUnavailable as exc:
            log.info("same-host reads go through NIXL: %s", exc)
            self._cma = None
        self._shm = ShmReader()
        self._lock = threading.Lock()
        self._refused: set[str] = set()  # peers whose memory the kernel would not let us read
        self._shared: dict[int, SharedRegion] = {}  # registered buffer -> its shared region

    def register(self, buffers: list[torch.Tensor]) -> None:
        self._nixl.register(buffers)
        if self._cma is not None and all(b.device.type == "cpu" for b in buffers):
            self._cma.register(buffers)
            with self._lock:
                for b in buffers:
                    for region in regions_of([b]):
                        self._shared[b.data_ptr()] = region

    def deregister(self, buffers: list[torch.Tensor]) -> None:
        self._nixl.deregister(buffers)
        with self._lock:
            for b in buffers:
                self._shared.pop(b.data_ptr(), None)

    def endpoint(self) -> Endpoint:
        ep = self._nixl.endpoint()
        if self._cma is None:
            return ep
        with self._lock:
            shared = {r.addr: r for r in self._shared.values()}
        return ep.model_copy(update={"pid": self._cma.pid, "pid_started": self._cma.pid_started,
                                     "host": self._cma.host,
                                     "shared": sorted(shared.values(), key=lambda r: r.addr)})

    def same_host(self, peer: Peer, ops: list[ReadOp]) -> bool:
        """Whether this read can go by cross-memory attach."""
        with self._lock:
            refused = peer.worker_id in self._refused
        return (self._cma is not None and not refused and self._cma.reaches(peer.endpoint)
                and all(op.local.device.type == "cpu" and op.remote.mem == "DRAM"
                        for op in ops))

    def read(self, peer: Peer, ops: list[ReadOp], timeout: float) -> None:
        if self.same_host(peer, ops):
            assert self._cma is not None
            deadline = time.monotonic() + timeout
            check_ops(ops)
            mapped = [(op, region_of(peer, op)) for op in ops]
            try:
                self._shm.read(peer, [(op, r) for op, r in mapped if r is not None],
                               deadline, timeout)
                rest = [op for op, r in mapped if r is None]
                return self._cma.read(peer, rest, max(0.0, deadline - time.monotonic()))
            except (CmaNotPermitted, ShmNotPermitted) as exc:  # a permission, not a failure
                log.warning("%s; reading it through NIXL from now on", exc)
                with self._lock:
                    self._refused.add(peer.worker_id)
        return self._nixl.read(peer, ops, timeout)

    @property
    def late_reads(self) -> int:
        return self._nixl.late_reads

    def forget_peer(self, worker_id: str) -> None:
        with self._lock:
            self._refused.discard(worker_id)
        self._shm.forget(worker_id)
        self._nixl.forget_peer(worker_id)

    def close(self) -> None:
        self._shm.close()
        if self._cma is not None:
            self._cma.close()
        self._nixl.close()
