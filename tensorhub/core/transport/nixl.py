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

from tensorhub import settings
from tensorhub.core.data_types import Endpoint
from tensorhub.core.errors import TransferError
from tensorhub.core.memory import describe
from tensorhub.core.net import ucx_defaults
from tensorhub.core.transport.base import Peer, ReadOp, Transport, check_ops

_creation_lock = threading.RLock()  # agent creation: UCX's environment, NIXL's wrapper
log = logging.getLogger("tensorhub.transport.nixl")


def apply_ucx_defaults(host: str = "127.0.0.1") -> dict[str, str]:
    """UCX settings that fit this host (`net.ucx_defaults`: tcp+cma over the interface that
    holds `host`, the address this worker advertises, unless there is RDMA), for the
    variables the user left unset.
    They go into the environment because that is how UCX is configured; a variable the user
    set is never touched, and TENSORHUB_UCX_DEFAULTS=0 turns this off."""
    if not settings.UCX_DEFAULTS.get():
        return {}
    defaults = ucx_defaults(settings.CUDA_IPC.get(), host)
    applied = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(applied)
    if applied:
        log.debug("UCX defaults for this host: %s", applied)
    return applied


class _PeerState:
    """One peer's reads: `lock` is held by the read in flight (its connection state is
    the read's); `given_up_until` is set when a read of it made no progress in time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.given_up_until = 0.0
        self.reason = ""

    def given_up(self) -> bool:
        return time.monotonic() < self.given_up_until


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
        self._lock = threading.RLock()  # our maps
        self._agent_lock = threading.Lock()  # one agent call at a time (taken after _lock)
        self._registered: dict[tuple[int, int], object] = {}
        self._peers: dict[str, tuple[str, str]] = {}  # worker_id -> (agent name, metadata hash)
        self._peer_states: dict[str, _PeerState] = {}
        self._progress = ProgressLoop(self._agent, self._agent_lock, self.agent_name)

    @property
    def late_reads(self) -> int:
        """Reads given up that completed later (their bytes landed after all): a copy
        verified before one of these must be verified again before it is used."""
        return self._progress.late

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

    def _peer(self, worker_id: str) -> _PeerState:
        with self._lock:
            return self._peer_states.setdefault(worker_id, _PeerState())

    def _give_up(self, state: _PeerState, worker_id: str, reason: str) -> TransferError:
        if not state.given_up():
            state.given_up_until = time.monotonic() + settings.NIXL_GIVE_UP_S
            state.reason = reason
            log.warning("giving up %s for %.0f s: %s", worker_id, settings.NIXL_GIVE_UP_S,
                        reason)
        return TransferError(reason, worker_id)

    def read(self, peer: Peer, ops: list[ReadOp], timeout: float) -> None:
        """Reads from one peer run one at a time (its connection state is theirs); reads
        from different peers overlap: each agent call is made under `_agent_lock`, but a
        read's wait for completion is not. A read that makes no progress within `timeout`
        gives the peer up (`settings.NIXL_GIVE_UP_S`): every other read of it, waiting or in
        flight, fails at once instead of waiting out a timeout of its own."""
        if not ops:
            return
        check_ops(ops)
        state = self._peer(peer.worker_id)
        self._take_turn(state, peer.worker_id, max(timeout, settings.NIXL_GIVE_UP_S))
        deadline = time.monotonic() + timeout  # (the read's own clock starts now)
        try:
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
                        )
                        handles.append(handle)
                        started = self._agent.transfer(handle)
                    if started == "ERR":
                        raise TransferError(f"NIXL READ from {peer.worker_id} failed to start",
                                            peer.worker_id)
                self._wait(handles, peer, state, deadline, timeout)
            except TransferError:
                raise
            except Exception as exc:
                raise TransferError(f"NIXL READ from {peer.worker_id} failed: {exc}",
                                    peer.worker_id) from None
            finally:
                # A handle still in flight (given up) is handed to the progress loop, which
                # releases it once it ends: released here it would fail and be retried by
                # the garbage collector, outside our lock.
                self._progress.release(handles)
        finally:
            state.lock.release()

    @staticmethod
    def _take_turn(state: _PeerState, worker_id: str, patience: float) -> None:
        """Wait for the read of this peer in flight to end (it ends within its own
        timeout), but not for a peer given up meanwhile. Waiting here is not the peer's
        fault: a slow link's long read delays a poll, and never gives the peer up."""
        until = time.monotonic() + patience
        while True:
            if state.given_up():
                raise TransferError(f"{worker_id} was given up: {state.reason}", worker_id)
            if state.lock.acquire(timeout=settings.NIXL_LOCK_CHECK_S):
                if not state.given_up():
                    return
                state.lock.release()
            elif time.monotonic() > until:
                raise TransferError(f"{worker_id} was busy with another read for "
                                    f"{patience:.0f}s", worker_id)

    def _wait(self, handles: list, peer: Peer, state: _PeerState, deadline: float,
              timeout: float) -> None:
        """Until every handle is done. A short read is over within the first checks; a long
        one is checked ever less often: every `NIXL_WAIT_MAX_S`, and once it has taken a
        while every `NIXL_WAIT_SHARE` of that time (at most `NIXL_WAIT_LONGEST_S`; all in
        `tensorhub.settings`), so a read that waits on
        a silent peer costs next to no CPU and one that ends is seen at most 5 % late.
        (The pause carries over from one handle to the next: they were posted together.)"""
        pending = list(handles)
        started = time.monotonic()
        spins, pause = 0, settings.NIXL_WAIT_FIRST_S
        while pending:
            with self._agent_lock:
                status = self._agent.check_xfer_state(pending[0])
            if status == "DONE":
                pending.pop(0)
                continue
            if status == "ERR":
                raise TransferError(f"NIXL READ from {peer.worker_id} failed", peer.worker_id)
            if state.given_up():
                raise TransferError(f"{peer.worker_id} was given up: {state.reason}",
                                    peer.worker_id)
            if time.monotonic() > deadline:
                raise self._give_up(state, peer.worker_id, f"NIXL READ from {peer.worker_id} "
                                    f"made no progress within {timeout:.1f}s")
            spins += 1
            if spins > settings.NIXL_WAIT_SPINS:
                time.sleep(pause)
                share = settings.NIXL_WAIT_SHARE * (time.monotonic() - started)
                longest = min(settings.NIXL_WAIT_LONGEST_S, max(settings.NIXL_WAIT_MAX_S, share))
                pause = min(2 * pause, longest)

    def forget_peer(self, worker_id: str) -> None:
        """Drop our connection to `worker_id`. Never waits for a read of it in flight (that
        read ends by itself, failing once the peer is given up): the connection is then
        dropped by the next read, which finds new metadata or none."""
        state = self._peer(worker_id)
        if not state.lock.acquire(blocking=False):
            return
        try:
            with self._lock, self._agent_lock:
                known = self._peers.pop(worker_id, None)
                if known is not None:
                    try:
                        self._agent.remove_remote_agent(known[0])
                    except Exception:
                        pass
        finally:
            state.lock.release()

    def close(self) -> None:
        for worker_id in list(self._peers):
            self.forget_peer(worker_id)
        self._progress.stop()
        with self._lock, self._agent_lock:
            for descs in self._registered.values():
                try:
                    self._agent.deregister_memory(descs)
                except Exception:
                    pass
            self._registered.clear()


class ProgressLoop:
    """Advances a NIXL agent's UCX worker every `settings.NIXL_PROGRESS_PERIOD_S`, on a
    thread of its own.

    NIXL's own progress thread polls the worker's event descriptor and progresses it again
    whenever that is ready. A UCX `tcp` endpoint that waits for a silent peer (stopped,
    hung, or connected but not yet answering) keeps asking for write readiness on a socket
    that is always writable, so that thread never sleeps and burns a whole core for as long
    as the peer is silent. Agents are therefore made without it (`make_agent`), and this
    loop sleeps between rounds whatever the sockets say. Each round is one agent call that
    releases the GIL (`get_new_notifs`, which progresses the worker), under the caller's
    agent lock.

    It also owns transfer handles given up while still in flight (`release`): it releases
    each once it has ended, and counts those that ended well (`late`): their bytes landed
    after the read was given up."""

    def __init__(self, agent, lock: threading.Lock, name: str,
                 period: float = settings.NIXL_PROGRESS_PERIOD_S):
        self._agent, self._lock, self._period = agent, lock, period
        self._abandoned: list = []
        self.late = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tensorhub-progress-{name}")
        self._thread.start()

    def release(self, handles: list) -> None:
        """Release `handles` (ours, ended or given up) under the agent lock; a handle still
        in flight is kept and released by the loop once it ends."""
        with self._lock:
            for h in handles:
                if not self._release_ended(h, late=False):
                    self._abandoned.append(h)

    def _release_ended(self, h, late: bool) -> bool:
        """Release `h` if it has ended (True); `late`: it was given up, so if it ended
        well its bytes landed after the reader had moved on."""
        try:
            state = self._agent.check_xfer_state(h)
        except Exception:
            state = "ERR"
        if state == "PROC":
            return False
        if state == "DONE" and late:
            self.late += 1
            log.warning("a NIXL read given up earlier completed after all: its bytes landed")
        try:
            h.release()
        except Exception as exc:  # (kept referenced: never released by the collector)
            log.debug("releasing a NIXL transfer handle: %s", exc)
            return False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            with self._lock:
                try:
                    self._agent.get_new_notifs()
                except Exception as exc:  # never let the loop die: readers rely on it
                    log.debug("NIXL progress: %s", exc)
                if self._abandoned:
                    self._abandoned = [h for h in self._abandoned
                                       if not self._release_ended(h, late=True)]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def make_agent(name: str):
    """A NIXL agent with a UCX backend and no progress thread of its own: its owner drives
    progress (`ProgressLoop`, or its own completion checks)."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {})
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL could not create its UCX backend; check UCX_TLS")
    return agent


def _key(b: torch.Tensor) -> tuple[int, int]:
    return (b.data_ptr(), b.numel() * b.element_size())


def _dev(t: torch.Tensor) -> int:
    return (t.device.index or 0) if t.device.type == "cuda" else 0
