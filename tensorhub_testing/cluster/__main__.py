"""`python -m tensorhub_testing.cluster up|down`: an emulated cluster by hand (root), and
the cleanup of clusters that killed runs left behind."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from tensorhub_testing.cluster.namespaces import available, cleanup_stale, clusters
from tensorhub_testing.cluster.topology import DEFAULT_SUBNET, Cluster


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


def _fill_parser(parser: argparse.ArgumentParser) -> None:
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
    parser = argparse.ArgumentParser(prog="python -m tensorhub_testing.cluster",
                                     description="An emulated multi-host cluster on this "
                                     "machine (network, PID, hostname and mount namespaces "
                                     "per host; tc-shaped links). Needs root.")
    _fill_parser(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
