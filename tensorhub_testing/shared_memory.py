"""What engines left in /dev/shm: the segments a stopped engine's processes created and no
live process uses any more.

vLLM (its `psm_*` message queues), Python's multiprocessing (`sem.mp-*`) and SGLang
(`sgl*`) create named segments that a process killed at teardown never unlinks, so they pile
up across runs on a machine that is kept. The engine tests remove, at the end of their
session, the engines' segments that appeared during it, that this user owns and that no
process maps or holds open: never one a live process still uses.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM = Path("/dev/shm")
# What the engines name their segments: vLLM's message queues, Python's multiprocessing
# semaphores, SGLang's queues and loads.
ENGINE_PREFIXES = ("psm_", "sem.mp-", "sgl")


def names(shm: Path = SHM) -> set[str]:
    try:
        return set(os.listdir(shm))
    except OSError:
        return set()


def in_use(shm: Path = SHM) -> set[str]:
    """Names under `shm` that a live process maps or has open."""
    prefix = f"{shm}/"
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                _, _, path = line.partition(prefix)
                if path:
                    used.add(path.removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target[len(prefix):])
        except OSError:  # (a process that ended meanwhile, or one we may not read)
            continue
    return used


def remove_unused(before: set[str], shm: Path = SHM) -> list[str]:
    """Unlink the engines' segments (`ENGINE_PREFIXES`, ours) that appeared since
    `before` (`names()`) and that no live process uses; the names removed."""
    removed = []
    fresh = {n for n in names(shm) - before if n.startswith(ENGINE_PREFIXES)}
    for name in sorted(fresh - in_use(shm)):
        try:
            if (shm / name).stat().st_uid != os.getuid():
                continue
            (shm / name).unlink()
            removed.append(name)
        except OSError:
            pass
    return removed
