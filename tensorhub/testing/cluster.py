"""An emulated cluster on one machine: hosts in their own namespaces, joined by shaped links.

Multi-host behaviour (who pulls from whom, what crosses the WAN, what happens when a host
dies) needs several hosts whose links are limited separately, and a test machine is one
host. Each `Host` here is a network + PID + UTS + mount namespace: its own ``eth0`` and
address, its own hostname, its own process tree. Programs on one host share its PID
namespace, so TensorHub's same-host detection (boot id + PID namespace) pairs them, while
programs on different hosts never pair. The filesystem is shared: the mount namespace only
gives each host a /proc of its own PID namespace and a /sys of its own network. (Mounts
made after a host starts reach it only where the root's mounts propagate, i.e. are
"shared" as systemd makes them; files are always shared.)

Topology, everything but the hosts living in one "switch" namespace ``PREFIX-sw``::

    h0 eth0 ─veth─ port0 ─┐                              ┌─ port2 ─veth─ eth0 h2
                          bridge dc0 ─ wan1-dc0 ═ wan1-dc1 ─ bridge dc1
    h1 eth0 ─veth─ port1 ─┘        (the WAN link of DC 1)  └─ port3 ─veth─ eth0 h3

DC k > 0 is joined to DC 0 by its own WAN link (a star; DC 1 to DC 2 crosses two links).
All hosts share one IPv4 subnet, so nothing is routed. Every host knows every other
host's MAC (permanent neighbour entries) and every bridge knows every MAC's port (static
forwarding entries), and IPv6 is off: no ARP, neighbour discovery or flooded unicast ever
crosses a link, so the WAN counters count the hosts' own traffic and nothing else.

Shaping is `tc` tbf, the token bucket: a host's egress on its ``eth0``, its ingress on its
switch port (the egress towards it), the WAN on both ends of the WAN link. The bucket holds
``max(64 KiB, 10 ms at the rate)``: veth hands tbf TCP segmentation (GSO) packets of up to
64 KiB, and a bucket smaller than a packet makes tbf split it in software first; the queue
behind it holds 50 ms at the rate (like a switch buffer: deeper queues only add delay).
tbf counts whole Ethernet frames, so TCP's goodput is 1448/1514 = 95.6% of the rate (plus
one bucket's worth at the start); the counters count frames too.

Needs root, iproute2 (`ip`, `tc`, `bridge`), util-linux (`unshare`, `nsenter`) and
`sysctl`; `available()` says whether this machine can, and why not. Every namespace a
cluster makes is named after its random prefix (``th`` + 4 hex digits) and recorded, with
its creator's PID, under /run/tensorhub-cluster, so `cleanup_stale` (``python -m
tensorhub.testing.cluster down --all``) can remove what a killed run left behind.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import fnmatch
import functools
import ipaddress
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tensorhub.processes import ChildProcess

Rate = int | float | str | None
"""Bits per second: a number, or a string as `tc` writes it ("800mbit", "2.5gbit");
None is unshaped."""

RECORDS = Path("/run/tensorhub-cluster")
NETNS_DIR = Path("/run/netns")
DEFAULT_SUBNET = "10.213.0.0/16"
MIN_BURST = 64 * 1024  # bytes: the largest GSO packet veth hands a qdisc
BURST_SECONDS = 0.010
QUEUE_SECONDS = 0.050
COMMANDS = ("ip", "tc", "bridge", "sysctl", "unshare", "nsenter")

_PREFIX_RE = re.compile(r"[a-z][a-z0-9]{0,11}")
_DEFAULT_PREFIX_RE = re.compile(r"th[0-9a-f]{4}")  # what cleanup_stale may sweep unrecorded
_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,30}[A-Za-z0-9])?")
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)

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


class ClusterError(RuntimeError):
    """A command that builds, shapes or reads the cluster failed."""


def parse_rate(rate: int | float | str) -> int:
    """Bits per second from a number or a `tc`-style string ("800mbit", "2.5gbit", "10kbit";
    SI units, like tc). Bytes-per-second units ("mbps") are refused: tc reads them as
    bytes, most people as bits."""
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        value = float(rate)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(rate).lower())
        if not match or match.group(2) not in {"", *_UNITS}:
            raise ValueError(f"rate {rate!r}: give bits per second, e.g. 800mbit, 2.5gbit, "
                             f"10kbit or a number")
        value = float(match.group(1)) * _UNITS.get(match.group(2) or "bit", 1)
    if not value >= 1:
        raise ValueError(f"rate {rate!r}: must be at least 1 bit per second")
    return int(value)


def _bits(rate: Rate) -> int | None:
    return None if rate is None else parse_rate(rate)


@dataclass(frozen=True)
class Traffic:
    """Bytes a link end sent and received (Ethernet frames: headers included)."""

    sent: int
    received: int

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.sent - other.sent, self.received - other.received)


@dataclass(frozen=True)
class HostSpec:
    """One host to build: its name (also its hostname), its datacenter and its shaping."""

    name: str
    dc: int = 0
    egress: Rate = None
    ingress: Rate = None


# --- running commands ---------------------------------------------------------------------


def _run(argv: Sequence[str], input: str | None = None, check: bool = True) -> str:
    result = subprocess.run(list(argv), input=input, capture_output=True, text=True,
                            timeout=60)
    if check and result.returncode != 0:
        raise ClusterError(f"{' '.join(argv)} failed ({result.returncode}): "
                           f"{result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def _ip(namespace: str, *commands: str) -> None:
    """Run `ip` commands in one namespace, as one batch (one process, not one each)."""
    _run(["ip", "-n", namespace, "-batch", "-"], input="\n".join(commands) + "\n")


def _link_stats(namespace: str) -> dict[str, Traffic]:
    out = _run(["ip", "-n", namespace, "-j", "-s", "link", "show"])
    return {link["ifname"]: Traffic(link["stats64"]["tx"]["bytes"],
                                    link["stats64"]["rx"]["bytes"])
            for link in json.loads(out)}


def _shape(namespace: str, device: str, rate: Rate) -> None:
    """tbf on a device's egress at `rate`, or the device's default qdisc back if None."""
    bits = _bits(rate)
    if bits is None:
        _run(["tc", "-n", namespace, "qdisc", "del", "dev", device, "root"], check=False)
        return
    burst = max(MIN_BURST, int(bits / 8 * BURST_SECONDS))
    limit = burst + int(bits / 8 * QUEUE_SECONDS)
    _run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf",
          "rate", f"{bits}bit", "burst", str(burst), "limit", str(limit)])


@contextmanager
def _children_in_pid_namespace(target: int | None) -> Iterator[None]:
    """Inside the block, processes this thread starts begin in another PID namespace: the one
    open as fd `target`, or a new one (its first process becomes its init) if None.

    The kernel keeps this per thread (``pid_for_children``), so other threads are not
    affected. Starting the program as our own child this way, rather than through ``nsenter
    --pid`` (which forks once more), makes `Popen.pid` the program's own PID and its exit
    status the program's own."""
    own = os.open("/proc/thread-self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.unshare(_CLONE_NEWPID) if target is None
               else _libc.setns(target, _CLONE_NEWPID), "entering a PID namespace")
        try:
            yield
        finally:
            _check(_libc.setns(own, _CLONE_NEWPID), "leaving a PID namespace")
    finally:
        os.close(own)


def _check(rc: int, what: str) -> None:
    """Raise `OSError` with errno's text for a failed libc call (`rc` != 0)."""
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


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
# --- hosts --------------------------------------------------------------------------------


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
        self.egress = _bits(spec.egress)
        self.ingress = _bits(spec.ingress)
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
        with _children_in_pid_namespace(None):
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
            with _children_in_pid_namespace(self._pid_ns):
                proc = subprocess.Popen([*enter, *argv], cwd=wd, **popen_kw)
            self._programs.append(proc)
        return proc

    def popen(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
              cwd: str | None = None, stdout: int | IO | None = subprocess.PIPE,
              stderr: int | IO | None = subprocess.DEVNULL, name: str | None = None,
              log_path: str | None = None) -> ChildProcess:
        """Start a program on this host, in its own process group, as a `ChildProcess`:
        ``.pid`` is the program's PID (in the root namespace), ``.stop()`` SIGTERMs its
        group then SIGKILLs, ``.kill()``, ``.wait()``, and with ``stdout=PIPE`` (default)
        ``.next_line()`` / ``.next_json()``. `env` is added to this process's environment;
        `cwd` defaults to ours."""
        return ChildProcess(argv, env=env, name=name or self.name, log_path=log_path,
                            cwd=cwd, stdout=stdout, stderr=stderr, popen=self.spawn)

    def tensorhub(self, *args: str, **kw) -> ChildProcess:
        """`tensorhub` CLI on this host (like `ChildProcess.tensorhub`)."""
        return self.popen([sys.executable, "-m", "tensorhub.cli", *args], **kw)

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
            _check(_libc.setns(target, _CLONE_NEWNET), f"entering {self.namespace}")
            try:
                yield
            finally:
                _check(_libc.setns(own, _CLONE_NEWNET), f"leaving {self.namespace}")
        finally:
            os.close(target)
            os.close(own)

    def set_link(self, up: bool) -> None:
        """Take the host's eth0 down (or up again): it falls silent, as a host that lost
        power or its switch port does, where `kill` leaves a kernel that answers with RST."""
        _ip(self.namespace, f"link set dev eth0 {'up' if up else 'down'}")

    def traffic(self) -> Traffic:
        """Bytes this host's eth0 has sent and received."""
        return _link_stats(self.namespace)["eth0"]

    def set_egress(self, rate: Rate) -> None:
        """Shape what this host sends (None: unshaped)."""
        _shape(self.namespace, "eth0", rate)
        self.egress = _bits(rate)

    def set_ingress(self, rate: Rate) -> None:
        """Shape what this host receives, at its switch port (None: unshaped)."""
        _shape(self.cluster.switch, self.port, rate)
        self.ingress = _bits(rate)


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


# --- the cluster --------------------------------------------------------------------------


class Cluster:
    """K hosts in one or more datacenters; see the module docstring for the topology.

    ``hosts`` is a count (named h0, h1, ...; spread over the `dcs` datacenters in blocks:
    h0 and h1 in DC 0 and h2 and h3 in DC 1 for 4 hosts in 2) or a list of `HostSpec`.
    ``egress`` / ``ingress`` apply to every host a `HostSpec` leaves unshaped; ``wan`` to
    every WAN link. Built when constructed; `close` (or leaving the ``with`` block, or
    exiting the interpreter) tears everything down, also after a failed bring-up."""

    def __init__(self, hosts: int | Sequence[HostSpec] = 2, *, dcs: int = 1,
                 egress: Rate = None, ingress: Rate = None, wan: Rate = None,
                 subnet: str = DEFAULT_SUBNET, prefix: str | None = None):
        if isinstance(hosts, int):
            if hosts < 1 or not 1 <= dcs <= hosts:
                raise ValueError(f"need at least one host per datacenter ({hosts} hosts, "
                                 f"{dcs} dcs)")
            hosts = [HostSpec(f"h{i}", dc=i * dcs // hosts) for i in range(hosts)]
        specs = [HostSpec(s.name, s.dc, s.egress if s.egress is not None else egress,
                          s.ingress if s.ingress is not None else ingress) for s in hosts]
        self.dcs = max([dcs, *(s.dc + 1 for s in specs)])
        self._check(specs)
        if prefix is not None and not _PREFIX_RE.fullmatch(prefix):
            raise ValueError(f"prefix {prefix!r}: a lowercase letter, then up to 11 "
                             f"lowercase letters or digits")
        network = ipaddress.ip_network(subnet)
        if network.version != 4 or network.num_addresses < len(specs) + 2:
            raise ValueError(f"subnet {subnet}: need an IPv4 subnet with room for "
                             f"{len(specs)} hosts")
        self.wan = _bits(wan)
        self.prefix = _claim(prefix)  # from here on, close() must run
        self.switch = f"{self.prefix}-sw"
        self._namespaces: list[str] = []
        self._closed = False
        self.hosts: list[Host] = []
        atexit.register(self.close)
        try:
            self.hosts = [Host(self, i, spec, str(network.network_address + i + 1),
                               network.prefixlen) for i, spec in enumerate(specs)]
            self._up()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _check(specs: Sequence[HostSpec]) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"host names must be unique: {names}")
        for spec in specs:
            if not _NAME_RE.fullmatch(spec.name) or spec.name == "sw":
                raise ValueError(f"host name {spec.name!r}: letters, digits and inner "
                                 f"hyphens, up to 32 (and not 'sw')")
            if spec.dc < 0:
                raise ValueError(f"host {spec.name}: dc must be >= 0")
            _bits(spec.egress), _bits(spec.ingress)  # a bad rate fails here, not halfway

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Cluster({self.prefix!r}, hosts={[h.name for h in self.hosts]}, dcs={self.dcs})"

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def dc(self, k: int) -> list[Host]:
        """The hosts of datacenter `k`."""
        return [h for h in self.hosts if h.dc == k]

    # bring-up ----------------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        self._namespaces.append(name)  # first, so a failed add is still tried on close
        _run(["ip", "netns", "add", name])

    def _up(self) -> None:
        self._add_namespace(self.switch)
        _run(["ip", "netns", "exec", self.switch, "sysctl", "-q", "-e", "-w",
              "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"])
        commands = ["link set lo up"]
        for k in range(self.dcs):
            commands += [f"link add name dc{k} type bridge mcast_snooping 0", f"link set dc{k} up"]
        for k in range(1, self.dcs):
            commands += [f"link add name wan{k}-dc0 type veth peer name wan{k}-dc{k}",
                         f"link set wan{k}-dc0 master dc0 up",
                         f"link set wan{k}-dc{k} master dc{k} up"]
        _ip(self.switch, *commands)
        for host in self.hosts:
            self._add_namespace(host.namespace)
            host._start()
            _ip(self.switch,
                f"link add name {host.port} type veth peer name eth0 address {host.mac} "
                f"netns {host.namespace}",
                f"link set {host.port} master dc{host.dc} up")
            _ip(host.namespace, "link set lo up",
                f"addr add {host.address}/{host.prefixlen} dev eth0", "link set eth0 up")
            if host.egress is not None:
                host.set_egress(host.egress)
            if host.ingress is not None:
                host.set_ingress(host.ingress)
        if self.wan is not None:
            self.set_wan(self.wan)
        self._pin_addresses()

    def _pin_addresses(self) -> None:
        """Permanent neighbour entries on every host and static forwarding entries on every
        bridge: no ARP broadcast, no unknown-unicast flood, ever."""
        for host in self.hosts:
            _ip(host.namespace, *(f"neigh replace {o.address} lladdr {o.mac} dev eth0 "
                                  f"nud permanent" for o in self.hosts if o is not host))
        fdb = []
        for host in self.hosts:
            for k in range(self.dcs):
                if k == host.dc:
                    port = host.port
                elif k == 0:
                    port = f"wan{host.dc}-dc0"
                else:
                    port = f"wan{k}-dc{k}"  # towards DC 0, which knows the way on
                fdb.append(f"fdb replace {host.mac} dev {port} master static")
        _run(["bridge", "-n", self.switch, "-batch", "-"], input="\n".join(fdb) + "\n")

    # shaping and counters ----------------------------------------------------------------

    def set_wan(self, rate: Rate, dc: int | None = None) -> None:
        """Shape the WAN link of DC `dc` (None: every WAN link), both directions."""
        for k in range(1, self.dcs) if dc is None else [dc]:
            if not 1 <= k < self.dcs:
                raise ValueError(f"DC {k} has no WAN link (DCs 1..{self.dcs - 1} do)")
            _shape(self.switch, f"wan{k}-dc0", rate)
            _shape(self.switch, f"wan{k}-dc{k}", rate)
        if dc is None:
            self.wan = _bits(rate)

    def wan_traffic(self, dc: int = 1) -> Traffic:
        """Bytes that crossed DC `dc`'s WAN link: ``sent`` out of DC `dc` towards DC 0,
        ``received`` into DC `dc` from DC 0."""
        if not 1 <= dc < self.dcs:
            raise ValueError(f"DC {dc} has no WAN link (DCs 1..{self.dcs - 1} do)")
        stats = _link_stats(self.switch)
        return Traffic(sent=stats[f"wan{dc}-dc{dc}"].sent, received=stats[f"wan{dc}-dc0"].sent)

    # teardown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every host (and every program on it), delete every namespace (and with them
        every link), forget the record. Idempotent; safe after a failed bring-up."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for host in self.hosts:
            host.kill()
        _remove_namespaces(self._namespaces)
        _forget_record(self.prefix)


# --- records and stale clusters -----------------------------------------------------------


def _start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), to tell it from a later process
    that reuses its PID; None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _claim(prefix: str | None) -> str:
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
                               f"tensorhub.testing.cluster down`)")
    raise ClusterError("no free cluster prefix")


def _forget_record(prefix: str) -> None:
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


def _remove_namespaces(names: Sequence[str]) -> None:
    """SIGKILL whatever still runs in these network namespaces, then delete them (the
    kernel deletes their links, and a veth's peer with it)."""
    for name in names:
        if name not in _namespaces():
            continue
        for pid in _run(["ip", "netns", "pids", name], check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _run(["ip", "netns", "delete", name], check=False)


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
        _remove_namespaces(by_prefix.get(prefix, []))
        _forget_record(prefix)
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
        _run(["ip", "netns", "add", probe])
    except ClusterError as exc:
        return f"cannot add a network namespace: {exc}"
    try:
        _ip(probe, "link add name probe0 type bridge",
            "link add name probe1 type veth peer name probe2", "link set probe2 master probe0")
        _shape(probe, "probe1", "1mbit")
        with _children_in_pid_namespace(None):
            proc = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts",
                                   "--mount-proc", "true"], capture_output=True, text=True,
                                  timeout=30)
        if proc.returncode != 0:
            return f"cannot make PID/UTS/mount namespaces: {proc.stderr.strip()}"
    except (ClusterError, OSError) as exc:
        return f"cannot build links in a namespace: {exc}"
    finally:
        _run(["ip", "netns", "delete", probe], check=False)
    return None


# --- command line -------------------------------------------------------------------------


def _up_command(args: argparse.Namespace) -> int:
    reason = available()
    if reason:
        print(f"cannot build a cluster here: {reason}", file=sys.stderr)
        return 1
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with Cluster(args.hosts, dcs=args.dcs, egress=args.egress, ingress=args.ingress,
                 wan=args.wan, subnet=args.subnet, prefix=args.prefix) as cluster:
        print(f"cluster {cluster.prefix}: {len(cluster.hosts)} hosts, {cluster.dcs} DCs, "
              f"switch namespace {cluster.switch}, WAN {_fmt(cluster.wan)}")
        for h in cluster.hosts:
            print(f"  {h.name:8} dc{h.dc}  {h.address:15} netns {h.namespace:16} "
                  f"egress {_fmt(h.egress):9} ingress {_fmt(h.ingress)}\n"
                  f"           {' '.join(h.command_prefix())} bash")
        print("Ctrl-C or SIGTERM tears it down.", flush=True)
        while not stop.wait(1.0):
            pass
    print(f"cluster {cluster.prefix}: torn down")
    return 0


def _fmt(bits: int | None) -> str:
    if bits is None:
        return "unshaped"
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits}bit"


def _down_command(args: argparse.Namespace) -> int:
    if not args.all and not args.prefixes:
        for prefix, alive in clusters().items():
            print(f"{prefix}  {'running' if alive else 'stale'}")
        return 0
    removed = []
    for pattern in ["*"] if args.all else args.prefixes:
        removed += cleanup_stale(pattern, force=args.force)
    print(f"removed: {', '.join(removed) or 'nothing'}")
    return 0


def add_cluster_parser(subparsers: argparse._SubParsersAction,
                       name: str = "cluster") -> argparse.ArgumentParser:
    """Add the ``cluster`` command (``up`` / ``down``) to another CLI's subcommands. Each
    leaf parser sets ``func(args) -> int``."""
    parser = subparsers.add_parser(
        name, help="an emulated multi-host cluster on this machine (root)",
        description="Emulate hosts on this machine: each its own network, PID, hostname "
        "and mount namespace, joined per datacenter by a bridge, datacenters by a WAN "
        "link, with tc-shaped rates. Needs root.")
    _fill_cluster_parser(parser)
    return parser


def _fill_cluster_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="cluster_command", required=True)
    up = sub.add_parser(
        "up", help="bring a cluster up, print its hosts, wait for Ctrl-C, tear it down",
        description="Bring a cluster up and keep it until Ctrl-C or SIGTERM. Rates are bits "
        "per second as tc writes them: 800mbit, 2.5gbit, 10kbit. Each host's line says how "
        "to run a command on it (nsenter).",
        epilog="example: up --hosts 4 --dcs 2 --egress 800mbit --wan 80mbit (h0, h1 in DC 0; "
        "h2, h3 in DC 1; each sends at most 800 Mbit/s; 80 Mbit/s each way between the DCs)")
    up.add_argument("--hosts", type=int, default=4, help="number of hosts (default 4)")
    up.add_argument("--dcs", type=int, default=1,
                    help="datacenters, hosts spread over them in blocks (default 1)")
    up.add_argument("--egress", default=None, help="every host's send rate (default unshaped)")
    up.add_argument("--ingress", default=None,
                    help="every host's receive rate (default unshaped)")
    up.add_argument("--wan", default=None, help="every WAN link's rate, each direction "
                    "(default unshaped)")
    up.add_argument("--subnet", default=DEFAULT_SUBNET,
                    help=f"the hosts' IPv4 subnet (default {DEFAULT_SUBNET})")
    up.add_argument("--prefix", default=None,
                    help="name prefix of its namespaces (default th + 4 random hex digits)")
    up.set_defaults(func=_up_command)
    down = sub.add_parser(
        "down", help="remove clusters left behind by killed runs",
        description="Without arguments: list recorded clusters. With --all or prefixes "
        "(globs): remove those whose creating process is gone (with --force: even if it "
        "still runs).")
    down.add_argument("prefixes", nargs="*", help="cluster prefixes or globs, e.g. th3fa2")
    down.add_argument("--all", action="store_true", help="every stale cluster")
    down.add_argument("--force", action="store_true", help="also clusters whose creator runs")
    down.set_defaults(func=_down_command)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorhub.testing.cluster",
                                     description="An emulated multi-host cluster on this "
                                     "machine (network, PID, hostname and mount namespaces "
                                     "per host; tc-shaped links). Needs root.")
    _fill_cluster_parser(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
