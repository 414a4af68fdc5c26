"""The cluster: hosts in their own namespaces, joined by shaped links, built and torn down.

Topology, everything but the hosts living in one "switch" namespace ``PREFIX-sw``::

    h0 eth0 ─veth─ port0 ─┐                              ┌─ port2 ─veth─ eth0 h2
                          bridge dc0 ─ wan1-dc0 ═ wan1-dc1 ─ bridge dc1
    h1 eth0 ─veth─ port1 ─┘        (the WAN link of DC 1)  └─ port3 ─veth─ eth0 h3

DC k > 0 is joined to DC 0 by its own WAN link (a star; DC 1 to DC 2 crosses two links).
All hosts share one IPv4 subnet, so nothing is routed. Every host knows every other
host's MAC (permanent neighbour entries) and every bridge knows every MAC's port (static
forwarding entries), and IPv6 is off: no ARP, neighbour discovery or flooded unicast ever
crosses a link, so the WAN counters count the hosts' own traffic and nothing else. A
host's egress is shaped on its ``eth0``, its ingress on its switch port (the egress
towards it), the WAN on both ends of the WAN link (`links.shape`).
"""

from __future__ import annotations

import atexit
import ipaddress
import re
from collections.abc import Sequence

from tensorhub_testing.cluster.hosts import Host
from tensorhub_testing.cluster.links import (
    HostSpec,
    Rate,
    Traffic,
    bits,
    ip,
    link_stats,
    run,
    shape,
)
from tensorhub_testing.cluster.namespaces import claim, forget_record, remove_namespaces

DEFAULT_SUBNET = "10.213.0.0/16"
_PREFIX_RE = re.compile(r"[a-z][a-z0-9]{0,11}")
_NAME_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,30}[A-Za-z0-9])?")


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
        self.wan = bits(wan)
        self.prefix = claim(prefix)  # from here on, close() must run
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
            bits(spec.egress), bits(spec.ingress)  # a bad rate fails here, not halfway

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
        run(["ip", "netns", "add", name])

    def _up(self) -> None:
        self._add_namespace(self.switch)
        run(["ip", "netns", "exec", self.switch, "sysctl", "-q", "-e", "-w",
              "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"])
        commands = ["link set lo up"]
        for k in range(self.dcs):
            commands += [f"link add name dc{k} type bridge mcast_snooping 0", f"link set dc{k} up"]
        for k in range(1, self.dcs):
            commands += [f"link add name wan{k}-dc0 type veth peer name wan{k}-dc{k}",
                         f"link set wan{k}-dc0 master dc0 up",
                         f"link set wan{k}-dc{k} master dc{k} up"]
        ip(self.switch, *commands)
        for host in self.hosts:
            self._add_namespace(host.namespace)
            host._start()
            ip(self.switch,
                f"link add name {host.port} type veth peer name eth0 address {host.mac} "
                f"netns {host.namespace}",
                f"link set {host.port} master dc{host.dc} up")
            ip(host.namespace, "link set lo up",
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
            ip(host.namespace, *(f"neigh replace {o.address} lladdr {o.mac} dev eth0 "
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
        run(["bridge", "-n", self.switch, "-batch", "-"], input="\n".join(fdb) + "\n")

    # shaping and counters ----------------------------------------------------------------

    def set_wan(self, rate: Rate, dc: int | None = None) -> None:
        """Shape the WAN link of DC `dc` (None: every WAN link), both directions."""
        for k in range(1, self.dcs) if dc is None else [dc]:
            if not 1 <= k < self.dcs:
                raise ValueError(f"DC {k} has no WAN link (DCs 1..{self.dcs - 1} do)")
            shape(self.switch, f"wan{k}-dc0", rate)
            shape(self.switch, f"wan{k}-dc{k}", rate)
        if dc is None:
            self.wan = bits(rate)

    def wan_traffic(self, dc: int = 1) -> Traffic:
        """Bytes that crossed DC `dc`'s WAN link: ``sent`` out of DC `dc` towards DC 0,
        ``received`` into DC `dc` from DC 0."""
        if not 1 <= dc < self.dcs:
            raise ValueError(f"DC {dc} has no WAN link (DCs 1..{self.dcs - 1} do)")
        stats = link_stats(self.switch)
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
        remove_namespaces(self._namespaces)
        forget_record(self.prefix)

