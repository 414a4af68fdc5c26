"""A TensorHub fleet on an emulated cluster: a coordinator, trainers and replicas, each a
real process on a host of its own choosing, with default settings.

Tests and benchmarks that cross hosts start their processes through this, so every one of
them runs the fleet the way a user's launch script would: the coordinator bound to all
interfaces, workers told only its address, and a datacenter label per host where the
cluster has several (the one setting a process cannot guess; see `core/topology.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorhub.tools.child_process import ChildProcess
from tensorhub_testing.cluster import Cluster, Host

COORDINATOR_PORT = 5555


class Fleet:
    def __init__(self, cluster: Cluster, coordinator_host: Host | None = None, *,
                 chunk_mib: float | None = None, max_readers_per_holder: int = 2,
                 log_dir: str | Path | None = None, env: dict[str, str] | None = None,
                 coordinator_args: tuple[str, ...] = ()):
        self.cluster = cluster
        self.host = coordinator_host or cluster.hosts[0]
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="tensorhub-fleet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env or {})
        self.procs: list[ChildProcess] = []
        self.address = f"tcp://{self.host.address}:{COORDINATOR_PORT}"
        self._coordinator_args = [
            "coordinator", "--bind", f"tcp://0.0.0.0:{COORDINATOR_PORT}",
            *(["--chunk-mib", str(chunk_mib)] if chunk_mib else []),
            "--max-readers-per-holder", str(max_readers_per_holder), *coordinator_args]
        self.coordinator = self._start_coordinator()

    def _start_coordinator(self) -> ChildProcess:
        proc = self._start(self.host, "coordinator", self._coordinator_args)
        proc.next_line(timeout=60)  # "tensorhub coordinator: requests on ..."
        return proc

    def restart_coordinator(self) -> None:
        """SIGKILL the coordinator and start a new one at the same address: it knows
        nothing until the workers register again (soft state)."""
        self.coordinator.kill()
        self.procs.remove(self.coordinator)
        self.coordinator = self._start_coordinator()

    def host_env(self, host: Host, env: dict[str, str] | None = None) -> dict[str, str]:
        """What a launch script would set on `host`: its datacenter, where there are several."""
        labels = {"TENSORHUB_LABELS": f"dc=dc{host.dc}"} if self.cluster.dcs > 1 else {}
        return {**labels, **self.env, **(env or {})}

    def _start(self, host: Host, name: str, args: list[str],
               env: dict[str, str] | None = None, stdin: bool = False) -> ChildProcess:
        return self.python(host, name, "tensorhub.tools.cli", "--log-level", "INFO", *args,
                           env=env, stdin=stdin)

    def python(self, host: Host, name: str, module: str, *args: str,
               env: dict[str, str] | None = None, stdin: bool = False) -> ChildProcess:
        """`python -m module args` on `host`, with the host's environment, logged to
        `<name>.log` and stopped with the fleet."""
        proc = host.popen([sys.executable, "-m", module, *args],
                          env=self.host_env(host, env), name=name,
                          log_path=str(self.log_dir / f"{name}.log"),
                          stdin=subprocess.PIPE if stdin else None)
        self.procs.append(proc)
        return proc

    def trainer(self, host: Host, synthetic_mb: float, *, name: str = "trainer",
                versions: int = 1, wait_replicas: int = 0, env: dict[str, str] | None = None,
                extra: tuple[str, ...] = ()) -> ChildProcess:
        """`tensorhub publish` on `host`: JSON events, per-tensor checksums, lingers."""
        return self._start(host, name, [
            "publish", "--coordinator", self.address, "--name", name, "--synthetic-mb",
            str(synthetic_mb), "--versions", str(versions), "--wait-replicas",
            str(wait_replicas), "--json", "--checksums", "--linger", *extra], env)

    def replica(self, host: Host, *, name: str | None = None, versions: int = 1,
                env: dict[str, str] | None = None, extra: tuple[str, ...] = (),
                pull_timeout: float = 120.0, on_demand: bool = False) -> ChildProcess:
        """`tensorhub replica` on `host`: JSON events with checksums, lingers; `on_demand`:
        it pulls the versions named by `send_line` (`--on-demand`)."""
        name = name or host.name
        return self._start(host, name, [
            "replica", "--coordinator", self.address, "--name", name, "--json",
            "--checksums", "--versions", str(versions), "--linger", "--timeout", "600",
            "--pull-timeout", str(pull_timeout), *(["--on-demand"] if on_demand else []),
            *extra], env, stdin=on_demand)

    def status(self) -> dict:
        """`tensorhub status --json`, asked from the coordinator's host."""
        out = self.host.run([sys.executable, "-m", "tensorhub.tools.cli", "status", "--json",
                             "--coordinator", self.address], timeout=30, check=True)
        return json.loads(out.stdout)

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
