"""Addresses as other hosts see them, and the UCX settings that reach them.

A worker must advertise addresses its peers can reach: a coordinator bound to `0.0.0.0`
announces on an address nobody can connect to, and a fallback server bound to 127.0.0.1 is
invisible from the next host. The rule used everywhere: the address to advertise is the
local address of the route towards the coordinator, since every peer reaches the
coordinator too (override: `TENSORHUB_HOST_ADDRESS`). A port to bind a local server on
is drawn here too (`free_port`).
"""

from __future__ import annotations

import ipaddress
import logging
import random
import socket
from pathlib import Path

from tensorhub import settings
from tensorhub.core.errors import AddressError

log = logging.getLogger("tensorhub.net")

WILDCARDS = ("0.0.0.0", "*", "::")  # hosts a socket binds to mean "every interface"


def split_tcp(address: str) -> tuple[str, int] | None:
    """`tcp://host:port` -> (host, port); None for other schemes (ipc://, inproc://). A
    source address (`tcp://src:0;host:port`, ZeroMQ's) is left out."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://"):].rpartition(";")[2].rpartition(":")
    try:
        return host.strip("[]") or "*", int(port)
    except ValueError:
        return None


def check_coordinator_address(address: str) -> str:
    """`address` if it is a ZeroMQ address a client can connect to (`tcp://HOST:PORT`, or
    `ipc://` / `inproc://`); else `AddressError` naming it and the form expected."""
    if isinstance(address, str) and address.startswith(("ipc://", "inproc://")):
        return address
    if isinstance(address, str) and split_tcp(address) is not None:
        return address
    example = f"tcp://{address}" if isinstance(address, str) and ":" in address \
        and "://" not in address else "tcp://127.0.0.1:5555"
    raise AddressError(f"coordinator address {address!r} is not of the form tcp://HOST:PORT "
                       f"(e.g. {example})")


def is_loopback(host: str | None) -> bool:
    """Whether `host` (a name or address, an IPv4-mapped IPv6 one too) is this host's."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address((host or "").removeprefix("::ffff:")).is_loopback
    except ValueError:
        return False


def reachable_announce(announce: str, coordinator: str) -> str:
    """The announcement address a client should connect to: a wildcard host (a coordinator
    bound to all interfaces) becomes the host the client reached the coordinator at."""
    ann, coord = split_tcp(announce), split_tcp(coordinator)
    if ann is None or coord is None or ann[0] not in WILDCARDS:
        return announce
    host = coord[0] if coord[0] not in WILDCARDS else "127.0.0.1"
    return f"tcp://{_bracket(host)}:{ann[1]}"


def local_address_towards(coordinator: str) -> str:
    """This host's address on the route to the coordinator: what a peer can connect to.

    Loopback when the coordinator is on loopback (a single-host fleet). No packet is sent:
    connecting a UDP socket only asks the kernel which source address it would use.
    """
    override = settings.HOST_ADDRESS.get()
    if override:
        return override
    hostport = split_tcp(coordinator)
    if hostport is None or hostport[0] in WILDCARDS or is_loopback(hostport[0]):
        return "127.0.0.1"
    host, port = hostport
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        info = socket.getaddrinfo(host.strip("[]"), port or 9, family, socket.SOCK_DGRAM)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(info[0][4])
            return s.getsockname()[0]
    except OSError as exc:
        log.warning("cannot tell this host's address towards %s (%s); advertising 127.0.0.1 "
                    "(set %s)", coordinator, exc, settings.HOST_ADDRESS.name)
        return "127.0.0.1"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1, drawn below the kernel's
    ephemeral range: a port from `bind(0)` can be handed to another process's own `bind(0)`
    (a UCX or ZeroMQ listener) before ours binds it, and a server then fails with
    "address already in use"."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(20000, low) if low > 21000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free TCP port found below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def network_interfaces(sys_net: Path = Path("/sys/class/net")) -> list[str]:
    """Network interfaces that are up, loopback excluded."""
    found = []
    for dev in sorted(sys_net.iterdir()) if sys_net.is_dir() else []:
        if dev.name == "lo":
            continue
        try:
            state = (dev / "operstate").read_text().strip()
        except OSError:
            continue
        if state in ("up", "unknown"):
            found.append(dev.name)
    return found


def rdma_devices(sys_ib: Path = Path("/sys/class/infiniband")) -> list[str]:
    return sorted(p.name for p in sys_ib.iterdir()) if sys_ib.is_dir() else []


def interface_of(address: str) -> str | None:
    """The name of the local interface that holds IPv4 `address` (None: not found)."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def nvidia_gpus(dev: Path = Path("/dev")) -> list[str]:
    """The NVIDIA GPU device nodes of this host (`/dev/nvidia0`, ...), without loading CUDA."""
    return sorted(p.name for p in dev.glob("nvidia[0-9]*"))


def ucx_defaults(cuda_ipc: bool = False, host: str = "127.0.0.1",
                 sys_net: Path = Path("/sys/class/net"),
                 sys_ib: Path = Path("/sys/class/infiniband"),
                 dev: Path = Path("/dev")) -> dict[str, str]:
    """UCX settings for where this process runs; only applied to variables the user left
    unset (`apply_ucx_defaults`). `host`: the address this worker advertises (the one on
    its route to the coordinator).

    - Without RDMA devices: `UCX_TLS=tcp,cma` (cma gives a true one-sided READ between
      processes of one host, tcp reaches the rest) and `UCX_NET_DEVICES` = the interface
      that holds `host`: loopback for a fleet on one host, the NIC towards the coordinator
      across hosts. Left to itself UCX also offers peers its loopback lane, and connecting
      across hosts then stalled now and then (seen: a 0.8 MiB join took 8-50 s instead of
      0.2). If that interface cannot be found, every interface that is up, loopback only
      where there is no other.
    - Where NVIDIA GPUs are present, `cuda_copy` too (and `cuda_ipc` with
      TENSORHUB_CUDA_IPC=1): NIXL refuses to create its UCX backend on a GPU host whose
      UCX_TLS cannot reach GPU memory, even for a worker whose buffers are all in host memory.
    - `UCX_TCP_CONN_NB=y`: UCX's tcp connects without blocking. A blocking connect to a
      holder that fell silent (a host that lost power or its link) waits out the kernel's
      SYN retries, ~2 minutes, inside NIXL's `add_remote_agent`, where no stall timeout
      reaches; non-blocking, the read that follows makes no progress and is given up
      after the stall timeout like any read of a silent peer.
    - With RDMA devices UCX's own choice (which prefers them) is left alone, but for
      `UCX_TCP_CONN_NB`.
    """
    if rdma_devices(sys_ib):
        return {"UCX_TCP_CONN_NB": "y"}  # (where UCX still picks tcp lanes)
    devices = "lo" if is_loopback(host) else interface_of(host)
    if devices is None:
        devices = ",".join(network_interfaces(sys_net)) or "lo"
    tls = ["tcp", "cma"]
    if cuda_ipc or nvidia_gpus(dev):
        tls.append("cuda_copy")
    if cuda_ipc:
        tls.append("cuda_ipc")
    return {"UCX_NET_DEVICES": devices, "UCX_TLS": ",".join(tls), "UCX_TCP_CONN_NB": "y"}
