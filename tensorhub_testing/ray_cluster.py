"""A Ray cluster across emulated hosts: a head on the first, a worker node on each other.

What "more than one machine" means to a Ray user: separate raylets with their own
addresses, actors placed by node resources, and TensorHub traffic between them crossing a
real (emulated) network. Each node is `ray start --block` on its `Host`, with the node's
own address and the custom resources given for that host; the cluster's token
authentication is on, with a token made for this cluster only (nothing is written to
``~/.ray``). Everything is stopped by PID on exit, and the hosts themselves go with the
`Cluster`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tensorhub.tools.child_process import ChildProcess
from tensorhub_testing.cluster import Cluster, Host

RAY_PORT = 6380


class RayCluster:
    def __init__(self, cluster: Cluster, resources: Sequence[dict[str, float]],
                 work_dir: str | Path, cpus: int = 2, object_store_mib: int = 256):
        """`resources[k]`: the custom resources of host k's node (a node per entry)."""
        if len(resources) > len(cluster.hosts):
            raise ValueError(f"{len(resources)} nodes asked for on {len(cluster.hosts)} hosts")
        self.hosts: list[Host] = list(cluster.hosts[:len(resources)])
        self.resources = list(resources)
        self.work_dir = Path(work_dir)
        self.cpus = cpus
        self.object_store_bytes = object_store_mib << 20
        self.address = f"{self.hosts[0].address}:{RAY_PORT}"
        ray_bin = Path(sys.executable).parent / "ray"
        self._ray = str(ray_bin) if ray_bin.exists() else "ray"
        repo = str(Path(__file__).resolve().parents[1])
        self.env = {
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "RAY_USAGE_STATS_ENABLED": "0",
            # actors import the project (examples, integration helpers) as the driver does
            "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH"))
                                          if p),
        }
        self.nodes: list[ChildProcess] = []
        # Ray's session folder holds Unix sockets, whose paths may not exceed 107 bytes:
        # a short folder of its own under /tmp, removed on exit (logs stay in `work_dir`).
        self.temp_dir = ""

    def __enter__(self) -> RayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _node(self, k: int) -> ChildProcess:
        host = self.hosts[k]
        args = [self._ray, "start", "--block", f"--node-ip-address={host.address}",
                f"--num-cpus={self.cpus}", f"--resources={json.dumps(self.resources[k])}",
                f"--object-store-memory={self.object_store_bytes}", "--disable-usage-stats"]
        if k == 0:
            args += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false",
                     f"--temp-dir={self.temp_dir}"]
        else:
            args += [f"--address={self.address}"]
        return host.popen(args, env=self.env, stdout=None, name=f"ray-{host.name}",
                          log_path=str(self.work_dir / f"ray-{host.name}.log"))

    def start(self, timeout: float = 120.0) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.nodes.append(self._node(0))
        self.wait_nodes(1, timeout)
        for k in range(1, len(self.hosts)):
            self.nodes.append(self._node(k))
        self.wait_nodes(len(self.hosts), timeout)

    def wait_nodes(self, count: int, timeout: float) -> None:
        """Until `count` nodes are alive (asked from the head host, as a driver would)."""
        deadline = time.monotonic() + timeout
        probe = (f"import ray, json; ray.init(address={self.address!r}, logging_level='ERROR'); "
                 "print(json.dumps(sum(n['Alive'] for n in ray.nodes())))")
        last = ""
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise RuntimeError(f"{node.name} exited ({node.proc.returncode}); see "
                                       f"{self.work_dir / (node.name + '.log')}")
            try:
                result = self.hosts[0].run([sys.executable, "-c", probe], env=self.env,
                                           timeout=30.0)
            except subprocess.TimeoutExpired:
                last = ["no answer from the head within 30 s"]
                continue
            lines = result.stdout.strip().splitlines()
            if result.returncode == 0 and lines and int(lines[-1]) >= count:
                return
            last = result.stderr.strip().splitlines()[-1:] or lines[-1:]
            time.sleep(1.0)
        raise TimeoutError(f"{count} Ray nodes not up after {timeout:.0f} s: {last}")

    def driver(self, argv: Sequence[str], log_path: str | Path | None = None,
               env: dict[str, str] | None = None) -> ChildProcess:
        """A driver program on the head host (stdout read line by line)."""
        return self.hosts[0].popen(list(argv), env={**self.env, **(env or {})},
                                   name="ray-driver",
                                   log_path=str(log_path) if log_path else None)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop(timeout=30)
        self.nodes.clear()
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = ""
