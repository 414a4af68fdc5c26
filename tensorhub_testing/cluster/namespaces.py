"""The namespaces an emulated cluster is made of: entering a PID namespace, the records
that name every cluster's namespaces, the cleanup of what a killed run left behind, and
whether this machine can build a cluster at all.

Every namespace a cluster makes is named after its random prefix (``th`` + 4 hex digits)
and recorded, with its creator's PID, under /run/tensorhub-cluster, so `cleanup_stale`
(``python -m tensorhub_testing.cluster down --all``) can remove what a killed run left
behind.
"""

from __future__ import annotations

import ctypes
import fnmatch
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from tensorhub_testing.cluster.links import ClusterError, ip, run, shape

RECORDS = Path("/run/tensorhub-cluster")
NETNS_DIR = Path("/run/netns")
COMMANDS = ("ip", "tc", "bridge", "sysctl", "unshare", "nsenter")
_DEFAULT_PREFIX_RE = re.compile(r"th[0-9a-f]{4}")  # what cleanup_stale may sweep unrecorded
_CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
libc = ctypes.CDLL(None, use_errno=True)


@contextmanager
def children_in_pid_namespace(target: int | None) -> Iterator[None]:
    """Inside the block, processes this thread starts begin in another PID namespace: the one
    open as fd `target`, or a new one (its first process becomes its init) if None.

    The kernel keeps this per thread (``pid_for_children``), so other threads are not
    affected. Starting the program as our own child this way, rather than through ``nsenter
    --pid`` (which forks once more), makes `Popen.pid` the program's own PID and its exit
    status the program's own."""
    own = os.open("/proc/thread-self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.unshare(_CLONE_NEWPID) if target is None
               else libc.setns(target, _CLONE_NEWPID), "entering a PID namespace")
        try:
            yield
        finally:
            check(libc.setns(own, _CLONE_NEWPID), "leaving a PID namespace")
    finally:
        os.close(own)


def check(rc: int, what: str) -> None:
    """Raise `OSError` with errno's text for a failed libc call (`rc` != 0)."""
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


# --- records and stale clusters -----------------------------------------------------------


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), to tell it from a later process
    that reuses its PID; None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def claim(prefix: str | None) -> str:
    """Record a prefix as ours (with our PID, for `cleanup_stale`): `prefix`, or a random
    one that no record or namespace uses yet. The record is made before any namespace."""
    RECORDS.mkdir(parents=True, exist_ok=True)
    record = json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid())}) + "\n"
    for _ in range(1000):
        candidate = prefix or f"th{secrets.token_hex(2)}"
        if not any(name.startswith(f"{candidate}-") for name in _namespaces()):
            try:
                with open(RECORDS / candidate, "x") as f:
                    f.write(record)
                return candidate
            except FileExistsError:
                pass
        if prefix is not None:
            raise ClusterError(f"prefix {prefix} is in use (see `python -m "
                               f"tensorhub_testing.cluster down`)")
    raise ClusterError("no free cluster prefix")


def forget_record(prefix: str) -> None:
    try:
        (RECORDS / prefix).unlink()
    except FileNotFoundError:
        pass


def _creator_alive(prefix: str) -> bool:
    try:
        record = json.loads((RECORDS / prefix).read_text())
    except (OSError, ValueError):
        return False
    return _start_time(int(record["pid"])) == record["start"]


def _namespaces() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def remove_namespaces(names: Sequence[str]) -> None:
    """SIGKILL whatever still runs in these network namespaces, then delete them (the
    kernel deletes their links, and a veth's peer with it)."""
    for name in names:
        if name not in _namespaces():
            continue
        for pid in run(["ip", "netns", "pids", name], check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        run(["ip", "netns", "delete", name], check=False)


def cleanup_stale(pattern: str = "*", force: bool = False) -> list[str]:
    """Remove the clusters whose prefix matches the glob `pattern` and whose creator is gone
    (all of them if `force`): their processes, namespaces and records. Namespaces named like
    a default prefix but without a record count as stale. Returns the prefixes removed."""
    recorded = {p.name for p in RECORDS.glob("*")} if RECORDS.is_dir() else set()
    by_prefix: dict[str, list[str]] = {}
    for name in _namespaces():
        prefix = name.split("-", 1)[0]
        if "-" in name and (prefix in recorded or _DEFAULT_PREFIX_RE.fullmatch(prefix)):
            by_prefix.setdefault(prefix, []).append(name)
    removed = []
    for prefix in sorted(recorded | set(by_prefix)):
        if not fnmatch.fnmatchcase(prefix, pattern):
            continue
        if not force and _creator_alive(prefix):
            continue
        remove_namespaces(by_prefix.get(prefix, []))
        forget_record(prefix)
        removed.append(prefix)
    return removed


def clusters() -> dict[str, bool]:
    """Every recorded cluster's prefix, and whether its creator still runs."""
    if not RECORDS.is_dir():
        return {}
    return {p.name: _creator_alive(p.name) for p in sorted(RECORDS.glob("*"))}


# --- can it be built here? ----------------------------------------------------------------


@functools.cache
def available() -> str | None:
    """None if a cluster can be built on this machine, else why not (for ``pytest.skip``).
    Tries the real thing once: a namespace with a bridge, a veth, a tbf, a PID namespace."""
    if sys.platform != "linux":
        return "emulated clusters need Linux namespaces"
    if os.geteuid() != 0:
        return "emulated clusters need root (network namespaces, tc)"
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return f"emulated clusters need {', '.join(missing)} (iproute2, util-linux, procps)"
    probe = f"thprobe{os.getpid()}"
    try:
        run(["ip", "netns", "add", probe])
    except ClusterError as exc:
        return f"cannot add a network namespace: {exc}"
    try:
        ip(probe, "link add name probe0 type bridge",
            "link add name probe1 type veth peer name probe2", "link set probe2 master probe0")
        shape(probe, "probe1", "1mbit")
        with children_in_pid_namespace(None):
            proc = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts",
                                   "--mount-proc", "true"], capture_output=True, text=True,
                                  timeout=30)
        if proc.returncode != 0:
            return f"cannot make PID/UTS/mount namespaces: {proc.stderr.strip()}"
    except (ClusterError, OSError) as exc:
        return f"cannot build links in a namespace: {exc}"
    finally:
        run(["ip", "netns", "delete", probe], check=False)
    return None

