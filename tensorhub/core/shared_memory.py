"""Host buffers in shared memory, so a reader on the same host can map them and memcpy.

Cross-memory attach (`process_vm_readv`) copies out of another process at ~0.75 of memcpy
here: the kernel walks and pins the holder's pages for every call. When the holder's bytes
live in a memfd instead, a same-host reader opens that file through `/proc/<pid>/fd/<fd>`
(the kernel allows it to processes that may ptrace the holder: same user, as for cma), maps
it once read-only, and from then on a pull is a plain memcpy at memcpy speed.

Only buffers TensorHub allocates itself live here: a publisher's snapshot and the tensors of
a replica that joined with no weights of its own (`BoundLayout.allocate`). An engine's own
parameters stay where the engine put them and are read by cma or NIXL.

The file is sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW`), and a
reader checks the seals before it maps: a mapped file that shrank would kill the reader with
SIGBUS. The memory is freed when the last tensor viewing it is gone and every reader has
unmapped it; nothing is left in /dev/shm if a process dies. Linux only; elsewhere, or with
TENSORHUB_SHARED_MEMORY=0, buffers are ordinary memory.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import mmap
import os
import threading
import warnings
import weakref

import torch

from tensorhub import settings
from tensorhub.core.data_types import SharedRegion

log = logging.getLogger("tensorhub.shared_memory")

# A holder's memfd is sealed at its size: it can never shrink under a reader's mapping (a
# read past its end would fault) nor grow.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if hasattr(fcntl, "F_SEAL_SHRINK") else 0


def enabled() -> bool:
    """Shared memory for our own host buffers: on unless TENSORHUB_SHARED_MEMORY=0."""
    return (settings.SHARED_MEMORY.get()
            and hasattr(os, "memfd_create") and SEALS != 0)


_lock = threading.Lock()
_regions: dict[int, SharedRegion] = {}  # by start address: our live shared buffers
_freed: collections.deque[int] = collections.deque()  # addresses unmapped, still in _regions


def _forget(addr: int, fd: int) -> None:
    """A mapping's finalizer. It takes no lock: the garbage collector may run it on a thread
    inside `_lock` already (an allocation there), which would then wait on itself. The
    address leaves `_regions` at the next locked step (`_regions_now`), before it can be
    mapped again."""
    _freed.append(addr)
    try:
        os.close(fd)
    except OSError:
        pass


def _regions_now() -> dict[int, SharedRegion]:
    """`_regions` without the freed addresses (call under `_lock`)."""
    while _freed:
        _regions.pop(_freed.popleft(), None)
    return _regions


def shared_empty(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of `nbytes` backed by a sealed memfd (see module doc),
    or by ordinary memory when shared memory is off, unavailable or `nbytes` is 0."""
    if nbytes <= 0 or not enabled():
        return torch.zeros(max(nbytes, 0), dtype=torch.uint8)
    try:
        fd = os.memfd_create("tensorhub", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        log.info("no memfd (%s): buffers in ordinary memory", exc)
        return torch.zeros(nbytes, dtype=torch.uint8)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        inode = os.fstat(fd).st_ino
    except OSError as exc:  # e.g. /dev/shm-like limits (memfd counts as shmem)
        os.close(fd)
        log.warning("cannot allocate %d bytes of shared memory (%s): using ordinary memory",
                    nbytes, exc)
        return torch.zeros(nbytes, dtype=torch.uint8)
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    region = SharedRegion(fd=fd, inode=inode, addr=tensor.data_ptr(), nbytes=nbytes)
    with _lock:
        _regions_now()[region.addr] = region
    weakref.finalize(mapping, _forget, region.addr, fd)  # the fd lives as long as the memory
    return tensor


def regions_of(buffers: list[torch.Tensor]) -> list[SharedRegion]:
    """The shared regions that hold any of `buffers` (CPU tensors), each once."""
    with _lock:
        regions = list(_regions_now().values())
    found: dict[int, SharedRegion] = {}
    for b in buffers:
        if b.device.type != "cpu":
            continue
        start = b.data_ptr()
        end = start + b.numel() * b.element_size()
        for r in regions:
            if r.addr <= start and end <= r.addr + r.nbytes:
                found[r.addr] = r
                break
    return list(found.values())


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault the whole mapping in at once


class MapError(OSError):
    """A shared region that cannot be mapped; `gone`: its process exited or freed it,
    `denied`: we may not open its memory (another user, ptrace scope)."""

    def __init__(self, message: str, gone: bool = False, denied: bool = False):
        super().__init__(message)
        self.gone, self.denied = gone, denied


def map_region(pid: int, region: SharedRegion) -> torch.Tensor:
    """Map process `pid`'s shared region read-only (through `/proc/<pid>/fd/<fd>`), after
    checking it is still the same file (inode) and sealed against resizing (a file that
    shrank under a mapping would kill us with SIGBUS). Raises `MapError`."""
    try:
        fd = os.open(f"/proc/{pid}/fd/{region.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MapError("it has exited or freed the buffer it advertised", gone=True) from None
    except PermissionError:
        raise MapError("not permitted: it must run as our user (and ptrace_scope allow it)",
                       denied=True) from None
    try:
        st = os.fstat(fd)
        if st.st_ino != region.inode:
            raise MapError(f"fd {region.fd} is no longer the buffer it advertised (freed and "
                           f"reused)", gone=True)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & SEALS != SEALS or st.st_size < region.nbytes:
            raise MapError("its shared buffer is not sealed against resizing or is shorter "
                           "than advertised; refusing to map it")
        mapping = mmap.mmap(fd, region.nbytes, flags=mmap.MAP_SHARED | _POPULATE,
                            prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only on purpose: we never write through it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)
