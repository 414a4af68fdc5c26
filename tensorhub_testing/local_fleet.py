"""A fleet's processes on this host, on loopback ports: a coordinator child (one that can be
killed and restarted at the same addresses, for crash tests) and a replica child that follows
versions and prints what it pulled. `fleet` starts the same commands on an emulated cluster.
"""

from __future__ import annotations

import subprocess
import sys

from tensorhub.core.net import free_port
from tensorhub.tools.child_process import ChildProcess


def coordinator_process(*args: str, log_path: str | None = None) -> tuple[ChildProcess, str]:
    """A `tensorhub coordinator` child on free loopback ports, with extra `args`; returns it
    and its request address. Its first line says it serves (`next_line`)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = ChildProcess([sys.executable, "-m", "tensorhub.tools.cli", "coordinator", "--bind",
                         address, "--announce", f"tcp://127.0.0.1:{free_port()}", *args],
                        name="coordinator", log_path=log_path)
    return proc, address


class CoordinatorProcess:
    """A coordinator child that can be killed and restarted at the same addresses."""

    def __init__(self, *extra: str, heartbeat_interval: float = 0.2, worker_ttl: float = 2.0):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.announce = f"tcp://127.0.0.1:{free_port()}"
        self.args = ["--log-level", "WARNING", "coordinator", "--bind", self.address,
                     "--announce", self.announce, "--heartbeat-interval",
                     str(heartbeat_interval), "--worker-ttl", str(worker_ttl), *extra]
        self.proc: ChildProcess | None = None
        self.starts = 0

    def start(self, timeout: float = 60.0) -> CoordinatorProcess:
        self.proc = ChildProcess.tensorhub(*self.args, name="coordinator")
        self.proc.next_line(timeout=timeout)  # it prints its addresses once bound
        self.starts += 1
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def replica_process(address: str, name: str, transport: str) -> ChildProcess:
    """A `tensorhub replica` child following every version, one JSON line with per-tensor
    checksums per pull; its warnings and a crash come into its stdout, so a report can quote
    its last lines."""
    return ChildProcess.tensorhub(
        "--log-level", "WARNING", "replica", "--coordinator", address, "--name", name,
        "--transport", transport, "--json", "--checksums", "--pull-timeout", "60",
        "--timeout", "3600", name=name,
        stderr=subprocess.STDOUT)
