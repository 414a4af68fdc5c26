"""NIXL transport: one-sided READ over UCX (DRAM here; VRAM with the same calls on GPU).

Descriptors travel as plain (addr, nbytes, device) triples in our own pydantic models, never
as NIXL's pickled descriptor lists. Agent metadata is NIXL's own binary blob, passed through
untouched. UCX defaults that fit the host (`net.ucx_defaults`) are set only where the user
has not set them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid

import numpy as np
import torch

from tensorhub.core.data_types import Endpoint
from tensorhub.core.errors import TransferError
from tensorhub.core.memory import describe
from tensorhub.core.net import ucx_defaults
from tensorhub.core.transport.base import Peer, ReadOp, Transport, check_ops

# GPU switch (untested here: no GPU): same-host VRAM reads by CUDA IPC (UCX `cuda_ipc`).
CUDA_IPC = os.environ.get("TENSORHUB_CUDA_IPC", "0") == "1"
# NIXL's Python API starts its progress thread with no delay between polls: an idle agent
# then burns a whole core (measured: 3.0 CPU-s per 3 s), which on a 2-core engine host
# halves everything else. A 100 us pause costs ~3% of a core. It must stay short: over
# `tcp,cma` UCX emulates READ with active messages (`rma_am(tcp/lo)` in UCX's log), so a
# holder's progress thread paces every read of it; at 1 ms an engine-to-engine pull of
# 686 MiB took 22 s instead of 3.6 s (50 us) on this busy 2-core machine.
PROGRESS_DELAY_US = int(os.environ.get("TENSORHUB_NIXL_PROGRESS_US", "100"))
# A read's completion is checked this many times back to back, then after pauses that
# double from WAIT_FIRST_S up to WAIT_MAX_S (see `NixlTransport._wait`).
WAIT_SPINS = 200
WAIT_FIRST_S = 50e-6
WAIT_MAX_S = 1e-3
_creation_lock = threading.RLock()  # agent creation: UCX's environment, NIXL's wrapper
log = logging.getLogger("tensorhub.transport.nixl")


def apply_ucx_defaults(host: str = "127.0.0.1") -> dict[str, str]:
    """UCX settings that fit this host (`net.ucx_defaults`: tcp+cma over the interface that
    holds `host`, the address this worker advertises, unless there is RDMA), for the
    variables the user left unset.
    They go into the environment because that is how UCX is configured; a variable the user
    set is never touched, and TENSORHUB_UCX_DEFAULTS=0 turns this off."""
    if os.environ.get("TENSORHUB_UCX_DEFAULTS", "1") == "0":
        return {}
    applied = {k: v for k, v in ucx_defaults(CUDA_IPC, host).items() if k not in os.environ}
    os.environ.update(applied)
    if applied:
        log.debug("UCX defaults for this host: %s", applied)
    return applied


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, agent_name: str | None = None, host: str = "127.0.0.1"):
        self.agent_name = agent_name or f"tensorhub-{uuid.uuid4().hex[:12]}"
        with _creation_lock:
            applied = apply_ucx_defaults(host)
            try:
                self._agent = make_agent(self.agent_name)
            finally:
                # UCX has read them: they were this agent's, not settings for the processes
                # this one starts (a worker on another host must choose its own)
                for key in applied:
                    os.environ.pop(key, None)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL could not create its UCX backend; check UCX_TLS")
        self._lock = threading.RLock()  # our maps
        self._agent_lock = threading.Lock()  # one agent call at a time (taken after _lock)
        self._registered: dict[tuple[int, int], object] = {}
        self._peers: dict[str, tuple[str, str]] = {}  # worker_id -> (agent name, metadata hash)
        self._peer_locks: dict[str, threading.Lock] = {}  # worker_id -> held for a read

    def register(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            fresh = [b for b in buffers if _key(b) not in self._registered and b.numel() > 0]
            if not fresh:
                return
            for b in fresh:
                with self._agent_lock:
                    self._registered[_key(b)] = self._agent.register_memory([b])

    def deregister(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for b in buffers:
                descs = self._registered.pop(_key(b), None)
                if descs is not None:
                    with self._agent_lock:
                        self._agent.deregister_memory(descs)

    def endpoint(self) -> Endpoint:
        with self._lock, self._agent_lock:
            return Endpoint(
                transport="nixl",
                agent_name=self.agent_name,
                agent_metadata=self._agent.get_agent_metadata(),
            )

    def _connect(self, peer: Peer) -> str:
        ep = peer.endpoint
        if ep.transport != "nixl" or not ep.agent_metadata or not ep.agent_name:
            raise TransferError(f"holder {peer.worker_id} has no NIXL endpoint", peer.worker_id)
        digest = hashlib.sha256(ep.agent_metadata).hexdigest()
        known = self._peers.get(peer.worker_id)
        if known == (ep.agent_name, digest):
            return ep.agent_name
        if known is not None:
            # Metadata is a snapshot: memory registered later is only known after re-adding.
            self._agent.remove_remote_agent(known[0])
        try:
            name = self._agent.add_remote_agent(ep.agent_metadata)
        except Exception as exc:
            raise TransferError(f"cannot load agent metadata of {peer.worker_id}: {exc}",
                                peer.worker_id) from None
        name = name.decode() if isinstance(name, bytes) else name
        self._peers[peer.worker_id] = (name, digest)
        return name

    def _peer_lock(self, worker_id: str) -> threading.Lock:
        with self._lock:
            return self._peer_locks.setdefault(worker_id, threading.Lock())

    def read(self, peer: Peer, ops: list[ReadOp], timeout: float) -> None:
        """Reads from one peer run one at a time (its connection state is theirs); reads
        from different peers overlap: each agent call is made under `_agent_lock`, but a
        read's wait for completion is not, so two reads are in flight at once. (NIXL's own
        strict locking would also hold off the agent's progress thread while one call
        blocks, e.g. connecting to a host that fell silent, and this worker would stop
        serving its readers meanwhile.)"""
        if not ops:
            return
        check_ops(ops)
        with self._peer_lock(peer.worker_id):
            with self._lock, self._agent_lock:
                remote_agent = self._connect(peer)
            groups: dict[tuple[str, str], list[ReadOp]] = {}
            for op in ops:
                groups.setdefault((describe(op.local).mem, op.remote.mem), []).append(op)
            handles = []
            try:
                for (local_mem, remote_mem), group in groups.items():
                    local = np.array(
                        [(op.local.data_ptr(), op.remote.nbytes, _dev(op.local)) for op in group],
                        dtype=np.uint64,
                    )
                    remote = np.array(
                        [(op.remote.addr, op.remote.nbytes, op.remote.device) for op in group],
                        dtype=np.uint64,
                    )
                    with self._agent_lock:
                        handle = self._agent.initialize_xfer(
                            "READ",
                            self._agent.get_xfer_descs(local, local_mem),
                            self._agent.get_xfer_descs(remote, remote_mem),
                            remote_agent,
                            b"tensorhub-read",
                        )
                        handles.append(handle)
                        started = self._agent.transfer(handle)
                    if started == "ERR":
                        raise TransferError(f"NIXL READ from {peer.worker_id} failed to start",
                                            peer.worker_id)
                self._wait(handles, peer, timeout)
            except TransferError:
                raise
            except Exception as exc:
                raise TransferError(f"NIXL READ from {peer.worker_id} failed: {exc}",
                                    peer.worker_id) from None
            finally:
                for h in handles:
                    try:
                        with self._agent_lock:
                            h.release()
                    except Exception:  # a handle still in flight after a timeout
                        pass

    def _wait(self, handles: list, peer: Peer, timeout: float) -> None:
        """Until every handle is done. A short read is over within the first checks; a long
        one is checked ever less often, up to every `WAIT_MAX_S`: a reader that spins on
        its read takes the CPU that its own and its peers' transfers need. (The pause
        carries over from one handle to the next: they were posted together.)"""
        deadline = time.monotonic() + timeout
        pending = list(handles)
        spins, pause = 0, WAIT_FIRST_S
        while pending:
            with self._agent_lock:
                state = self._agent.check_xfer_state(pending[0])
            if state == "DONE":
                pending.pop(0)
                continue
            if state == "ERR":
                raise TransferError(f"NIXL READ from {peer.worker_id} failed", peer.worker_id)
            if time.monotonic() > deadline:
                raise TransferError(
                    f"NIXL READ from {peer.worker_id} made no progress within {timeout:.1f}s",
                    peer.worker_id,
                )
            spins += 1
            if spins > WAIT_SPINS:
                time.sleep(pause)
                pause = min(2 * pause, WAIT_MAX_S)

    def forget_peer(self, worker_id: str) -> None:
        with self._peer_lock(worker_id), self._lock, self._agent_lock:  # no read in flight
            known = self._peers.pop(worker_id, None)
            if known is not None:
                try:
                    self._agent.remove_remote_agent(known[0])
                except Exception:
                    pass

    def close(self) -> None:
        for worker_id in list(self._peers):
            self.forget_peer(worker_id)
        with self._lock, self._agent_lock:
            for descs in self._registered.values():
                try:
                    self._agent.deregister_memory(descs)
                except Exception:
                    pass
            self._registered.clear()


def make_agent(name: str):
    """A NIXL agent with a UCX backend and a progress thread that sleeps between polls."""
    import importlib

    from nixl._api import nixl_agent, nixl_agent_config

    api = importlib.import_module(nixl_agent.__module__)
    create = api.nixlBind.nixlAgent

    def create_with_delay(agent_name, config):
        config.pthrDelay = PROGRESS_DELAY_US
        return create(agent_name, config)

    with _creation_lock:  # the wrapper hard-codes pthrDelay=0; set ours just before creation
        api.nixlBind.nixlAgent = create_with_delay
        try:
            return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        finally:
            api.nixlBind.nixlAgent = create


def _key(b: torch.Tensor) -> tuple[int, int]:
    return (b.data_ptr(), b.numel() * b.element_size())


def _dev(t: torch.Tensor) -> int:
    return (t.device.index or 0) if t.device.type == "cuda" else 0
