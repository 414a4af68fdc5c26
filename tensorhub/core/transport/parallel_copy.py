"""Large same-host copies shared by a few threads, in calls of bounded size.

Both same-host paths copy with one C call per piece of memory (`process_vm_readv` for cma,
`memmove` out of a mapping for shm), and both release the GIL there. One thread copies
~4.7 GB/s here, two ~9 GB/s; a torch copy per tensor instead wakes its worker threads once
per tensor, which costs more than the copy for tensors of a few MiB on a busy machine. So a
read is cut into calls of at most `settings.COPY_CALL_BYTES` (deadlines are checked between
calls) and at least one call per thread of `TENSORHUB_COPY_THREADS`, which share them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tensorhub import settings

Segment = tuple[int, int, int]  # (local address, remote address, nbytes)

IOV_MAX = 1024  # segments per call (Linux UIO_MAXIOV, the limit of process_vm_readv)


def split_calls(segments: list[Segment], call_bytes: int) -> list[list[Segment]]:
    """Cut segments into calls of at most `call_bytes` and IOV_MAX segments."""
    calls: list[list[Segment]] = [[]]
    room = call_bytes
    for lo, ro, size in segments:
        off = 0
        while off < size:
            if room == 0 or len(calls[-1]) == IOV_MAX:
                calls.append([])
                room = call_bytes
            n = min(size - off, room)
            calls[-1].append((lo + off, ro + off, n))
            room -= n
            off += n
    return [c for c in calls if c]


def _priority_of_this_thread() -> int:
    """The calling thread's nice value (0 where it cannot be read)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return 0


class CopyPool:
    """Runs the calls of one read on `TENSORHUB_COPY_THREADS` threads and returns when all
    have ended (so no copy still runs into our memory after a failure is raised).

    A read runs at the priority of the thread that asked for it: a pull beside an engine's
    generation runs lowered (`engines/background_priority.py`), a repair inside a pause
    does not, and a thread inherits its creator's priority and cannot raise it again. So
    there is a pool per priority, each started by a thread of that priority."""

    def __init__(self, name: str):
        self._name = name
        self._lock = threading.Lock()
        self._pools: dict[int, ThreadPoolExecutor] = {}

    def run(self, segments: list[Segment], copy: Callable[[list[Segment]], None]) -> None:
        """`copy(call)` for every call of `segments`; raises the first call's error."""
        total = sum(n for *_, n in segments)
        threads = settings.copy_threads()
        call_bytes = min(settings.COPY_CALL_BYTES,
                         max(settings.COPY_MIN_CALL_BYTES, -(-total // threads)))
        calls = split_calls(segments, call_bytes)
        if threads == 1 or len(calls) <= 1:
            for call in calls:
                copy(call)
            return
        priority = _priority_of_this_thread()
        with self._lock:
            pool = self._pools.get(priority)
            if pool is None:
                pool = self._pools[priority] = ThreadPoolExecutor(
                    threads, thread_name_prefix=self._name)
        futures = [pool.submit(copy, call) for call in calls]
        for f in futures:  # wait for all first
            f.exception()
        for f in futures:
            f.result()

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)
