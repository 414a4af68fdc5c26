"""An emulated cluster on one machine: hosts in their own namespaces, joined by shaped links.

Multi-host behaviour (who pulls from whom, what crosses the WAN, what happens when a host
dies) needs several hosts whose links are limited separately, and a test machine is one
host. `Cluster` builds them: each `Host` a network + PID + UTS + mount namespace
(`hosts`), joined per datacenter by a bridge and datacenters by WAN links (`topology`),
shaped by `tc` (`links`), named and recorded so that a killed run's leftovers can be
removed (`namespaces`). ``python -m tensorhub_testing.cluster up|down`` does it by hand.

Needs root, iproute2 (`ip`, `tc`, `bridge`), util-linux (`unshare`, `nsenter`) and
`sysctl`; `available()` says whether this machine can, and why not.
"""

from tensorhub_testing.cluster.hosts import Host, concurrent_tcp_transfers, tcp_transfer
from tensorhub_testing.cluster.links import ClusterError, HostSpec, Rate, Traffic, parse_rate
from tensorhub_testing.cluster.namespaces import RECORDS, available, cleanup_stale, clusters
from tensorhub_testing.cluster.topology import DEFAULT_SUBNET, Cluster

__all__ = ["DEFAULT_SUBNET", "RECORDS", "Cluster", "ClusterError", "Host", "HostSpec", "Rate",
           "Traffic", "available", "cleanup_stale", "clusters", "concurrent_tcp_transfers",
           "parse_rate", "tcp_transfer"]
