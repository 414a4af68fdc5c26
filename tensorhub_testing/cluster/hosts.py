"""The hosts of an emulated cluster, and programs started on them.

Each `Host` is a network + PID + UTS + mount namespace: its own ``eth0`` and address, its
own hostname, its own process tree. Programs on one host share its PID namespace, so
TensorHub's same-host detection (boot id + PID namespace) pairs them, while programs on
different hosts never pair. The filesystem is shared: the mount namespace only gives each
host a /proc of its own PID namespace and a /sys of its own network. (Mounts made after a
host starts reach it only where the root's mounts propagate, i.e. are "shared" as systemd
makes them; files are always shared.) A program starts in the caller's working directory,
so one run from the repository root imports the repository's packages as the caller does.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING

from tensorhub.tools.child_process import ChildProcess
from tensorhub_testing.cluster.links import (
    ClusterError,
    HostSpec,
    Rate,
    Traffic,
    bits,
    ip,
    link_stats,
    shape,
)
from tensorhub_testing.cluster.namespaces import (
    CLONE_NEWNET,
    NETNS_DIR,
    check,
    children_in_pid_namespace,
    libc,
)

if TYPE_CHECKING:
    from tensorhub_testing.cluster.topology import Cluster

# The init of every host: set the hostname, turn IPv6 off (no neighbour discovery chatter
# on the links), say so, then reap whatever is orphaned on the host, forever. A PID
# namespace's init is not sent signals it has no handler for, so with SIGINT back to the
# default (a Ctrl-C reaches our process group, hence the init) only SIGKILL from outside
# ends it, and then the kernel kills every other process of the host.
_INIT = """\
import os, signal, socket, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
socket.sethostname(sys.argv[1])
for conf in ("all", "default", "lo"):
    try:
        with open(f"/proc/sys/net/ipv6/conf/{conf}/disable_ipv6", "w") as f:
            f.write("1")
    except FileNotFoundError:  # a kernel without IPv6
        pass
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
print("ready", flush=True)
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
    signal.sigwait({signal.SIGCHLD})
"""


# One TCP connection: the server sends its hostname, reads until EOF, and prints what it
# got (bytes, seconds from accept to EOF) as JSON; the client sends N bytes, prints the
# hostname it was sent.
_TCP_SERVER = """
import json, socket, sys, time
s = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("listening", flush=True)
c, _ = s.accept()
start = time.monotonic()
began = time.time()
c.sendall(socket.gethostname().encode() + b"\\n")
n = 0
while data := c.recv(1 << 20):
    n += len(data)
print(json.dumps({"bytes": n, "seconds": time.monotonic() - start, "began": began,
                  "ended": time.time()}), flush=True)
"""
_TCP_CLIENT = """
import socket, sys, time
payload = b"x" * int(sys.argv[3])  # before connecting: the server's clock runs from accept
if len(sys.argv) > 4:  # connect at this wall-clock time (streams started together)
    time.sleep(max(0.0, float(sys.argv[4]) - time.time()))
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
print(c.makefile().readline().strip(), flush=True)
c.sendall(payload)
c.shutdown(socket.SHUT_WR)
c.recv(1)
"""


class Host:
    """One emulated host. Start programs on it with `popen` (or `run`, `tensorhub`); reach
    it at `address`; end it, and everything running on it, with `kill`."""

    def __init__(self, cluster: Cluster, index: int, spec: HostSpec, address: str,
                 prefixlen: int):
        self.cluster = cluster
        self.index = index
        self.name = spec.name
        self.dc = spec.dc
        self.address = address
        self.prefixlen = prefixlen
        self.namespace = f"{cluster.prefix}-{spec.name}"
        self.port = f"port{index}"  # its veth end on the switch
        self.mac = f"02:74:68:00:{index >> 8:02x}:{index & 0xFF:02x}"
        self.egress = bits(spec.egress)
        self.ingress = bits(spec.ingress)
        self._init: subprocess.Popen | None = None
        self._pid_ns: int | None = None  # fd of the host's PID namespace
        self._programs: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Host({self.name!r}, dc={self.dc}, address={self.address!r})"

    @property
    def init_pid(self) -> int:
        """PID (in the root namespace) of the host's init: PID 1 on the host."""
        assert self._init is not None, "host not started"
        return self._init.pid

    @property
    def alive(self) -> bool:
        return self._init is not None and self._init.poll() is None

    def _start(self) -> None:
        """Start the host's init in a new PID, UTS and mount namespace inside its network
        namespace (``ip netns exec`` also mounts that network's /sys), and wait until it has
        set the hostname."""
        argv = ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "--mount-proc",
                "--propagation", "slave", sys.executable, "-I", "-S", "-c", _INIT, self.name]
        with children_in_pid_namespace(None):
            self._init = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self._init.stdout is not None and self._init.stderr is not None
        ready, _, _ = select.select([self._init.stdout], [], [], 20.0)
        line = self._init.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self._init.kill()
            _, err = self._init.communicate(timeout=10)
            raise ClusterError(f"host {self.name}: init did not start: "
                               f"{err.decode(errors='replace').strip() or 'no output'}")
        self._init.stdout.close()
        self._init.stderr.close()
        self._pid_ns = os.open(f"/proc/{self._init.pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)

    def command_prefix(self, cwd: str | None = None) -> list[str]:
        """The command line that runs a program on this host from any shell (nsenter forks
        into the PID namespace; append the program's argv)."""
        return ["nsenter", f"--target={self.init_pid}", "--net", "--uts", "--pid", "--mount",
                f"--wd={os.path.abspath(cwd or os.getcwd())}", "--"]

    def spawn(self, argv: Sequence[str], *, cwd: str | None = None,
               **popen_kw) -> subprocess.Popen:
        """`subprocess.Popen` on this host. Entering a mount namespace resets the working
        directory, hence ``--wd``."""
        wd = os.path.abspath(cwd or os.getcwd())
        enter = ["nsenter", f"--target={self.init_pid}", "--net", "--uts", "--mount",
                 f"--wd={wd}", "--"]
        with self._lock:
            if not self.alive or self._pid_ns is None:
                raise ClusterError(f"host {self.name} is down")
            self._programs = [p for p in self._programs if p.poll() is None]
            with children_in_pid_namespace(self._pid_ns):
                proc = subprocess.Popen([*enter, *argv], cwd=wd, **popen_kw)
            self._programs.append(proc)
        return proc

    def popen(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
              cwd: str | None = None, stdout: int | IO | None = subprocess.PIPE,
              stderr: int | IO | None = subprocess.DEVNULL, name: str | None = None,
              log_path: str | None = None, stdin: int | IO | None = None) -> ChildProcess:
        """Start a program on this host, in its own process group, as a `ChildProcess`:
        ``.pid`` is the program's PID (in the root namespace), ``.stop()`` SIGTERMs its
        group then SIGKILLs, ``.kill()``, ``.wait()``, with ``stdout=PIPE`` (default)
        ``.next_line()`` / ``.next_json()``, with ``stdin=PIPE`` ``.send_line()``. `env` is
        added to this process's environment; `cwd` defaults to ours."""
        return ChildProcess(argv, env=env, name=name or self.name, log_path=log_path,
                            cwd=cwd, stdout=stdout, stderr=stderr, stdin=stdin,
                            popen=self.spawn)

    def tensorhub(self, *args: str, **kw) -> ChildProcess:
        """`tensorhub` CLI on this host (like `ChildProcess.tensorhub`)."""
        return self.popen([sys.executable, "-m", "tensorhub.tools.cli", *args], **kw)

    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
            cwd: str | None = None, input: str | None = None, timeout: float = 60.0,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run a command on this host to completion (like `subprocess.run` with
        ``capture_output=True, text=True``); on timeout its whole group is killed."""
        proc = self.spawn(argv, cwd=cwd, env={**os.environ, **(env or {})}, text=True,
                           stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           start_new_session=True)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            proc.communicate()
            raise
        result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def kill(self) -> None:
        """The host dies: SIGKILL its init, so the kernel kills every process on it. Returns
        once they are all gone. Its network stays, and so do its counters."""
        with self._lock:
            if self._init is None:
                return
            if self._init.poll() is None:
                try:
                    os.kill(self._init.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            # The init's exit waits until every process of the namespace is reaped, and our
            # programs' parent is this process: reap them first.
            for proc in self._programs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            self._programs = []
            try:
                self._init.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if self._pid_ns is not None:
                os.close(self._pid_ns)
                self._pid_ns = None

    @contextmanager
    def network(self) -> Iterator[None]:
        """Inside the block, sockets this thread opens live in this host's network: a test
        talks to a program on the host (its HTTP port, say) as a neighbour would. The
        kernel keeps the network namespace per thread, so other threads are not moved;
        sockets opened inside stay in the host's network after the block."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        target = os.open(NETNS_DIR / self.namespace, os.O_RDONLY | os.O_CLOEXEC)
        try:
            check(libc.setns(target, CLONE_NEWNET), f"entering {self.namespace}")
            try:
                yield
            finally:
                check(libc.setns(own, CLONE_NEWNET), f"leaving {self.namespace}")
        finally:
            os.close(target)
            os.close(own)

    def set_link(self, up: bool) -> None:
        """Take the host's eth0 down (or up again): it falls silent, as a host that lost
        power or its switch port does, where `kill` leaves a kernel that answers with RST."""
        ip(self.namespace, f"link set dev eth0 {'up' if up else 'down'}")

    def traffic(self) -> Traffic:
        """Bytes this host's eth0 has sent and received."""
        return link_stats(self.namespace)["eth0"]

    def set_egress(self, rate: Rate) -> None:
        """Shape what this host sends (None: unshaped)."""
        shape(self.namespace, "eth0", rate)
        self.egress = bits(rate)

    def set_ingress(self, rate: Rate) -> None:
        """Shape what this host receives, at its switch port (None: unshaped)."""
        shape(self.cluster.switch, self.port, rate)
        self.ingress = bits(rate)


def _tcp_server(dst: Host, port: int) -> ChildProcess:
    """A one-connection TCP receiver on `dst`, listening once this returns (stopped by the
    caller, also when this raises)."""
    server = dst.popen([sys.executable, "-c", _TCP_SERVER, str(port)],
                       name=f"server on {dst.name}")
    try:
        if server.next_line(timeout=10) != "listening":
            raise ClusterError(f"no TCP server on {dst.name}")
    except BaseException:
        server.stop()
        raise
    return server


def tcp_transfer(src: Host, dst: Host, nbytes: int, port: int = 5001) -> dict:
    """Send `nbytes` from `src` to `dst` over one TCP connection: the bytes and seconds
    the receiver measured (from accept to EOF), plus the hostname the client was greeted
    with. Benchmarks take a link's real goodput from this (the physical bound)."""
    server = _tcp_server(dst, port)
    try:
        client = src.run([sys.executable, "-c", _TCP_CLIENT, dst.address, str(port), str(nbytes)],
                         timeout=60)
        if client.returncode != 0:
            raise ClusterError(f"TCP client on {src.name} failed: {client.stderr.strip()}")
        result = server.next_json(timeout=30)
        return {**result, "greeting": client.stdout.strip()}
    finally:
        server.stop()


def concurrent_tcp_transfers(pairs: Sequence[tuple[Host, Host]], nbytes: int,
                             port: int = 5002, lead: float = 2.0) -> dict:
    """`nbytes` over each (src, dst) pair, one TCP connection each (pair i on `port` + i),
    all connecting at the same moment (`lead` seconds from now, so that slow starts do not
    stagger them): the seconds from the first accept to the last byte, and each stream's
    result. On emulated hosts that share a few CPU cores this is what the machine, not one
    link, can move at once: the physical bound of a pattern that keeps many links busy
    together. (Times are compared across hosts: emulated hosts share one clock. Every
    client holds its `nbytes` in memory.)"""
    servers: list[ChildProcess] = []
    clients: list[ChildProcess] = []
    try:
        for i, (_, dst) in enumerate(pairs):
            servers.append(_tcp_server(dst, port + i))
        at = time.time() + lead
        for i, (src, dst) in enumerate(pairs):
            clients.append(src.popen([sys.executable, "-c", _TCP_CLIENT, dst.address,
                                      str(port + i), str(nbytes), str(at)],
                                     name=f"client on {src.name}"))
        deadline = time.monotonic() + lead + 120
        streams = [server.next_json(timeout=max(1.0, deadline - time.monotonic()))
                   for server in servers]
    finally:
        for proc in clients + servers:
            proc.stop()
    if any(r["bytes"] != nbytes for r in streams):
        raise ClusterError(f"a stream fell short: {[r['bytes'] for r in streams]}")
    return {"seconds": max(r["ended"] for r in streams) - min(r["began"] for r in streams),
            "streams": streams}


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
