"""Same-host transport: one-sided reads by Linux cross-memory attach (`process_vm_readv`).

The reader copies straight out of the holder process's memory into its own: one copy, no
holder thread involved, no socket, no staging. That is what makes a same-node pull run near
memcpy speed, where NIXL over loopback (UCX `tcp`, READ emulated with active messages) pays
for a stream through the kernel's TCP stack and the holder's progress thread.

What a reader needs from the holder's `Endpoint`: its pid, the time that pid started (so a
reused pid is never read as if it were the holder), and a host identity (boot id and pid
namespace: equal identities mean the pid names the same process). The kernel checks the
rest: same user, and, on kernels with Yama `ptrace_scope=1`, the holder's consent, which
`register` gives with `prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)` (a no-op elsewhere).

CPU memory only; on GPU the same-node path is CUDA IPC (see `auto`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from pathlib import Path

import torch

from tensorhub.core.data_types import Endpoint
from tensorhub.core.errors import TransferError
from tensorhub.core.transport.base import Peer, ReadOp, Transport, check_ops
from tensorhub.core.transport.parallel_copy import CopyPool, Segment

# prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) (linux/prctl.h): under Yama ptrace_scope 1 a
# holder lets any process of its user read its memory, not only its ancestors.
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class CmaUnavailable(RuntimeError):
    """This system has no `process_vm_readv` (not Linux, or libc without it)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc() -> ctypes.CDLL:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError) as exc:
        raise CmaUnavailable(f"process_vm_readv is not available: {exc}") from None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                   ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    return libc


def host_identity() -> str:
    """Boot id and pid namespace: two processes with the same identity can name each other
    by pid. (Same boot id alone is not enough: containers on one host have their own pids.)"""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pid_ns = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError as exc:
        raise CmaUnavailable(f"cannot tell which host this is: {exc}") from None
    return f"{boot_id}/{pid_ns.removeprefix('pid:[').removesuffix(']')}"


def process_start(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (field 22 of /proc/pid/stat); None if
    there is no such process, or it has exited and waits to be reaped (a zombie)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)  # ~4x cheaper than pathlib: per read
        try:
            stat = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()  # fields after "(comm)" start at 3
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def exited(pid: int, started: int | None) -> bool:
    """Whether process `pid`, started at `started` (if known), is gone (or its pid reused)."""
    now = process_start(pid)
    return now is None or (started is not None and now != started)


def allow_readers() -> None:
    """Let any process of our user read our memory even under Yama ptrace_scope=1."""
    try:
        _libc().prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)  # EINVAL without Yama
    except CmaUnavailable:
        pass


class CmaNotPermitted(TransferError):
    """The kernel refused us the holder's memory (EPERM): another user, ptrace_scope 2-3,
    or a seccomp filter. `auto` falls back to NIXL for such a holder."""


class CmaTransport(Transport):
    name = "cma"

    def __init__(self) -> None:
        self._libc = _libc()
        self.host = host_identity()
        self.pid = os.getpid()
        self.pid_started = process_start(self.pid)
        self._copies = CopyPool("tensorhub-cma")
        self._consented = False

    # ----------------------------------------------------------------- holder side
    def register(self, buffers: list[torch.Tensor]) -> None:
        """Nothing to pin or publish: readers address our memory by pid and address. We
        only consent to being read (Yama), once."""
        for b in buffers:
            if b.device.type != "cpu":
                raise ValueError("the cma transport serves CPU memory only")
        if not self._consented:
            allow_readers()
            self._consented = True

    def deregister(self, buffers: list[torch.Tensor]) -> None:
        """Nothing to undo: the coordinator stops sending readers before bytes change."""

    def endpoint(self) -> Endpoint:
        return Endpoint(transport="cma", pid=self.pid, pid_started=self.pid_started,
                        host=self.host)

    # ----------------------------------------------------------------- reader side
    def reaches(self, endpoint: Endpoint) -> bool:
        """Whether `endpoint` names a live process on this host that we may address."""
        return endpoint.pid is not None and endpoint.host == self.host

    def _check_peer(self, peer: Peer) -> int:
        ep = peer.endpoint
        if ep.pid is None or ep.host is None:
            raise TransferError(
                f"holder {peer.worker_id} advertises no process id (transport "
                f"{ep.transport}): cma reads need a holder on this host using cma or auto",
                peer.worker_id)
        if ep.host != self.host:
            raise TransferError(
                f"holder {peer.worker_id} is on another host or pid namespace ({ep.host}, "
                f"we are {self.host}): cma reads only reach processes on this host",
                peer.worker_id)
        if exited(ep.pid, ep.pid_started):
            raise TransferError(f"holder {peer.worker_id} (pid {ep.pid}) has exited",
                                peer.worker_id)
        return ep.pid

    def read(self, peer: Peer, ops: list[ReadOp], timeout: float) -> None:
        if not ops:
            return
        check_ops(ops)
        for op in ops:
            if op.local.device.type != "cpu" or op.remote.mem != "DRAM":
                raise TransferError(
                    f"cma reads CPU memory only (from {peer.worker_id}: {op.remote.mem} into "
                    f"{op.local.device})", peer.worker_id)
        pid = self._check_peer(peer)
        deadline = time.monotonic() + timeout
        self._copies.run([(op.local.data_ptr(), op.remote.addr, op.remote.nbytes)
                          for op in ops],
                         lambda call: self._copy(pid, peer, call, deadline, timeout))

    def _copy(self, pid: int, peer: Peer, segments: list[Segment],
              deadline: float, timeout: float) -> None:
        """One call's worth of (local, remote, nbytes) segments, resuming after short reads
        (the kernel stops at the first page it cannot read and reports what it copied)."""
        if time.monotonic() > deadline:
            raise TransferError(f"cma read from {peer.worker_id} did not finish within "
                                f"{timeout:.1f}s", peer.worker_id)
        while segments:
            n = len(segments)
            local = (_Iovec * n)(*[(lo, size) for lo, _, size in segments])
            remote = (_Iovec * n)(*[(ro, size) for _, ro, size in segments])
            want = sum(size for _, _, size in segments)
            got = self._libc.process_vm_readv(pid, local, n, remote, n, 0)
            if got < 0:
                raise _error(ctypes.get_errno(), peer, pid, segments[0][1])
            if got == 0:
                raise _error(errno.EFAULT, peer, pid, segments[0][1])
            if got == want:
                return
            segments = _advance(segments, got)

    def close(self) -> None:
        self._copies.close()


def _advance(segments: list[Segment], done: int) -> list[Segment]:
    """The segments still to read after the first `done` bytes arrived."""
    rest = []
    for lo, ro, size in segments:
        if done >= size:
            done -= size
            continue
        rest.append((lo + done, ro + done, size - done))
        done = 0
    return rest


def _error(code: int, peer: Peer, pid: int, addr: int) -> TransferError:
    who = f"holder {peer.worker_id} (pid {pid})"
    if code == errno.ESRCH:
        return TransferError(f"cma read from {who} failed: it has exited", peer.worker_id)
    if code == errno.EPERM:
        return CmaNotPermitted(
            f"cma read from {who} not permitted: it must run as our user and, under Yama "
            f"ptrace_scope=1, have registered memory with the cma or auto transport",
            peer.worker_id)
    if code == errno.EFAULT:
        return TransferError(f"cma read from {who} failed: address {addr:#x} is not mapped "
                             f"there (memory freed, or the holder is exiting)", peer.worker_id)
    return TransferError(f"cma read from {who} failed: {os.strerror(code)}", peer.worker_id)
